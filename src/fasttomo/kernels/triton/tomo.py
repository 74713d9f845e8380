"""Triton kernels of the SIRT projector pair: ray-driven forward projection, voxel-driven
backprojection. Both are pure gathers (no atomics) and forward-only.

Semantics are those of ``fasttomo.kernels.reference.ray_project`` / ``voxel_backproject`` (see
there); the pose of each view is passed as a (V, 12) fp32 table: the 9 entries of R row-major,
then (su, sv), then one pad.

ray_project_kernel
    A program owns a BLOCK_V x BLOCK_U tile of pixels of one view (grid axis 1 = view), so the
    rays of a program are parallel neighbours and at any sample index their points are about one
    voxel apart: the trilinear taps of a warp fall on a few cache lines. Each ray is clipped to
    the box by the slab method (the same formulas as ``ray_samples``), cut into n = max(1,
    ceil(L / step - tol)) equal cells, and the program loops up to the largest n of its tile
    (a runtime bound), gathering 8 taps per live sample; taps whose trilinear weight is exactly
    zero are masked off (no memory request): in the pure-tilt geometry (no in-plane rotation,
    image rows on voxel rows) every sample has a zero y-weight, so the kernel issues 4 gathers per
    sample instead of 8.

voxel_backproject_kernel
    A program owns BLOCK consecutive voxels of the flattened (Z, Y, X) volume (runs along x) and
    loops over the views: project the centre, 4 bilinear taps of that view's image (zero outside
    the detector; zero-weight taps masked off, so the pure-tilt geometry reads 2 per view), sum in
    registers, one store per voxel.

Indices are int32 while the volume and the image stack hold fewer than 2**31 elements; above
that (a 2048^2 x 512 volume has exactly 2**31) the compile-time flag INT64 makes the kernels
compute every flat offset in int64 (a separate compiled variant; the int32 one is unchanged).
Integer arguments equal to 1 arrive as compile-time constants, so no ``.to`` is called on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasttomo.kernels.reference import RAY_COUNT_TOL
from fasttomo.kernels.triton.launch import launch

PROJECT_BLOCK_V = 4
PROJECT_BLOCK_U = 32
PROJECT_WARPS = 4
BACKPROJECT_BLOCK = 256
BACKPROJECT_WARPS = 4


@triton.jit
def _slab(o, d, h):
    """Ray parameter interval [lo, hi] inside |o + t d| <= h along one axis (d a scalar)."""
    par = tl.abs(d) < 1e-9
    d_safe = tl.where(par, 1.0, d)
    t1 = (-h - o) / d_safe
    t2 = (h - o) / d_safe
    lo = tl.minimum(t1, t2)
    hi = tl.maximum(t1, t2)
    within = tl.abs(o) <= h
    lo = tl.where(par, tl.where(within, -1e30, 1e30), lo)
    hi = tl.where(par, tl.where(within, 1e30, -1e30), hi)
    return lo, hi


@triton.jit
def _axis_taps(f, size_m1, size_m1_int, live):
    """Clamp an index-space coordinate to [0, size-1] (border), split into the two taps, the
    fraction, and the mask of the upper tap (only where its weight is non-zero)."""
    fc = tl.minimum(tl.maximum(f, 0.0), size_m1)
    f0 = tl.floor(fc)
    i0 = f0.to(tl.int32)
    i1 = tl.minimum(i0 + 1, size_m1_int)
    w = fc - f0
    return i0, i1, w, live & (w != 0.0)


@triton.jit
def ray_project_kernel(vol_ptr, pose_ptr, out_ptr, Z, Y, X, H, W, tiles_u, step, count_tol,
                       BLOCK_V: tl.constexpr, BLOCK_U: tl.constexpr, INT64: tl.constexpr):
    pid = tl.program_id(0)
    view = tl.program_id(1)
    if INT64:
        view = view.to(tl.int64)
    r = tl.arange(0, BLOCK_V * BLOCK_U)
    row = (pid // tiles_u) * BLOCK_V + r // BLOCK_U
    col = (pid % tiles_u) * BLOCK_U + r % BLOCK_U
    pmask = (row < H) & (col < W)

    pb = pose_ptr + view * 12
    r00 = tl.load(pb + 0)
    r01 = tl.load(pb + 1)
    r02 = tl.load(pb + 2)
    r10 = tl.load(pb + 3)
    r11 = tl.load(pb + 4)
    r12 = tl.load(pb + 5)
    dx = tl.load(pb + 6)  # third row of R = R^T e_z, the ray direction
    dy = tl.load(pb + 7)
    dz = tl.load(pb + 8)
    su = tl.load(pb + 9)
    sv = tl.load(pb + 10)

    # detector coordinates and the ray origin R^T (u - su, v - sv, 0) (voxel units)
    u = col * 1.0 - (W - 1) * 0.5 - su
    v = row * 1.0 - (H - 1) * 0.5 - sv
    ox = r00 * u + r10 * v
    oy = r01 * u + r11 * v
    oz = r02 * u + r12 * v

    xf = X * 1.0
    yf = Y * 1.0
    zf = Z * 1.0
    lox, hix = _slab(ox, dx, xf * 0.5)
    loy, hiy = _slab(oy, dy, yf * 0.5)
    loz, hiz = _slab(oz, dz, zf * 0.5)
    t_in = tl.maximum(tl.maximum(lox, loy), loz)
    t_out = tl.minimum(tl.minimum(hix, hiy), hiz)
    hit = pmask & (t_out > t_in)
    length = tl.where(hit, t_out - t_in, 0.0)
    nf = tl.maximum(tl.ceil(length / step - count_tol), 1.0)
    nf = tl.where(hit, nf, 0.0)
    ns = nf.to(tl.int32)
    dt = tl.where(hit, length / tl.maximum(nf, 1.0), 0.0)
    t0 = tl.where(hit, t_in, 0.0) + 0.5 * dt

    # index-space coordinate of sample k along each axis: a + k * b
    ax = ox + t0 * dx + (xf - 1.0) * 0.5
    ay = oy + t0 * dy + (yf - 1.0) * 0.5
    az = oz + t0 * dz + (zf - 1.0) * 0.5
    bx = dt * dx
    by = dt * dy
    bz = dt * dz
    xm1 = xf - 1.0
    ym1 = yf - 1.0
    zm1 = zf - 1.0
    sxy = Y * X

    acc = tl.zeros([BLOCK_V * BLOCK_U], dtype=tl.float32)
    n_max = tl.max(ns, axis=0)
    for k in range(0, n_max):
        live = k < ns
        ix0, ix1, wx, mx = _axis_taps(ax + k * bx, xm1, X - 1, live)
        iy0, iy1, wy, my = _axis_taps(ay + k * by, ym1, Y - 1, live)
        iz0, iz1, wz, mz = _axis_taps(az + k * bz, zm1, Z - 1, live)
        if INT64:
            z0 = iz0.to(tl.int64) * sxy
            z1 = iz1.to(tl.int64) * sxy
        else:
            z0 = iz0 * sxy
            z1 = iz1 * sxy
        y0 = iy0 * X
        y1 = iy1 * X
        my0 = live
        v000 = tl.load(vol_ptr + z0 + y0 + ix0, mask=my0, other=0.0)
        v001 = tl.load(vol_ptr + z0 + y0 + ix1, mask=mx, other=0.0)
        v010 = tl.load(vol_ptr + z0 + y1 + ix0, mask=my, other=0.0)
        v011 = tl.load(vol_ptr + z0 + y1 + ix1, mask=my & mx, other=0.0)
        v100 = tl.load(vol_ptr + z1 + y0 + ix0, mask=mz, other=0.0)
        v101 = tl.load(vol_ptr + z1 + y0 + ix1, mask=mz & mx, other=0.0)
        v110 = tl.load(vol_ptr + z1 + y1 + ix0, mask=mz & my, other=0.0)
        v111 = tl.load(vol_ptr + z1 + y1 + ix1, mask=mz & my & mx, other=0.0)
        c00 = v000 + wx * (v001 - v000)
        c01 = v010 + wx * (v011 - v010)
        c10 = v100 + wx * (v101 - v100)
        c11 = v110 + wx * (v111 - v110)
        c0 = c00 + wy * (c01 - c00)
        c1 = c10 + wy * (c11 - c10)
        acc += tl.where(live, c0 + wz * (c1 - c0), 0.0)
    out = out_ptr + view * (H * W) + row * W + col
    tl.store(out, acc * dt, mask=pmask)


@triton.jit
def voxel_backproject_kernel(img_ptr, pose_ptr, out_ptr, Z, Y, X, H, W, V, N,
                             BLOCK: tl.constexpr, INT64: tl.constexpr):
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    vmask = e < N
    ix = e % X
    t = e // X
    iy = t % Y
    iz = t // Y
    px = ix * 1.0 - (X - 1) * 0.5
    py = iy * 1.0 - (Y - 1) * 0.5
    pz = iz * 1.0 - (Z - 1) * 0.5
    wf = W * 1.0
    hf = H * 1.0
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for n in range(0, V):
        pb = pose_ptr + n * 12
        r00 = tl.load(pb + 0)
        r01 = tl.load(pb + 1)
        r02 = tl.load(pb + 2)
        r10 = tl.load(pb + 3)
        r11 = tl.load(pb + 4)
        r12 = tl.load(pb + 5)
        if INT64:
            base = tl.cast(n, tl.int64) * H * W
        else:
            base = n * (H * W)
        su = tl.load(pb + 9)
        sv = tl.load(pb + 10)
        # pixel coordinates; clamped to [-2, size + 1] first (outside stays outside, ints stay small)
        j = r00 * px + r01 * py + r02 * pz + su + (wf - 1.0) * 0.5
        i = r10 * px + r11 * py + r12 * pz + sv + (hf - 1.0) * 0.5
        j = tl.minimum(tl.maximum(j, -2.0), wf + 1.0)
        i = tl.minimum(tl.maximum(i, -2.0), hf + 1.0)
        j0f = tl.floor(j)
        i0f = tl.floor(i)
        fj = j - j0f
        fi = i - i0f
        j0 = j0f.to(tl.int32)
        i0 = i0f.to(tl.int32)
        mj0 = (j0 >= 0) & (j0 < W)
        mj1 = (j0 + 1 >= 0) & (j0 + 1 < W) & (fj != 0.0)
        mi0 = vmask & (i0 >= 0) & (i0 < H)
        mi1 = vmask & (i0 + 1 >= 0) & (i0 + 1 < H) & (fi != 0.0)
        p = img_ptr + base + i0 * W + j0
        a00 = tl.load(p, mask=mi0 & mj0, other=0.0)
        a01 = tl.load(p + 1, mask=mi0 & mj1, other=0.0)
        a10 = tl.load(p + W, mask=mi1 & mj0, other=0.0)
        a11 = tl.load(p + W + 1, mask=mi1 & mj1, other=0.0)
        top = a00 + fj * (a01 - a00)
        bot = a10 + fj * (a11 - a10)
        acc += top + fi * (bot - top)
    tl.store(out_ptr + e, acc, mask=vmask)


def pose_table(rot: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(V, 12) fp32 contiguous: R row-major, (su, sv), a pad."""
    v = rot.shape[0]
    return torch.cat((rot.reshape(v, 9).float(), shift.reshape(v, 2).float(),
                      rot.new_zeros((v, 1), dtype=torch.float32)), dim=1).contiguous()


def needs_int64(*numels: int) -> bool:
    """Whether a flat offset of arrays of these sizes can pass 2**31 - 1 (the INT64 variant)."""
    return max(numels) > 2**31 - 1


def ray_project(volume: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor, height: int,
                width: int, step: float, block_v: int = PROJECT_BLOCK_V,
                block_u: int = PROJECT_BLOCK_U, warps: int = PROJECT_WARPS,
                int64: bool | None = None) -> torch.Tensor:
    """(V, H, W) line integrals (see the module docstring); fp32 contiguous (Z, Y, X) volume.
    ``int64``: the int64-offset variant (None: when the sizes need it)."""
    Z, Y, X = volume.shape
    v = rot.shape[0]
    out = torch.empty((v, height, width), device=volume.device, dtype=torch.float32)
    if v == 0 or height == 0 or width == 0:
        return out
    table = pose_table(rot, shift)
    tiles_u = triton.cdiv(width, block_u)
    grid = (triton.cdiv(height, block_v) * tiles_u, v)
    big = needs_int64(volume.numel(), out.numel()) if int64 is None else bool(int64)
    launch(ray_project_kernel, grid, volume, table, out, Z, Y, X, height, width, tiles_u, float(step),
           RAY_COUNT_TOL, BLOCK_V=block_v, BLOCK_U=block_u, INT64=big, num_warps=warps)
    return out


def voxel_backproject(images: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor, Z: int, Y: int,
                      X: int, block: int = BACKPROJECT_BLOCK,
                      warps: int = BACKPROJECT_WARPS, int64: bool | None = None) -> torch.Tensor:
    """(Z, Y, X) voxel-driven backprojection of fp32 contiguous images (V, H, W). ``int64``: the
    int64-offset variant (None: when the sizes need it)."""
    v, h, w = images.shape
    out = torch.empty((Z, Y, X), device=images.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if v == 0:
        return out.zero_()
    table = pose_table(rot, shift)
    grid = (triton.cdiv(Z * Y * X, block),)
    big = needs_int64(images.numel(), out.numel()) if int64 is None else bool(int64)
    launch(voxel_backproject_kernel, grid, images, table, out, Z, Y, X, h, w, v, out.numel(), BLOCK=block,
           INT64=big, num_warps=warps)
    return out

