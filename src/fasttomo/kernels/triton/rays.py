"""Triton kernel of the rays' midpoint samples: each chord's S points and its inside mask in one
pass (``geometry.rays.segment_samples`` is the twin).

The twin builds the (B, S, 3) points with about ten elementwise kernels (the sample times, the
products with the direction, the sums with the origin, the normalization, the missed rays' zeros,
the absolute values, their maximum, two comparisons), each reading and writing tensors of the
points' size: 0.49 ms of a 10.8 ms camera2k step on an H100 (6.3 M points; the op table of
``bench_step-camera2k-fused-NVIDIA-H100-80GB-HBM3-aa80cde.json``). This kernel reads the
per-ray chord and writes the points and the mask once.

It computes the twin's bits: the same operations in the same order, each rounded on its own
(``enable_fp_fusion=False``: no multiply-add contracted into one rounding), the normalization an
IEEE division (``div_rn``; Triton's ``/`` on fp32 is an approximate division), and the inside test
as three comparisons, which are false for a NaN coordinate as the twin's maximum is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasttomo.kernels.triton.launch import launch

RAY_POINTS_BLOCK = 1024
RAY_POINTS_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
"""The launch's compile options: no multiply-add contracted into one rounding (the twin rounds
each product and sum)."""


@triton.jit
def ray_points_kernel(o_ptr, d_ptr, tin_ptr, dt_ptr, hit_ptr, pts_ptr, inside_ptr, n, S, hx, hy, hz,
                      bound, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    b = i // S
    k = (i - b * S).to(tl.float32) + 0.5
    t_in = tl.load(tin_ptr + b, mask=m, other=0.0)
    dt = tl.load(dt_ptr + b, mask=m, other=0.0)
    hit = tl.load(hit_ptr + b, mask=m, other=0) != 0
    t = t_in + k * dt
    px = tl.load(o_ptr + 3 * b, mask=m, other=0.0) + t * tl.load(d_ptr + 3 * b, mask=m, other=0.0)
    py = tl.load(o_ptr + 3 * b + 1, mask=m, other=0.0) + t * tl.load(d_ptr + 3 * b + 1, mask=m, other=0.0)
    pz = tl.load(o_ptr + 3 * b + 2, mask=m, other=0.0) + t * tl.load(d_ptr + 3 * b + 2, mask=m, other=0.0)
    px = tl.where(hit, tl.math.div_rn(px, hx), 0.0)
    py = tl.where(hit, tl.math.div_rn(py, hy), 0.0)
    pz = tl.where(hit, tl.math.div_rn(pz, hz), 0.0)
    tl.store(pts_ptr + 3 * i, px, mask=m)
    tl.store(pts_ptr + 3 * i + 1, py, mask=m)
    tl.store(pts_ptr + 3 * i + 2, pz, mask=m)
    inside = hit & (tl.abs(px) <= bound) & (tl.abs(py) <= bound) & (tl.abs(pz) <= bound)
    tl.store(inside_ptr + i, inside.to(tl.int8), mask=m)


def ray_points(origin: torch.Tensor, direction: torch.Tensor, t_in: torch.Tensor, dt: torch.Tensor,
               hit: torch.Tensor, half_extent: tuple[float, float, float], n_samples: int,
               bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, 3) fp32 normalized midpoint samples of the chords (origin, direction (B, 3); t_in,
    dt (B,) fp32; hit (B,) bool) and their (B, S) bool inside mask (``|coordinate| <= bound`` on
    all three axes, and the ray hits)."""
    origin, direction, t_in, dt, hit = (x.contiguous() for x in (origin, direction, t_in, dt, hit))
    B, S = origin.shape[0], int(n_samples)
    points = torch.empty((B, S, 3), device=origin.device, dtype=torch.float32)
    inside = torch.empty((B, S), device=origin.device, dtype=torch.bool)
    n = B * S
    if n == 0:
        return points, inside
    hx, hy, hz = (float(h) for h in half_extent)
    launch(ray_points_kernel, (triton.cdiv(n, RAY_POINTS_BLOCK),), origin, direction, t_in, dt,
           hit.view(torch.int8), points, inside.view(torch.int8), n, S, hx, hy, hz, float(bound),
           BLOCK=RAY_POINTS_BLOCK, **RAY_POINTS_OPTIONS)
    return points, inside
