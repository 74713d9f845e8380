"""Analytic ellipsoid phantoms: exact projections, anti-aliased ground truth, a default specimen.

Geometry (DESIGN.md, "Conventions that must not drift"):
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

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from fasttomo.data.specimen import (POSE_KEYS, PhantomError, _pose_arrays, _stream,  # noqa: F401 - public here too
                                     euler_zxz, pose_rotations)
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


_MIRROR = np.diag([-1.0, 1.0, 1.0])


@dataclasses.dataclass(eq=False)
class Ellipsoid:
    """A solid ellipsoid of constant density.

    The point p is inside when |diag(1/semi_axes) @ R.T @ (p - center_xyz)| <= 1.
    """

    center_xyz: Any
    """Centre (x, y, z) in centred voxel units."""
    semi_axes: Any
    """Semi-axis lengths (a, b, c) in voxels, along the body axes (columns of the rotation)."""
    rotation: Any = None
    """3x3 proper rotation matrix (body -> world), or 3 Euler angles in degrees (z-x-z, see
    :func:`euler_zxz`); None is the identity (axes along x, y, z)."""
    density: float = 1.0
    """Density per voxel length (added to the densities of overlapping ellipsoids; may be negative
    for a hole inside a larger body)."""
    name: str = ""
    """Label used in descriptions and metadata."""

    def __post_init__(self) -> None:
        c = np.asarray(self.center_xyz, dtype=np.float64)
        a = np.asarray(self.semi_axes, dtype=np.float64)
        if c.shape != (3,) or not np.all(np.isfinite(c)):
            raise PhantomError(f"ellipsoid {self.name!r}: center_xyz must be 3 finite numbers, got {self.center_xyz!r}.")
        if a.shape != (3,) or not np.all(np.isfinite(a)) or np.any(a <= 0):
            raise PhantomError(
                f"ellipsoid {self.name!r}: semi_axes must be 3 positive numbers (voxels), got {self.semi_axes!r}.")
        if self.rotation is None:
            r = np.eye(3)
        else:
            r = np.asarray(self.rotation, dtype=np.float64)
            if r.shape == (3,):
                r = euler_zxz(r)
            elif r.shape != (3, 3):
                raise PhantomError(
                    f"ellipsoid {self.name!r}: rotation must be a 3x3 matrix or 3 Euler angles in degrees, "
                    f"got shape {r.shape}.")
            if not (np.allclose(r.T @ r, np.eye(3), atol=1e-8) and np.linalg.det(r) > 0):
                raise PhantomError(
                    f"ellipsoid {self.name!r}: rotation is not a proper rotation (orthonormal, det +1); "
                    "a reflection would change the handedness, use Phantom.mirror() for that.")
        d = float(self.density)
        if not math.isfinite(d):
            raise PhantomError(f"ellipsoid {self.name!r}: density must be finite, got {self.density!r}.")
        self.center_xyz, self.semi_axes, self.rotation, self.density = c, a, r, d
        for arr in (c, a, r):
            arr.setflags(write=False)

    @property
    def world_to_unit(self) -> np.ndarray:
        """M = diag(1/a) R^T: maps p - center to the unit-sphere frame."""
        return self.rotation.T / self.semi_axes[:, None]

    @property
    def half_extent(self) -> np.ndarray:
        """Half sizes (x, y, z) of the axis-aligned bounding box."""
        return np.sqrt(((self.rotation * self.semi_axes[None, :]) ** 2).sum(axis=1))

    @property
    def volume(self) -> float:
        return float(4.0 / 3.0 * math.pi * np.prod(self.semi_axes))

    def mirror(self) -> "Ellipsoid":
        """The mirror image under x -> -x (a proper rotation P R P and the centre reflected)."""
        return Ellipsoid(_MIRROR @ self.center_xyz, self.semi_axes.copy(), _MIRROR @ self.rotation @ _MIRROR,
                         self.density, self.name)

    def density_at(self, points_xyz: np.ndarray) -> np.ndarray:
        """Density of this ellipsoid alone at points (..., 3) (x, y, z)."""
        q = (np.asarray(points_xyz, dtype=np.float64) - self.center_xyz) @ self.world_to_unit.T
        return np.where(np.einsum("...k,...k->...", q, q) <= 1.0, self.density, 0.0)

    def describe(self) -> dict:
        """A JSON-serializable description."""
        return {
            "name": self.name,
            "center_xyz": [round(float(v), 6) for v in self.center_xyz],
            "semi_axes": [round(float(v), 6) for v in self.semi_axes],
            "rotation": [[round(float(v), 9) for v in row] for row in self.rotation],
            "density": self.density,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ellipsoid):
            return NotImplemented
        return (np.allclose(self.center_xyz, other.center_xyz, rtol=0, atol=1e-12)
                and np.allclose(self.semi_axes, other.semi_axes, rtol=0, atol=1e-12)
                and np.allclose(self.rotation, other.rotation, rtol=0, atol=1e-12)
                and self.density == other.density and self.name == other.name)


@dataclasses.dataclass(eq=False)
class Phantom:
    """Ellipsoids inside a box of shape (Z, Y, X) voxels; densities add."""

    shape_zyx: Any
    """(Z, Y, X) box size in voxels: the box spans |x| <= X/2, |y| <= Y/2, |z| <= Z/2."""
    ellipsoids: Any
    """The ellipsoids (a sequence of :class:`Ellipsoid`)."""
    margin: float = 0.5
    """Every ellipsoid's bounding box must stay this many voxels inside the box."""
    name: str = "phantom"

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape_zyx)
        if len(shape) != 3 or any(s < 1 for s in shape) or any(int(s) != s for s in self.shape_zyx):
            raise PhantomError(f"phantom shape_zyx must be 3 positive integers (Z, Y, X), got {self.shape_zyx!r}.")
        self.shape_zyx = shape
        self.ellipsoids = tuple(self.ellipsoids)
        if not self.ellipsoids:
            raise PhantomError("a phantom needs at least one ellipsoid.")
        half_xyz = np.array(shape[::-1], dtype=np.float64) / 2.0
        for k, e in enumerate(self.ellipsoids):
            if not isinstance(e, Ellipsoid):
                raise PhantomError(f"phantom ellipsoid {k} is a {type(e).__name__}, not an Ellipsoid.")
            reach = np.abs(e.center_xyz) + e.half_extent
            if np.any(reach > half_xyz - self.margin + 1e-9):
                raise PhantomError(
                    f"ellipsoid {k} ({e.name or 'unnamed'}) reaches |x, y, z| = {np.round(reach, 3).tolist()} but the "
                    f"box (Z, Y, X) = {shape} allows {np.round(half_xyz - self.margin, 3).tolist()} (half size minus a "
                    f"{self.margin}-voxel margin); move or shrink it, or enlarge the box. Projections assume every "
                    "object lies inside the box.")

    @property
    def mass(self) -> float:
        """Exact integral of the density over space (voxel^3 units)."""
        return float(sum(e.density * e.volume for e in self.ellipsoids))

    def density(self, points_xyz: np.ndarray) -> np.ndarray:
        """Density (float64) at points (..., 3) given as (x, y, z) in centred voxel units."""
        p = np.asarray(points_xyz, dtype=np.float64)
        out = np.zeros(p.shape[:-1])
        for e in self.ellipsoids:
            out += e.density_at(p)
        return out

    def mirror(self) -> "Phantom":
        """The mirror-image phantom (x -> -x); mirror().mirror() equals the original."""
        return Phantom(self.shape_zyx, [e.mirror() for e in self.ellipsoids], self.margin,
                       self.name[:-len(" (mirrored)")] if self.name.endswith(" (mirrored)") else self.name + " (mirrored)")

    def describe(self) -> dict:
        """A JSON-serializable description (for TiltSeries metadata)."""
        return {
            "name": self.name,
            "shape_zyx": list(self.shape_zyx),
            "mass": self.mass,
            "ellipsoids": [e.describe() for e in self.ellipsoids],
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Phantom):
            return NotImplemented
        return (self.shape_zyx == other.shape_zyx and len(self.ellipsoids) == len(other.ellipsoids)
                and all(a == b for a, b in zip(self.ellipsoids, other.ellipsoids)))


# --------------------------------------------------------------------------------------- projection
def project(phantom: Phantom, angles_deg: np.ndarray, height: int | None = None,
            width: int | None = None, poses: Mapping[str, Any] | None = None) -> np.ndarray:
    """Exact line integrals of ``phantom`` at the pixel centres: (N, H, W) float32.

    ``angles_deg`` is (N,) (one tilt angle per image) or (N, H) (one angle per image line, for
    continuous-rotation data). ``height``/``width`` default to the phantom's Y/X box size.

    ``poses`` (None: the ideal geometry) gives every view its in-plane rotations and shifts with
    the convention of :mod:`fasttomo.geometry.poses`: a mapping with any of the keys ``z1_deg``,
    ``z3_deg`` (degrees) and ``shift_u_px``, ``shift_v_px`` (pixels), each N numbers (a missing
    key is zeros). It is the format of ``Poses.describe()`` and of ``metadata["true_poses"]``;
    their other keys are ignored, except ``tilt_deg``, which must then match ``angles_deg`` (per
    view, or the per-line mean) to 1e-3 degrees, a guard against poses of another series or
    order. Every view is posed as given (no reference view is special here).

    For each ellipsoid the ray p(t) = p0 + t d, mapped to the unit-sphere frame, is e + t f with
    e = M (p0 - c), f = M d; its chord length is 2 sqrt(max(B^2 - A C, 0)) / A with A = f.f,
    B = e.f, C = e.e - 1. Since e is affine in (u, v), the discriminant is a quadratic in u whose
    coefficients depend on (tilt, row) only, so the work per pixel is a few flops. Without poses
    only the image rows an ellipsoid can reach are computed; with poses (rotated images) every
    row is (61 views of 128 x 128 pixels and 8 ellipsoids: well under a second).
    """
    height = phantom.shape_zyx[1] if height is None else int(height)
    width = phantom.shape_zyx[2] if width is None else int(width)
    if height < 1 or width < 1:
        raise PhantomError(f"project: image size (H, W) = ({height}, {width}) must be positive.")
    ang = np.asarray(angles_deg, dtype=np.float64)
    if ang.ndim == 1:
        theta = np.broadcast_to(np.deg2rad(ang)[:, None], (ang.shape[0], height))
    elif ang.ndim == 2 and ang.shape[1] == height:
        theta = np.deg2rad(ang)
    else:
        raise PhantomError(
            f"project: angles must be (n_tilts,) or (n_tilts, H) = (n_tilts, {height}) degrees, got shape {ang.shape}.")
    if not np.all(np.isfinite(theta)) or np.any(np.abs(theta) >= math.pi / 2):
        raise PhantomError("project: angles must be finite degrees within (-90, 90).")
    if poses is not None:
        mean_deg = ang if ang.ndim == 1 else ang.mean(axis=1)
        z1, z3, su, sv = _pose_arrays(poses, mean_deg)
        return _project_posed(phantom, theta, height, width, z1, z3, su, sv)
    n = theta.shape[0]
    cos, sin = np.cos(theta)[..., None], np.sin(theta)[..., None]          # (N, H, 1)
    u = np.arange(width, dtype=np.float64) - (width - 1) / 2.0             # (W,)
    v = np.arange(height, dtype=np.float64) - (height - 1) / 2.0           # (H,)
    out = np.zeros((n, height, width), dtype=np.float64)
    for e in phantom.ellipsoids:
        ey = e.half_extent[1]
        i0 = max(0, int(math.floor(e.center_xyz[1] - ey + (height - 1) / 2.0)))
        i1 = min(height, int(math.ceil(e.center_xyz[1] + ey + (height - 1) / 2.0)) + 1)
        if i0 >= i1:
            continue
        m = e.world_to_unit
        mc = m @ e.center_xyz
        c_, s_ = cos[:, i0:i1], sin[:, i0:i1]                               # (N, h, 1)
        g = c_ * m[:, 0] + s_ * m[:, 2]                                    # (N, h, 3): d e / d u
        f = -s_ * m[:, 0] + c_ * m[:, 2]                                   # (N, h, 3): ray direction
        w = v[i0:i1, None] * m[:, 1] - mc                                  # (h, 3): e at u = 0
        gg, gf, ff = (g * g).sum(-1), (g * f).sum(-1), (f * f).sum(-1)     # (N, h)
        gw, wf = (g * w).sum(-1), (w * f).sum(-1)
        ww = (w * w).sum(-1)
        p2 = gf * gf - ff * gg
        p1 = 2.0 * (gf * wf - ff * gw)
        p0 = wf * wf - ff * (ww - 1.0)
        disc = (p2[..., None] * u + p1[..., None]) * u + p0[..., None]    # (N, h, W)
        np.maximum(disc, 0.0, out=disc)
        out[:, i0:i1] += np.sqrt(disc) * (2.0 * e.density / ff)[..., None]
    return out.astype(np.float32)


PROJECT_CHUNK_PIXELS = 1 << 24
"""project_views computes about this many pixels (views x H x W) at a time (its float64 work
arrays: ~128 MB each), so a camera-sized series never needs (N, H, W) float64 arrays whole."""


def _pose_chunk(poses: Mapping[str, Any] | None, lo: int, hi: int, n: int):
    """The per-view entries (sequences of ``n``) of ``poses`` for views lo..hi-1; the rest as is."""
    if poses is None:
        return None
    return {k: (list(v)[lo:hi] if isinstance(v, (list, tuple, np.ndarray)) and len(v) == n else v)
            for k, v in poses.items()}


def project_views(phantom: Phantom, angles_deg: np.ndarray, image_hw: tuple[int, int],
                  poses: Mapping[str, Any] | None = None, chunk_pixels: int | None = None) -> np.ndarray:
    """:func:`project` a few views at a time into one float32 (N, H, W) stack: each view's line
    integrals are computed independently of the others, so the stack is :func:`project`'s, bit
    for bit, whatever the chunk, with float64 work arrays of about ``chunk_pixels`` pixels."""
    h, w = int(image_hw[0]), int(image_hw[1])
    ang = np.asarray(angles_deg, dtype=np.float64)
    n = ang.shape[0]
    per = max(1, int(chunk_pixels or PROJECT_CHUNK_PIXELS) // max(1, h * w))
    if per >= n:
        return project(phantom, ang, h, w, poses=poses)
    out = np.empty((n, h, w), dtype=np.float32)
    for lo in range(0, n, per):
        hi = min(n, lo + per)
        out[lo:hi] = project(phantom, ang[lo:hi], h, w, poses=_pose_chunk(poses, lo, hi, n))
    return out


def add_noise(stack: np.ndarray, std: float, seed: int, chunk_pixels: int | None = None) -> None:
    """Add Gaussian noise of ``std`` from numpy's default_rng(``seed``) to the float32 ``stack`` in
    place, a few views at a time: the generator's stream does not depend on how the draws are
    split, so the result equals ``(stack + rng.normal(0, std, stack.shape)).astype(float32)``."""
    rng = np.random.default_rng(seed)
    per = max(1, int(chunk_pixels or PROJECT_CHUNK_PIXELS) // max(1, stack.shape[1] * stack.shape[2]))
    for lo in range(0, stack.shape[0], per):
        part = stack[lo:lo + per]
        part[...] = (part + rng.normal(0.0, std, size=part.shape)).astype(np.float32)


def _dot3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dot product over the last axis (3), written out: the same rounding whatever the shape."""
    return a[..., 0] * b[..., 0] + a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2]


def _project_posed(phantom: Phantom, theta: np.ndarray, height: int, width: int, z1: np.ndarray,
                   z3: np.ndarray, su: np.ndarray, sv: np.ndarray) -> np.ndarray:
    """:func:`project` with poses: theta (N, H) radians, z1/z3 (N,) radians, su/sv (N,) pixels.

    The ray of pixel (u, v) is p(t) = R^T ((u - su, v - sv, 0) + t e_z), so in the unit-sphere
    frame of an ellipsoid e(t) = (u - su) g + w + t f with g = M R^T e_x = M (row 0 of R),
    f = M (row 2 of R), w = (v - sv) M (row 1 of R) - M c: the same quadratic in u as the fast
    path, with rotated g/f and a shifted u. Dot products are written out element-wise, so an
    integer shift reproduces the unshifted image's pixels bit for bit.
    """
    rot = pose_rotations(theta, z1[:, None], z3[:, None])                  # (N, H, 3, 3)
    r0, r1, r2 = rot[..., 0, :], rot[..., 1, :], rot[..., 2, :]            # R^T e_x, R^T e_y, R^T e_z
    u = np.arange(width, dtype=np.float64) - (width - 1) / 2.0
    v = np.arange(height, dtype=np.float64) - (height - 1) / 2.0
    up = u[None, None, :] - su[:, None, None]                              # (N, 1, W)
    vp = (v[None, :] - sv[:, None])[..., None]                             # (N, H, 1)
    out = np.zeros((theta.shape[0], height, width), dtype=np.float64)
    for e in phantom.ellipsoids:
        m = e.world_to_unit
        mc = m @ e.center_xyz

        def mul(r: np.ndarray) -> np.ndarray:                              # M @ r over (N, H)
            return np.stack([_dot3(r, m[k]) for k in range(3)], axis=-1)

        g, f = mul(r0), mul(r2)                                            # (N, H, 3)
        w = vp * mul(r1) - mc
        gg, gf, ff = _dot3(g, g), _dot3(g, f), _dot3(f, f)
        gw, wf, ww = _dot3(g, w), _dot3(w, f), _dot3(w, w)
        p2 = gf * gf - ff * gg
        p1 = 2.0 * (gf * wf - ff * gw)
        p0 = wf * wf - ff * (ww - 1.0)
        disc = (p2[..., None] * up + p1[..., None]) * up + p0[..., None]  # (N, H, W)
        np.maximum(disc, 0.0, out=disc)
        out += np.sqrt(disc) * (2.0 * e.density / ff)[..., None]
    return out.astype(np.float32)


# --------------------------------------------------------------------------------------- voxelization
def voxelize(phantom: Phantom, shape_zyx: Sequence[int] | None = None, supersample: int = 2) -> np.ndarray:
    """Ground-truth volume (Z, Y, X) float32: the density averaged over supersample^3 points per voxel.

    The grid samples the phantom's box; ``shape_zyx`` (default: the box itself, one voxel per
    voxel unit) may differ from it, then the voxel size along each axis is box / shape (the values
    stay densities per original voxel length). The sub-samples sit at the centres of a regular
    supersample^3 split of each voxel, which anti-aliases the object boundaries (partial volume).
    """
    box = np.array(phantom.shape_zyx, dtype=np.float64)
    shape = tuple(phantom.shape_zyx) if shape_zyx is None else tuple(int(s) for s in shape_zyx)
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise PhantomError(f"voxelize: shape_zyx must be 3 positive integers, got {shape_zyx!r}.")
    ss = int(supersample)
    if ss < 1:
        raise PhantomError(f"voxelize: supersample must be an integer >= 1, got {supersample!r}.")
    step = box / np.array(shape, dtype=np.float64)                          # voxel size (z, y, x)
    vol = np.zeros(shape, dtype=np.float64)
    # fine-grid coordinate of fine index q along an axis of n voxels: ((q + 0.5) / ss - n / 2) * step
    for e in phantom.ellipsoids:
        lo_xyz, hi_xyz = e.center_xyz - e.half_extent, e.center_xyz + e.half_extent
        rng = []
        for ax in range(3):                                                  # z, y, x
            n, h = shape[ax], step[ax]
            lo, hi = lo_xyz[2 - ax], hi_xyz[2 - ax]
            a = max(0, int(math.floor(lo / h + n / 2.0)))
            b = min(n, int(math.ceil(hi / h + n / 2.0)))
            rng.append((a, b))
        if any(a >= b for a, b in rng):
            continue
        coords = [((np.arange(a * ss, b * ss) + 0.5) / ss - shape[ax] / 2.0) * step[ax]
                  for ax, (a, b) in enumerate(rng)]
        z = coords[0][:, None, None] - e.center_xyz[2]
        y = coords[1][None, :, None] - e.center_xyz[1]
        x = coords[2][None, None, :] - e.center_xyz[0]
        m = e.world_to_unit
        r2 = np.zeros((z.shape[0], y.shape[1], x.shape[2]))
        for k in range(3):
            q = m[k, 0] * x + m[k, 1] * y + m[k, 2] * z
            r2 += q * q
        inside = (r2 <= 1.0).reshape(rng[0][1] - rng[0][0], ss, rng[1][1] - rng[1][0], ss, rng[2][1] - rng[2][0], ss)
        frac = inside.mean(axis=(1, 3, 5))
        (za, zb), (ya, yb), (xa, xb) = rng
        vol[za:zb, ya:yb, xa:xb] += e.density * frac
    return vol.astype(np.float32)


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


def _uniform_rotation(rng: np.random.Generator) -> np.ndarray:
    """A rotation matrix uniformly distributed on SO(3) (Haar): a normalized Gaussian quaternion."""
    q = rng.normal(size=4)
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])


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
def make_tiltseries(cfg: Any) -> TiltSeries:
    """The built-in synthetic tilt series of a :class:`fasttomo.config.DataConfig`.

    Specimen: ``cfg.phantom`` = default (:func:`default_phantom`; thickness None: about W/2, see
    :func:`default_thickness`), ellipsoids (:func:`random_ellipsoids` with ``cfg.n_ellipsoids``
    and ``cfg.phantom_seed``; thickness None: W, a cube for square images) or nanoparticle
    (:func:`fasttomo.data.atoms.nanoparticle` of ``cfg.particle``; thickness None: W; pixel size
    None: 0.75 A; ``metadata["true_atoms"]`` holds the true atoms in atoms.csv's frame; the ground
    truth is the density at the voxel centres). Views: cfg.n_tilts
    angles evenly spaced over [tilt_min, tilt_max]. Pose errors (``cfg.pose_error_shift`` px,
    ``cfg.pose_error_rotation`` degrees, :func:`random_pose_errors`): when either is > 0 the views
    are projected with those poses and ``metadata["true_poses"]`` holds them (absent otherwise).
    Noise: Gaussian, std = cfg.noise times the std (``noise_relative_to=std``) or the maximum
    (``max``) of the clean projections, drawn from numpy's default_rng(cfg.phantom_seed).
    Pixel size: cfg.pixel_size (None: 10 A). The ground truth is :func:`voxelize` of the specimen
    at (thickness, height, width); poses move the views, not the specimen. The options that
    prepare real data (binning, crop, normalize, ...) do not apply.
    """
    kind = getattr(cfg, "phantom", "default")
    seed = int(cfg.phantom_seed)
    if kind == "default":
        thickness = default_thickness(cfg.width) if cfg.thickness is None else int(cfg.thickness)
        phantom = default_phantom(cfg.width, cfg.height, thickness)
    elif kind == "ellipsoids":
        thickness = int(cfg.width) if cfg.thickness is None else int(cfg.thickness)
        phantom = random_ellipsoids((thickness, cfg.height, cfg.width), int(cfg.n_ellipsoids), seed)
    elif kind == "nanoparticle":
        from fasttomo.data.atoms import DEFAULT_ATOM_PIXEL_SIZE, nanoparticle

        thickness = int(cfg.width) if cfg.thickness is None else int(cfg.thickness)
        pix = DEFAULT_ATOM_PIXEL_SIZE if cfg.pixel_size is None else float(cfg.pixel_size)
        phantom = nanoparticle((thickness, cfg.height, cfg.width), pix, cfg.particle, seed)
    else:
        raise PhantomError(f"data.phantom: unknown specimen {kind!r}; use default, ellipsoids or nanoparticle.")
    angles = np.linspace(float(cfg.tilt_min), float(cfg.tilt_max), int(cfg.n_tilts))
    shift_err = float(getattr(cfg, "pose_error_shift", 0.0))
    rot_err = float(getattr(cfg, "pose_error_rotation", 0.0))
    axis_err = float(getattr(cfg, "tilt_axis_error", 0.0))
    true_poses = (random_pose_errors(angles, shift_err, rot_err, seed, axis=axis_err)
                  if (shift_err > 0 or rot_err > 0 or axis_err != 0) else None)
    if kind == "nanoparticle":
        stack = phantom.project(angles, cfg.height, cfg.width, poses=true_poses)
    else:
        stack = project_views(phantom, angles, (cfg.height, cfg.width), true_poses)
    relative_to = getattr(cfg, "noise_relative_to", "std")
    clean_std, clean_max = float(stack.std()), float(stack.max())
    if relative_to == "std":
        noise_std = float(cfg.noise) * clean_std
    elif relative_to == "max":
        noise_std = float(cfg.noise) * clean_max
    else:
        raise PhantomError(f"data.noise_relative_to: must be std or max, got {relative_to!r}.")
    if noise_std > 0:
        add_noise(stack, noise_std, seed)
    if kind == "nanoparticle":
        pixel_size = pix
    else:
        pixel_size = DEFAULT_PIXEL_SIZE if cfg.pixel_size is None else float(cfg.pixel_size)
    metadata = {
        "phantom": phantom.describe(),
        "phantom_kind": kind,
        "thickness": thickness,
        "noise": float(cfg.noise),
        "noise_relative_to": relative_to,
        "noise_std": noise_std,
        "clean_projection_std": clean_std,
        "clean_projection_max": clean_max,
        "phantom_seed": seed,
        "tilt_range_deg": [float(cfg.tilt_min), float(cfg.tilt_max)],
        "pose_error_shift_px": shift_err,
        "pose_error_rotation_deg": rot_err,
        "tilt_axis_error_deg": axis_err,
        "geometry": "u = x cos(theta) + z sin(theta), v = y (IMOD reoriented frame); exact line integrals",
    }
    if kind == "nanoparticle":
        metadata["true_atoms"] = phantom.table(pixel_size)  # atoms.csv's frame (fasttomo-simulate writes it)
        metadata["geometry"] += "; Gaussian atoms project to 2-D Gaussians (fasttomo.data.atoms)"
        truth = phantom.volume()
    else:
        truth = voxelize(phantom, (thickness, cfg.height, cfg.width))
    if true_poses is not None:
        metadata["true_poses"] = true_poses
        metadata["geometry"] += ("; view n posed as (u, v, w) = Rz(z3) Ry(theta) Rz(z1) p + (su, sv, 0) with "
                                 "metadata['true_poses'] (fasttomo.geometry.poses)")
    return TiltSeries(stack=stack, angles=angles, pixel_size=pixel_size, source="phantom", metadata=metadata,
                      ground_truth=truth)
