"""Analytic ellipsoid phantoms: exact projections, anti-aliased ground truth, a default specimen,
and the synthetic tilt series of every specimen (:func:`make_tiltseries`). The ellipsoids
themselves (:class:`Ellipsoid`, :class:`Phantom`, :func:`project`, :func:`voxelize`) live in
:mod:`fasttomo.data.ellipsoids` and are re-exported here.

Geometry (README "Geometry conventions"):
  * Physical coordinates are centred and in voxel units (voxel = pixel size). A phantom box of
    shape (Z, Y, X) spans |x| <= X/2, |y| <= Y/2, |z| <= Z/2; voxel (k, i, j) has its centre at
    x = j - (X-1)/2, y = i - (Y-1)/2, z = k - (Z-1)/2.
  * Image pixel (i, j) of an (H, W) image has its centre at u = j - (W-1)/2 (column, along X) and
    v = i - (H-1)/2 (row, along Y = the tilt axis).
  * At tilt angle theta (degrees at the API, radians inside) the point (x, y, z) lands at
    u = x cos(theta) + z sin(theta), v = y (IMOD's final, reoriented frame; +Z toward the source).
    The ray of pixel (u, v) is p(t) = (u cos - t sin, v, u sin + t cos), direction
    (-sin(theta), 0, cos(theta)); (0, 0, +10) at +30 degrees lands at u = +5.
  * A projection value is the line integral of the density along that ray, in voxel-length units.
    Every object lies inside the box (checked when a :class:`Phantom` is built), so the integral
    over all space equals the integral through the box.

  * General poses (:func:`project` with ``poses``) follow :mod:`fasttomo.geometry.poses` exactly:
    view n sees the point p at (u, v, w) = Rz(z3) Ry(theta) Rz(z1) p + (su, sv, 0), so the ray of
    pixel (u, v) is p(t) = R^T ((u - su, v - sv, 0) + t e_z). z1 = z3 = su = sv = 0 is the frame
    above.

Densities of overlapping ellipsoids add.

Seeds (:func:`make_tiltseries`): ``data.phantom_seed`` drives every random draw through
independent streams, so switching one ingredient on or off never changes the others: the noise
uses ``numpy.random.default_rng(seed)`` (as it always has), the random specimen uses
``SeedSequence(seed, spawn_key=(1, k))`` for ellipsoid k (so the first k ellipsoids do not depend
on how many are drawn), and the pose errors ``SeedSequence(seed, spawn_key=(2,))``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from fasttomo.data.ellipsoids import (Ellipsoid, Phantom, _uniform_rotation, project,  # noqa: F401 - public here
                                       voxelize)
from fasttomo.data.specimen import (POSE_KEYS, PhantomError, _pose_arrays, _stream,  # noqa: F401 - public here too
                                     euler_zxz, pose_rotations)
from fasttomo.data.dose import PROJECT_CHUNK_PIXELS, add_noise  # noqa: F401 - public here too
from fasttomo.data.tiltseries import TiltSeries

__all__ = [
    "Ellipsoid",
    "Phantom",
    "PhantomError",
    "default_phantom",
    "default_thickness",
    "euler_zxz",
    "make_tiltseries",
    "pose_rotations",
    "project",
    "random_ellipsoids",
    "random_pose_errors",
    "voxelize",
]

DEFAULT_PIXEL_SIZE = 10.0
"""Pixel (and voxel) size in Angstrom of the built-in phantom when data.pixel_size is not set."""


def _pose_chunk(poses: Mapping[str, Any] | None, lo: int, hi: int, n: int):
    """The per-view entries (sequences of ``n``) of ``poses`` for views lo..hi-1; the rest as is."""
    if poses is None:
        return None
    return {k: (list(v)[lo:hi] if isinstance(v, (list, tuple, np.ndarray)) and len(v) == n else v)
            for k, v in poses.items()}


def project_views(phantom: Phantom, angles_deg: np.ndarray, image_hw: tuple[int, int],
                  poses: Mapping[str, Any] | None = None, chunk_pixels: int | None = None,
                  device: str | None = None) -> np.ndarray:
    """:func:`project` a few views at a time into one float32 (N, H, W) stack: each view's line
    integrals are computed independently of the others, so the stack is :func:`project`'s, bit
    for bit, whatever the chunk, with float64 work arrays of about ``chunk_pixels`` pixels
    (on ``device`` when given: see :func:`project`)."""
    h, w = int(image_hw[0]), int(image_hw[1])
    ang = np.asarray(angles_deg, dtype=np.float64)
    n = ang.shape[0]
    per = max(1, int(chunk_pixels or PROJECT_CHUNK_PIXELS) // max(1, h * w))
    if per >= n:
        return project(phantom, ang, h, w, poses=poses, device=device)
    out = np.empty((n, h, w), dtype=np.float32)
    for lo in range(0, n, per):
        hi = min(n, lo + per)
        out[lo:hi] = project(phantom, ang[lo:hi], h, w, poses=_pose_chunk(poses, lo, hi, n), device=device)
    return out


# --------------------------------------------------------------------------------------- default phantom
def default_thickness(width: int) -> int:
    """Default slab thickness of the built-in phantom: about width/2, an even integer (>= 2)."""
    return max(2, 2 * int(round(width / 4.0)))


# (name, centre xyz, semi-axes, Euler zxz degrees, density) in the reference 64 x 64 x 32 box.
# "body" scales with the box along each axis; the others keep their shape (isotropic scale).
_BODY = ("body", (-4.0, 0.0, 0.0), (18.0, 24.0, 11.0), (15.0, 0.0, 0.0), 0.3)
_FEATURES = (
    ("nucleus", (-9.0, 9.0, 1.0), (7.0, 6.5, 5.5), (30.0, 0.0, 0.0), 0.4),
    ("vacuole (hole)", (-10.0, -7.0, -1.0), (4.5, 4.0, 4.0), (0.0, 0.0, 0.0), -0.2),
    ("dense particle", (3.0, -13.0, -3.0), (3.5, 3.5, 3.5), (0.0, 0.0, 0.0), 1.0),
    ("rod (along y)", (5.0, 8.0, 2.0), (3.0, 8.0, 3.0), (-20.0, 0.0, 0.0), 0.6),
    ("oblate particle", (-3.0, -1.0, 4.0), (3.5, 3.5, 3.0), (0.0, 35.0, 0.0), 0.7),
    ("free particle (outside body)", (-24.0, -25.0, 6.0), (3.5, 3.5, 3.5), (0.0, 0.0, 0.0), 0.9),
)
_HELIX = dict(center=(21.0, 0.0, 0.0), beads=7, radius=5.0, rise=3.5, turn_deg=60.0, bead_radius=2.5, density=1.0)


def _helix_beads(center_xyz: np.ndarray, scale: float) -> list[Ellipsoid]:
    """Right-handed helix of spheres with its axis along +y: (z, x) = r (cos t, sin t), y = rise * t / turn.

    (z, x, y) is a right-handed frame (z x x = y), so the curve (r cos t, r sin t, c t) in it, with
    c > 0, is a right-handed helix (positive torsion).
    """
    h = _HELIX
    n = h["beads"]
    out = []
    for k in range(n):
        t = math.radians(h["turn_deg"]) * (k - (n - 1) / 2.0)
        off = np.array([h["radius"] * math.sin(t), h["rise"] * (k - (n - 1) / 2.0), h["radius"] * math.cos(t)])
        out.append(Ellipsoid(center_xyz + scale * off, (scale * h["bead_radius"],) * 3, None, h["density"],
                             f"helix bead {k}"))
    return out


def default_phantom(width: int = 64, height: int = 64, thickness: int | None = None) -> Phantom:
    """The deterministic phantom of the built-in default reconstruction, scaled to the box.

    A slab (Z = thickness, default about width/2) holding a large low-density body (0.3) with
    denser features inside it (nucleus 0.4, rod 0.6, particles 0.7/1.0, a hole -0.2; densities
    add), a free particle outside the body, and a CHIRAL feature: a right-handed helix of 7 spheres
    (density 1.0) whose axis runs along y (the tilt axis). Designed at 64 x 64 x 32; positions and
    the body scale with the box along each axis, the small features isotropically with
    min(width/64, height/64, thickness/32). Every object is at least ~5 voxels across at the
    reference size, and at the reference size every object stays on the detector for all
    tilts within +-60 degrees.
    """
    width, height = int(width), int(height)
    thickness = default_thickness(width) if thickness is None else int(thickness)
    if min(width, height) < 16 or thickness < 8:
        raise PhantomError(
            f"default_phantom: box (W, H, thickness) = ({width}, {height}, {thickness}) is too small; the built-in "
            "phantom needs W, H >= 16 and thickness >= 8 (set data.width/height/thickness).")
    sxyz = np.array([width / 64.0, height / 64.0, thickness / 32.0])
    s = float(sxyz.min())
    name, c, a, rot, d = _BODY
    ellipsoids = [Ellipsoid(sxyz * np.array(c), sxyz * np.array(a), rot, d, name)]
    for name, c, a, rot, d in _FEATURES:
        ellipsoids.append(Ellipsoid(sxyz * np.array(c), s * np.array(a), rot, d, name))
    ellipsoids += _helix_beads(sxyz * np.array(_HELIX["center"]), s)
    return Phantom((thickness, height, width), ellipsoids, margin=0.5, name="fasttomo default phantom")


# --------------------------------------------------------------------------------------- random specimens
_SPECIMEN_STREAM, _POSE_STREAM = 1, 2


def random_ellipsoids(shape_zyx: Sequence[int], n: int = 8, seed: int = 0,
                      axis_range: tuple[float, float] = (0.05, 0.2),
                      density_range: tuple[float, float] = (0.2, 1.0), margin: float = 2.0,
                      max_tries: int = 100) -> Phantom:
    """A specimen of ``n`` random solid ellipsoids in a box of ``shape_zyx`` = (Z, Y, X) voxels.

    Ellipsoid k is drawn from its own stream ``SeedSequence(seed, spawn_key=(1, k))``, so the
    result is a pure function of the arguments, and the first k ellipsoids are the same whatever
    ``n``. Each ellipsoid, in this order:

    * semi-axes: three independent values uniform in ``axis_range`` times L, the smallest box side
      (default 0.05 L .. 0.2 L: 6.4 to 25.6 voxels in a 128^3 box, so between 13 and 51 voxels
      across);
    * orientation: uniform on SO(3) (Haar measure; a normalized Gaussian quaternion);
    * density: uniform in ``density_range`` (per voxel length; overlapping ellipsoids may
      intersect, and their densities add);
    * centre: uniform over the positions that keep the ellipsoid's axis-aligned bounding box at
      least ``margin`` voxels inside the box (each of x, y, z uniform in +-(half side - margin -
      half extent)), so every ellipsoid lies inside the box and projections are exact.

    When the drawn axes do not fit (a thin box), the axes and orientation are drawn again, up to
    ``max_tries`` times, then a :class:`PhantomError` says what to change.
    """
    shape = tuple(int(v) for v in shape_zyx)
    if len(shape) != 3 or min(shape) < 1:
        raise PhantomError(f"random_ellipsoids: shape_zyx must be 3 positive integers (Z, Y, X), got {shape_zyx!r}.")
    if not (isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1):
        raise PhantomError(f"random_ellipsoids: n must be an integer >= 1, got {n!r}.")
    lo, hi = (float(v) for v in axis_range)
    if not (0 < lo <= hi < 0.5):
        raise PhantomError(f"random_ellipsoids: axis_range must satisfy 0 < low <= high < 0.5 (fractions of the "
                           f"smallest box side), got {axis_range!r}.")
    dlo, dhi = (float(v) for v in density_range)
    if not (math.isfinite(dlo) and math.isfinite(dhi) and dlo <= dhi):
        raise PhantomError(f"random_ellipsoids: density_range must be finite with low <= high, got {density_range!r}.")
    if not (math.isfinite(margin) and margin >= 0):
        raise PhantomError(f"random_ellipsoids: margin must be >= 0 voxels, got {margin!r}.")
    side = float(min(shape))
    room = np.array(shape[::-1], dtype=np.float64) / 2.0 - float(margin)   # (x, y, z) half sides minus margin
    ellipsoids = []
    for k in range(int(n)):
        rng = _stream(seed, _SPECIMEN_STREAM, k)
        for _ in range(int(max_tries)):
            axes = rng.uniform(lo, hi, size=3) * side
            rot = _uniform_rotation(rng)
            density = float(rng.uniform(dlo, dhi))
            half = np.sqrt(((rot * axes[None, :]) ** 2).sum(axis=1))
            free = room - half
            if np.all(free > 0):
                centre = rng.uniform(-1.0, 1.0, size=3) * free
                break
        else:
            raise PhantomError(
                f"random_ellipsoids: ellipsoid {k} does not fit in the box (Z, Y, X) = {shape} with a {margin}-voxel "
                f"margin after {max_tries} draws; lower axis_range (now {axis_range}, fractions of the smallest side) "
                "or the margin, or use a thicker box (data.thickness).")
        ellipsoids.append(Ellipsoid(centre, axes, rot, density, f"ellipsoid {k}"))
    return Phantom(shape, ellipsoids, margin=float(margin),
                   name=f"random ellipsoids (n={int(n)}, seed={int(seed)})")


def random_pose_errors(angles_deg: np.ndarray, shift: float, rotation: float, seed: int = 0,
                       axis: float = 0.0) -> dict:
    """Per-view pose errors of a misaligned series, as the true poses of :func:`project`.

    Shifts su, sv are each uniform in +-``shift`` pixels, the in-plane image rotation z3 uniform in
    +-``rotation`` degrees, z1 = 0 (the specimen-side rotation, which a real stage does not
    wobble). The reference view (smallest |angle|, as ``TiltSeries.reference_index``) gets no
    random error, so these poses are directly comparable with the ones fasttomo learns (which keep
    that view's shift at zero). ``axis`` (degrees) is an error of the tilt-axis angle: one image
    rotation added to every view's z3, the reference's included. Drawn from
    ``SeedSequence(seed, spawn_key=(2,))``: unit draws scaled by ``shift``/``rotation``, so the
    error pattern is the same whatever the magnitudes.

    Returns {"reference_index", "tilt_deg", "z1_deg", "z3_deg", "shift_u_px", "shift_v_px"} with
    per-view lists (the keys of ``Poses.describe()``).
    """
    ang = np.asarray(angles_deg, dtype=np.float64)
    tilt = ang if ang.ndim == 1 else ang.mean(axis=1)
    n = tilt.shape[0]
    for name, val in (("shift", shift), ("rotation", rotation)):
        if not (isinstance(val, (int, float)) and math.isfinite(val) and val >= 0):
            raise PhantomError(f"random_pose_errors: {name} must be a number >= 0, got {val!r}.")
    if not (isinstance(axis, (int, float)) and math.isfinite(axis) and abs(axis) <= 45.0):
        raise PhantomError(f"random_pose_errors: axis must be a number of degrees in [-45, 45], got {axis!r}.")
    rng = _stream(seed, _POSE_STREAM)
    unit_shift = rng.uniform(-1.0, 1.0, size=(n, 2))
    unit_rot = rng.uniform(-1.0, 1.0, size=n)
    ref = int(np.argmin(np.abs(tilt)))
    shifts = unit_shift * float(shift)
    z3 = unit_rot * float(rotation)
    shifts[ref] = 0.0
    z3[ref] = 0.0
    z3 = z3 + float(axis)
    return {
        "reference_index": ref,
        "tilt_deg": [float(a) for a in tilt],
        "z1_deg": [0.0] * n,
        "z3_deg": [float(a) for a in z3],
        "shift_u_px": [float(a) for a in shifts[:, 0]],
        "shift_v_px": [float(a) for a in shifts[:, 1]],
    }


# --------------------------------------------------------------------------------------- tilt series
def _build_specimen(cfg: Any, kind: str, seed: int) -> tuple[Any, int, float]:
    """(specimen, thickness, pixel size in A) of ``cfg.phantom`` (see :func:`make_tiltseries`)."""
    pix = DEFAULT_PIXEL_SIZE if cfg.pixel_size is None else float(cfg.pixel_size)
    if cfg.thickness is not None:
        thickness = int(cfg.thickness)
    elif kind == "default":
        thickness = default_thickness(cfg.width)
    elif kind == "cell":
        from fasttomo.data.specimens import CELL_PIXEL_SIZE, cell_thickness

        thickness = cell_thickness(cfg.width, CELL_PIXEL_SIZE if cfg.pixel_size is None else pix)
    else:
        thickness = int(cfg.width)
    shape = (thickness, cfg.height, cfg.width)
    if kind == "default":
        return default_phantom(cfg.width, cfg.height, thickness), thickness, pix
    if kind == "ellipsoids":
        return random_ellipsoids(shape, int(cfg.n_ellipsoids), seed), thickness, pix
    if kind == "nanoparticle":
        from fasttomo.data.atoms import DEFAULT_ATOM_PIXEL_SIZE, nanoparticle

        pix = DEFAULT_ATOM_PIXEL_SIZE if cfg.pixel_size is None else pix
        return nanoparticle(shape, pix, cfg.particle, seed), thickness, pix
    if kind in ("cell", "catalyst"):
        from fasttomo.data import specimens

        default = specimens.CELL_PIXEL_SIZE if kind == "cell" else specimens.CATALYST_PIXEL_SIZE
        pix = default if cfg.pixel_size is None else pix
        return getattr(specimens, kind)(shape, pix, seed), thickness, pix
    raise PhantomError(f"data.phantom: unknown specimen {kind!r}; use default, ellipsoids, nanoparticle, cell or catalyst.")


def make_tiltseries(cfg: Any, device: str | None = None, truth: bool = True) -> TiltSeries:
    """The built-in synthetic tilt series of a :class:`fasttomo.config.DataConfig`.

    Specimen: ``cfg.phantom`` = default (:func:`default_phantom`; thickness None: about W/2, see
    :func:`default_thickness`), ellipsoids (:func:`random_ellipsoids` with ``cfg.n_ellipsoids``
    and ``cfg.phantom_seed``; thickness None: W, a cube for square images), nanoparticle
    (:func:`fasttomo.data.atoms.nanoparticle` of ``cfg.particle``; thickness None: W; pixel size
    None: 0.75 A; ``metadata["true_atoms"]`` holds the true atoms in atoms.csv's frame; the ground
    truth is the density at the voxel centres), cell or catalyst (:mod:`fasttomo.data.specimens`;
    thickness None: W/2 for the cell section, or what holds its smallest vesicle if more
    (:func:`fasttomo.data.specimens.cell_thickness`), W for the catalyst; pixel size None: 10 A
    and 2.5 A). Views: cfg.n_tilts angles evenly spaced over [tilt_min, tilt_max]. Pose errors
    (``cfg.pose_error_shift`` px, ``cfg.pose_error_rotation`` degrees, :func:`random_pose_errors`):
    when either is > 0 the views are projected with those poses and ``metadata["true_poses"]``
    holds them (absent otherwise). Detector (:mod:`fasttomo.data.dose`): the exact line integrals,
    or with ``cfg.dose`` the Poisson counts of a linear bright-field image (inverted unless
    ``cfg.invert=false``); Gaussian noise of std cfg.noise times the std (``noise_relative_to=std``)
    or the maximum (``max``) of the clean image, drawn from numpy's default_rng(cfg.phantom_seed).
    Pixel size: cfg.pixel_size (None: 10 A). The ground truth is :func:`voxelize` of the specimen
    at (thickness, height, width) (the specimens' own volume for nanoparticle, cell, catalyst);
    poses move the views, not the specimen. The options that prepare real data (binning, crop,
    normalize, ...) do not apply. ``device`` (a torch device such as "cuda") projects and voxelizes
    the ellipsoid specimens there, with the same values bit for bit (:func:`project`); the other
    specimens and the detector stay on the CPU. ``truth=False`` skips the ground truth
    (``ground_truth`` None), for a box too big to keep.
    """
    from fasttomo.data.dose import detect

    kind = getattr(cfg, "phantom", "default")
    seed = int(cfg.phantom_seed)
    specimen, thickness, pixel_size = _build_specimen(cfg, kind, seed)
    angles = np.linspace(float(cfg.tilt_min), float(cfg.tilt_max), int(cfg.n_tilts))
    shift_err = float(getattr(cfg, "pose_error_shift", 0.0))
    rot_err = float(getattr(cfg, "pose_error_rotation", 0.0))
    axis_err = float(getattr(cfg, "tilt_axis_error", 0.0))
    true_poses = (random_pose_errors(angles, shift_err, rot_err, seed, axis=axis_err)
                  if (shift_err > 0 or rot_err > 0 or axis_err != 0) else None)
    analytic = isinstance(specimen, Phantom)
    clean = (project_views(specimen, angles, (cfg.height, cfg.width), true_poses, device=device) if analytic
             else specimen.project(angles, cfg.height, cfg.width, poses=true_poses))
    stack, detector = detect(clean, cfg, seed)
    metadata = {
        "phantom": specimen.describe(),
        "phantom_kind": kind,
        "thickness": thickness,
        "noise": float(cfg.noise),
        "noise_relative_to": getattr(cfg, "noise_relative_to", "std"),
        "noise_std": detector["noise_std"],
        "clean_projection_std": float(clean.std()),
        "clean_projection_max": float(clean.max()),
        "detector": detector,
        "phantom_seed": seed,
        "tilt_range_deg": [float(cfg.tilt_min), float(cfg.tilt_max)],
        "pose_error_shift_px": shift_err,
        "pose_error_rotation_deg": rot_err,
        "tilt_axis_error_deg": axis_err,
        "geometry": "u = x cos(theta) + z sin(theta), v = y (IMOD reoriented frame); exact line integrals",
    }
    if kind == "nanoparticle":
        metadata["true_atoms"] = specimen.table(pixel_size)  # atoms.csv's frame (fasttomo-simulate writes it)
        metadata["geometry"] += "; Gaussian atoms project to 2-D Gaussians (fasttomo.data.atoms)"
    if not truth:
        truth = None
    else:
        truth = voxelize(specimen, (thickness, cfg.height, cfg.width), device=device) if analytic else specimen.volume()
    if true_poses is not None:
        metadata["true_poses"] = true_poses
        metadata["geometry"] += ("; view n posed as (u, v, w) = Rz(z3) Ry(theta) Rz(z1) p + (su, sv, 0) with "
                                 "metadata['true_poses'] (fasttomo.geometry.poses)")
    return TiltSeries(stack=stack, angles=angles, pixel_size=pixel_size, source="phantom", metadata=metadata,
                      ground_truth=truth)
