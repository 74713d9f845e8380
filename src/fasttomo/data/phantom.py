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

Densities of overlapping ellipsoids add.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from fasttomo.data.tiltseries import TiltSeries

__all__ = [
    "Ellipsoid",
    "Phantom",
    "PhantomError",
    "default_phantom",
    "default_thickness",
    "euler_zxz",
    "make_tiltseries",
    "project",
    "voxelize",
]

DEFAULT_PIXEL_SIZE = 10.0
"""Pixel (and voxel) size in Angstrom of the built-in phantom when data.pixel_size is not set."""


class PhantomError(ValueError):
    """Raised for a phantom that cannot be built; the message names the problem and the fix."""


_MIRROR = np.diag([-1.0, 1.0, 1.0])


def euler_zxz(angles_deg: Sequence[float]) -> np.ndarray:
    """Rotation matrix R = Rz(a) @ Rx(b) @ Rz(c) of the Euler angles (a, b, c) in degrees.

    Column k of R is the world direction of the body axis k (R maps body to world coordinates).
    """
    a, b, c = np.deg2rad(np.asarray(angles_deg, dtype=np.float64).reshape(3))

    def rz(t: float) -> np.ndarray:
        return np.array([[math.cos(t), -math.sin(t), 0.0], [math.sin(t), math.cos(t), 0.0], [0.0, 0.0, 1.0]])

    def rx(t: float) -> np.ndarray:
        return np.array([[1.0, 0.0, 0.0], [0.0, math.cos(t), -math.sin(t)], [0.0, math.sin(t), math.cos(t)]])

    return rz(a) @ rx(b) @ rz(c)


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
            width: int | None = None) -> np.ndarray:
    """Exact line integrals of ``phantom`` at the pixel centres: (N, H, W) float32.

    ``angles_deg`` is (N,) (one tilt angle per image) or (N, H) (one angle per image line, for
    continuous-rotation data). ``height``/``width`` default to the phantom's Y/X box size.

    For each ellipsoid the ray p(t) = p0 + t d, mapped to the unit-sphere frame, is e + t f with
    e = M (p0 - c), f = M d; its chord length is 2 sqrt(max(B^2 - A C, 0)) / A with A = f.f,
    B = e.f, C = e.e - 1. Since e is affine in (u, v), the discriminant is a quadratic in u whose
    coefficients depend on (tilt, row) only, so the work per pixel is a few flops.
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


# --------------------------------------------------------------------------------------- tilt series
def make_tiltseries(cfg: Any) -> TiltSeries:
    """The built-in synthetic tilt series of a :class:`fasttomo.config.DataConfig`.

    Uses cfg.width, height, thickness (None: :func:`default_thickness`), n_tilts, tilt_min,
    tilt_max, noise (Gaussian std relative to the std of the clean projections, drawn from
    numpy's default_rng(cfg.phantom_seed)) and pixel_size (None: 10 A). The ground truth is
    :func:`voxelize` of the phantom at (thickness, height, width). The options that prepare real
    data (binning, crop, normalize, ...) do not apply.
    """
    thickness = default_thickness(cfg.width) if cfg.thickness is None else int(cfg.thickness)
    phantom = default_phantom(cfg.width, cfg.height, thickness)
    angles = np.linspace(float(cfg.tilt_min), float(cfg.tilt_max), int(cfg.n_tilts))
    stack = project(phantom, angles, cfg.height, cfg.width)
    clean_std = float(stack.std())
    noise_std = float(cfg.noise) * clean_std
    if noise_std > 0:
        rng = np.random.default_rng(cfg.phantom_seed)
        stack = (stack + rng.normal(0.0, noise_std, size=stack.shape)).astype(np.float32)
    pixel_size = DEFAULT_PIXEL_SIZE if cfg.pixel_size is None else float(cfg.pixel_size)
    metadata = {
        "phantom": phantom.describe(),
        "thickness": thickness,
        "noise": float(cfg.noise),
        "noise_std": noise_std,
        "clean_projection_std": clean_std,
        "phantom_seed": int(cfg.phantom_seed),
        "tilt_range_deg": [float(cfg.tilt_min), float(cfg.tilt_max)],
        "geometry": "u = x cos(theta) + z sin(theta), v = y (IMOD reoriented frame); exact line integrals",
    }
    return TiltSeries(stack=stack, angles=angles, pixel_size=pixel_size, source="phantom", metadata=metadata,
                      ground_truth=voxelize(phantom, (thickness, cfg.height, cfg.width)))
