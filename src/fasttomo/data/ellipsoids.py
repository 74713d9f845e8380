"""Solid ellipsoids and phantoms made of them: exact line integrals and the anti-aliased ground
truth. Geometry, units and poses are those described in :mod:`fasttomo.data.phantom` (which
re-exports everything here); a module of its own so that the specimen modules
(:mod:`fasttomo.data.specimens`) build on it without importing the phantom dispatcher."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from fasttomo.data.specimen import PhantomError, _pose_arrays, euler_zxz, pose_rotations

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
            width: int | None = None, poses: Mapping[str, Any] | None = None, device: str | None = None) -> np.ndarray:
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

    ``device`` (a torch device such as "cuda"; None: numpy) evaluates the per-pixel part there:
    the same float64 operations in the same order, one rounding each, so the image is numpy's bit
    for bit (tests/data/test_phantom_device.py) -- a camera-sized series in seconds on a GPU.
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
        return _project_posed(phantom, theta, height, width, z1, z3, su, sv, device)
    n = theta.shape[0]
    cos, sin = np.cos(theta)[..., None], np.sin(theta)[..., None]          # (N, H, 1)
    u = np.arange(width, dtype=np.float64) - (width - 1) / 2.0             # (W,)
    v = np.arange(height, dtype=np.float64) - (height - 1) / 2.0           # (H,)
    acc = _Chords((n, height, width), u, device)
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
        acc.add(slice(i0, i1), p2, p1, p0, 2.0 * e.density / ff)
    return acc.result()


class _Chords:
    """The per-pixel part of :func:`project`: for each ellipsoid, the rows' quadratic
    disc(u) = (p2 u + p1) u + p0 over the pixels u, clipped at 0, its square root times the rows'
    scale, summed into a float64 (N, H, W) image -- in numpy, or in torch on ``device`` with the
    same operations one kernel each (so the same roundings: numpy's image bit for bit)."""

    def __init__(self, shape: tuple[int, int, int], u: np.ndarray, device: str | None) -> None:
        self.device = device
        if device is None:
            self.out, self.u = np.zeros(shape, dtype=np.float64), u
        else:
            import torch

            self.out = torch.zeros(shape, dtype=torch.float64, device=device)
            self.u = torch.from_numpy(np.ascontiguousarray(u)).to(device)

    def add(self, rows: slice, p2: np.ndarray, p1: np.ndarray, p0: np.ndarray, scale: np.ndarray) -> None:
        """Add one ellipsoid's chords to the image rows ``rows``; p2, p1, p0, scale are (N, h)
        and ``self.u`` is (W,) or (N, 1, W)."""
        if self.device is None:
            disc = (p2[..., None] * self.u + p1[..., None]) * self.u + p0[..., None]    # (N, h, W)
            np.maximum(disc, 0.0, out=disc)
            self.out[:, rows] += np.sqrt(disc) * scale[..., None]
            return
        import torch

        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)[..., None]).to(self.device)  # noqa: E731
        disc = t(p2) * self.u
        disc += t(p1)
        disc *= self.u
        disc += t(p0)
        disc.clamp_(min=0.0).sqrt_()
        disc *= t(scale)
        self.out[:, rows] += disc

    def result(self) -> np.ndarray:
        """The image as float32 (numpy, on the host)."""
        if self.device is None:
            return self.out.astype(np.float32)
        return self.out.float().cpu().numpy()


def _dot3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dot product over the last axis (3), written out: the same rounding whatever the shape."""
    return a[..., 0] * b[..., 0] + a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2]


def _project_posed(phantom: Phantom, theta: np.ndarray, height: int, width: int, z1: np.ndarray,
                   z3: np.ndarray, su: np.ndarray, sv: np.ndarray, device: str | None = None) -> np.ndarray:
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
    acc = _Chords((theta.shape[0], height, width), up, device)
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
        acc.add(slice(None), p2, p1, p0, 2.0 * e.density / ff)
    return acc.result()


# --------------------------------------------------------------------------------------- voxelization
def voxelize(phantom: Phantom, shape_zyx: Sequence[int] | None = None, supersample: int = 2,
             device: str | None = None) -> np.ndarray:
    """Ground-truth volume (Z, Y, X) float32: the density averaged over supersample^3 points per voxel.

    The grid samples the phantom's box; ``shape_zyx`` (default: the box itself, one voxel per
    voxel unit) may differ from it, then the voxel size along each axis is box / shape (the values
    stay densities per original voxel length). The sub-samples sit at the centres of a regular
    supersample^3 split of each voxel, which anti-aliases the object boundaries (partial volume).
    ``device`` (a torch device; None: numpy) computes it there, slab by slab, with the same float64
    operations in the same order: numpy's volume bit for bit, a 2048^2 x 512 box in seconds on a GPU.
    """
    box = np.array(phantom.shape_zyx, dtype=np.float64)
    shape = tuple(phantom.shape_zyx) if shape_zyx is None else tuple(int(s) for s in shape_zyx)
    if len(shape) != 3 or any(s < 1 for s in shape):
        raise PhantomError(f"voxelize: shape_zyx must be 3 positive integers, got {shape_zyx!r}.")
    ss = int(supersample)
    if ss < 1:
        raise PhantomError(f"voxelize: supersample must be an integer >= 1, got {supersample!r}.")
    step = box / np.array(shape, dtype=np.float64)                          # voxel size (z, y, x)
    if device is None:
        vol = np.zeros(shape, dtype=np.float64)
    else:
        import torch

        vol = torch.zeros(shape, dtype=torch.float64, device=device)
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
        (za, zb), (ya, yb), (xa, xb) = rng
        if device is None:
            vol[za:zb, ya:yb, xa:xb] += e.density * _inside_fraction(e.world_to_unit, z, y, x, ss, np)
            continue
        # slabs of voxels along z, each at most VOXELIZE_SLAB_POINTS fine points
        per = max(1, VOXELIZE_SLAB_POINTS // (y.shape[1] * x.shape[2] * ss))
        ty, tx = (torch.from_numpy(np.ascontiguousarray(c)).to(device) for c in (y, x))
        for k0 in range(za, zb, per):
            k1 = min(zb, k0 + per)
            tz = torch.from_numpy(np.ascontiguousarray(z[(k0 - za) * ss:(k1 - za) * ss])).to(device)
            vol[k0:k1, ya:yb, xa:xb] += e.density * _inside_fraction(e.world_to_unit, tz, ty, tx, ss, torch)
    return vol.astype(np.float32) if device is None else vol.float().cpu().numpy()


VOXELIZE_SLAB_POINTS = 1 << 27
"""voxelize on a device evaluates about this many fine points at a time (float64 work arrays of
about 1 GB each)."""


def _inside_fraction(m: np.ndarray, z, y, x, ss: int, xp):
    """The fraction of each voxel's ss^3 fine points (z (Z*ss, 1, 1), y (1, Y*ss, 1), x (1, 1,
    X*ss) about the ellipsoid's centre) inside the unit sphere of ``m`` (world -> unit), numpy
    or torch (``xp``), one operation at a time in the same order."""
    r2 = None
    for k in range(3):
        q = float(m[k, 0]) * x + float(m[k, 1]) * y + float(m[k, 2]) * z
        r2 = q * q if r2 is None else r2 + q * q
    nz, ny, nx = z.shape[0] // ss, y.shape[1] // ss, x.shape[2] // ss
    inside = (r2 <= 1.0).reshape(nz, ss, ny, ss, nx, ss)
    if xp is np:
        return inside.mean(axis=(1, 3, 5))
    return inside.to(xp.float64).mean(dim=(1, 3, 5))


def _uniform_rotation(rng: np.random.Generator) -> np.ndarray:
    """A rotation matrix uniformly distributed on SO(3) (Haar): a normalized Gaussian quaternion."""
    q = rng.normal(size=4)
    w, x, y, z = q / np.linalg.norm(q)
    return np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ])
