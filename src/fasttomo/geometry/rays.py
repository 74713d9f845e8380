"""Rays through the reconstruction box and their line integrals.

Frames and units
    The volume (Z, Y, X) is centred; physical coordinates are in voxel units (voxel = pixel) and
    the box spans [-X/2, X/2] x [-Y/2, Y/2] x [-Z/2, Z/2]. Normalized coordinates, the only ones
    the fields see, are p_n = p / half_extent per axis, ordered (x, y, z), in [-1, 1]^3, so voxel
    centres sit at (2k + 1)/n - 1 (grid_sample's align_corners=False convention).
    Image pixel (i, j) of an (H, W) image has centre u = j - (W-1)/2, v = i - (H-1)/2. With
    X = W and Y = H, pixel centres at tilt 0 line up with voxel centres.

Rays
    A view's pose gives (u, v, w) = R p + (su, sv, 0) (see :mod:`fasttomo.geometry.poses`). The ray
    of pixel (i, j) is the set of volume points p(t) = R^T ((u - su, v - sv, 0) + t (0, 0, 1)),
    t in voxel units (R is orthonormal, so |dp/dt| = 1). Each ray is clipped to the box with the
    slab method, giving the chord [t_in, t_out] (empty for rays that miss: t_in = t_out = 0).

Quadrature (midpoint rule)
    The chord is cut into S equal cells of length dt = (t_out - t_in) / S and the density is
    sampled at the cell midpoints t_k = t_in + (k + 1/2) dt, k = 0..S-1. The line integral is

        I = dt * sum_k density(p(t_k)) * inside_k

    where ``inside`` tests all three normalized coordinates against [-1 - tol, 1 + tol] (tol =
    1e-5); clipping already keeps midpoints inside, the mask is a second guard so a density
    defined everywhere (e.g. an analytic function or a border-clamped grid) integrates over the
    box only. A constant density c therefore integrates exactly to c times the chord length. Rays
    that miss have dt = 0, ``inside`` all False and integrate to exactly 0.

All of this runs in fp32 (fp64 inputs stay fp64) with autocast disabled (positions need the mantissa: a 1000-voxel box
at bf16 resolution would be off by several voxels).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

INSIDE_TOL = 1e-5
"""Tolerance (normalized units) of the inside-the-box mask."""


@dataclasses.dataclass(frozen=True)
class Box:
    """The reconstruction box: ``shape_zyx`` voxels, centred at the origin, voxel = pixel."""

    shape_zyx: tuple[int, int, int]

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape_zyx)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"Box: shape_zyx must be 3 positive ints (Z, Y, X), got {self.shape_zyx!r}")
        object.__setattr__(self, "shape_zyx", shape)

    @classmethod
    def for_images(cls, height: int, width: int, thickness: int) -> "Box":
        """The box of a tilt series of (H, W) images: X = W, Y = H, Z = thickness."""
        return cls((int(thickness), int(height), int(width)))

    @property
    def half_extent(self) -> tuple[float, float, float]:
        """(X/2, Y/2, Z/2) in voxels, ordered like the coordinates (x, y, z)."""
        z, y, x = self.shape_zyx
        return (x / 2.0, y / 2.0, z / 2.0)

    def normalize(self, p: torch.Tensor) -> torch.Tensor:
        """Physical (..., 3) xyz in voxel units -> normalized [-1, 1]^3 coordinates."""
        return p / _half_extent(self, p.device, p.dtype)

    def denormalize(self, p_n: torch.Tensor) -> torch.Tensor:
        """Normalized (..., 3) xyz -> physical coordinates in voxel units."""
        return p_n * _half_extent(self, p_n.device, p_n.dtype)


SAMPLE_SPACING = 4.0 / 3.0
"""Voxels between quadrature points along the longest chord when projector.samples_per_ray is None."""


def longest_chord(box: Box, angles_deg) -> float:
    """Longest ray chord (voxels) through the box over the given tilt angles (untouched poses: the
    ray runs in the x-z plane at the tilt angle, so the chord is min(X / |sin|, Z / |cos|))."""
    import math

    z, _, x = box.shape_zyx
    best = 0.0
    for a in {float(v) for v in np.asarray(angles_deg, dtype=np.float64).ravel()}:
        s, c = abs(math.sin(math.radians(a))), abs(math.cos(math.radians(a)))
        best = max(best, min(x / s if s > 1e-12 else math.inf, z / c if c > 1e-12 else math.inf))
    return best


def auto_samples_per_ray(box: Box, angles_deg) -> int:
    """projector.samples_per_ray=None: one sample per SAMPLE_SPACING voxels of the longest chord."""
    import math

    return max(8, int(math.ceil(longest_chord(box, angles_deg) / SAMPLE_SPACING - 1e-9)))


@dataclasses.dataclass
class RaySamples:
    points: torch.Tensor
    """(B, S, 3) normalized xyz sample positions (midpoints of the clipped chord)."""
    dt: torch.Tensor
    """(B,) quadrature step in voxel units ((t_out - t_in) / S; 0 for rays missing the box)."""
    inside: torch.Tensor
    """(B, S) bool: sample inside the box on all three axes (within ``INSIDE_TOL``)."""


def inside_box(points_n: torch.Tensor, tol: float = INSIDE_TOL) -> torch.Tensor:
    """(...) bool: normalized (..., 3) points inside [-1 - tol, 1 + tol] on all three axes."""
    # the largest |coordinate| against the bound: one reduction over the 3 axes (a boolean all()
    # over a last axis of 3 takes twice as long on the CPU); a NaN coordinate is outside either way
    return points_n.abs().amax(dim=-1) <= 1.0 + tol


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def pixel_to_detector(row: torch.Tensor, col: torch.Tensor, image_hw: tuple[int, int],
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel indices (any numeric dtype, sub-pixel allowed) -> detector (u, v)."""
    h, w = image_hw
    return col.to(dtype) - (w - 1) / 2.0, row.to(dtype) - (h - 1) / 2.0


_half_extent_cache: dict = {}


def _half_extent(box: Box, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(3,) ``box.half_extent`` (x, y, z) as a tensor, built once per box, device and dtype."""
    key = (tuple(box.half_extent), device, dtype)
    if key not in _half_extent_cache:
        _half_extent_cache[key] = torch.tensor(key[0], device=device, dtype=dtype)
    return _half_extent_cache[key]


@dataclasses.dataclass
class RaySegments:
    """The per-ray part of :func:`ray_samples`: each ray's clipped chord, before its samples."""

    origin: torch.Tensor
    """(B, 3) the ray's point at t = 0, voxel units (x, y, z)."""
    direction: torch.Tensor
    """(B, 3) unit direction."""
    t_in: torch.Tensor
    """(B,) where the chord enters the box (0 for rays that miss)."""
    dt: torch.Tensor
    """(B,) quadrature step (t_out - t_in) / S (0 for rays that miss)."""
    hit: torch.Tensor
    """(B,) bool: the ray crosses the box."""


def ray_segments(row: torch.Tensor, col: torch.Tensor, R: torch.Tensor, shift: torch.Tensor,
                 image_hw: tuple[int, int], box: Box, n_samples: int) -> RaySegments:
    """The chords through ``box`` of the rays of pixels (row, col) (B,) in views with poses R
    (B, 3, 3), shift (B, 2), cut into ``n_samples`` cells (see the module docstring)."""
    if n_samples < 1:
        raise ValueError(f"ray_samples: n_samples must be >= 1, got {n_samples}")
    with torch.autocast(device_type=row.device.type, enabled=False):
        R = _at_least_fp32(R)
        shift = shift.to(R.dtype)
        u, v = pixel_to_detector(row, col, image_hw, R.dtype)
        # origin = R^T (u - su, v - sv, 0): rows 0 and 1 of R weighted (no 3x3 product per ray)
        origin = (u - shift[:, 0]).unsqueeze(-1) * R[:, 0] + (v - shift[:, 1]).unsqueeze(-1) * R[:, 1]  # (B, 3) voxels
        direction = R[:, 2]  # R^T e_z, unit length
        # slab method, the three axes at once (the half extents: a cached device constant, so a
        # captured step makes no host->device copy)
        h = _half_extent(box, origin.device, origin.dtype)  # (3,)
        parallel = direction.abs() < 1e-9
        d_safe = torch.where(parallel, 1.0, direction)
        t1, t2 = (-h - origin) / d_safe, (h - origin) / d_safe
        lo, hi = torch.minimum(t1, t2), torch.maximum(t1, t2)
        # a ray parallel to a slab is inside it for all t, or for none
        inf = float("inf")
        within = origin.abs() <= h
        lo = torch.where(parallel, torch.where(within, -inf, inf).to(lo.dtype), lo)
        hi = torch.where(parallel, torch.where(within, inf, -inf).to(hi.dtype), hi)
        t_in, t_out = lo.amax(dim=-1), hi.amin(dim=-1)
        hit = t_out > t_in
        t_in = torch.where(hit, t_in, 0.0)
        t_out = torch.where(hit, t_out, 0.0)
        return RaySegments(origin=origin, direction=direction, t_in=t_in, dt=(t_out - t_in) / n_samples, hit=hit)


def segment_samples(seg: RaySegments, box: Box, n_samples: int) -> RaySamples:
    """The ``n_samples`` midpoint samples of each chord of ``seg``: (B, S, 3) normalized points
    and the inside mask. ``fasttomo.kernels.dispatch.ray_samples`` computes the same bits in one
    fused kernel on CUDA; this is its twin."""
    with torch.autocast(device_type=seg.origin.device.type, enabled=False):
        dt = seg.dt
        k = torch.arange(n_samples, device=dt.device, dtype=dt.dtype) + 0.5
        t = seg.t_in.unsqueeze(-1) + k * dt.unsqueeze(-1)  # (B, S)
        p = seg.origin.unsqueeze(1) + t.unsqueeze(-1) * seg.direction.unsqueeze(1)  # (B, S, 3)
        points = box.normalize(p)
        points = torch.where(seg.hit[:, None, None], points, 0.0)
        inside = inside_box(points) & seg.hit.unsqueeze(-1)
        return RaySamples(points=points, dt=dt, inside=inside)


def ray_samples(row: torch.Tensor, col: torch.Tensor, R: torch.Tensor, shift: torch.Tensor,
                image_hw: tuple[int, int], box: Box, n_samples: int) -> RaySamples:
    """Midpoint samples of the rays of pixels (row, col) (B,) in views with poses R (B, 3, 3),
    shift (B, 2) (see the module docstring)."""
    return segment_samples(ray_segments(row, col, R, shift, image_hw, box, n_samples), box, n_samples)


def line_integral(density: torch.Tensor, samples: RaySamples) -> torch.Tensor:
    """(B,) midpoint-rule line integrals of ``density`` (B, S) at ``samples`` (fp32)."""
    with torch.autocast(device_type=density.device.type, enabled=False):
        d = _at_least_fp32(density)
        d = torch.where(samples.inside, d, 0.0)
        return d.sum(dim=-1) * samples.dt


def project_points(xyz_voxel: torch.Tensor, R: torch.Tensor, shift: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Detector (u, v) of physical points (P, 3) under pose R (3, 3) or (P, 3, 3) and shift (2,)
    or (P, 2): (u, v, w) = R p + (su, sv, 0)."""
    with torch.autocast(device_type=xyz_voxel.device.type, enabled=False):
        R = _at_least_fp32(R)
        q = (R @ xyz_voxel.to(R.dtype).unsqueeze(-1)).squeeze(-1)
        return q[..., 0] + shift[..., 0], q[..., 1] + shift[..., 1]


def voxel_grid(box: Box, shape_zyx: tuple[int, int, int] | None = None, device=None,
               dtype: torch.dtype = torch.float32, z_range: tuple[int, int] | None = None) -> torch.Tensor:
    """(Z, Y, X, 3) normalized xyz of the voxel centres of a grid spanning the box.

    ``shape_zyx`` defaults to the box's own shape (voxel = pixel); another shape resamples the
    same box (centres at (2k + 1)/n - 1 on each axis). ``z_range`` (lo, hi) gives only the planes
    lo..hi-1 of that grid (the same values, without building the rest).
    """
    z, y, x = _voxel_axes(box, shape_zyx, device, dtype)
    if z_range is not None:
        z = z[z_range[0]:z_range[1]]
    gz, gy, gx = torch.meshgrid(z, y, x, indexing="ij")
    return torch.stack((gx, gy, gz), dim=-1)


def _voxel_axes(box: Box, shape_zyx, device, dtype) -> list[torch.Tensor]:
    """The normalized z, y and x coordinates of :func:`voxel_grid`'s voxel centres."""
    shape = tuple(box.shape_zyx if shape_zyx is None else shape_zyx)
    return [((torch.arange(n, device=device, dtype=dtype) * 2 + 1) / n) - 1 for n in shape]


def voxel_plane(box: Box, axis: int, index: int, device=None) -> torch.Tensor:
    """``voxel_grid(box).select(axis, index)`` (axis 0, 1, 2: Z, Y, X) without building the rest
    of the grid: the plane's normalized xyz, (2-D, 3), the same values."""
    axes = _voxel_axes(box, None, device, torch.float32)
    axes[axis] = axes[axis][index:index + 1]
    gz, gy, gx = torch.meshgrid(*axes, indexing="ij")
    return torch.stack((gx, gy, gz), dim=-1).select(axis, 0)
