"""Triton kernels of the multi-scale TILTED K-Planes interpolation (forward and backward).

Semantics are those of ``fasttomo.kernels.reference.tilted_kplanes`` (bilinear, align_corners=True,
border clamping, channels-last planes in one flat buffer laid out by ``PlaneLayout``).

One launch per scale (L launches). A program owns BLOCK_N consecutive points and one rotation t
(grid axis 1), so all programs in flight at a time read the 3 planes of one (scale, t): about
23 MB at the flagship's finest scale, inside the H200's 60 MB L2. Each point is rotated once, its 3
axis coordinates unnormalized once and shared by the two plane kinds that use them; channels are
walked in chunks of BLOCK_C (C=48 -> 3 chunks of 16, no masked lanes).

Backward recomputes the bilinear weights (nothing saved but the inputs), reads the output gradient
once, scatters plane gradients with fp32 atomics and writes dL/dq per (point, rotation) without
atomics (a program owns its points), laid out (3, T, N); dL/dpoints and dL/dmatrices follow from
dq by two small einsums on the host side. Two backward strategies, chosen per call by
``backward_strategy``: "runs" (``kplanes_bwd_runs_kernel``, texel runs: each row of consecutive
points keeps its current cell's 4 corner-texel sums in registers, carries the corners a neighbouring
cell shares and flushes one atomic per texel it leaves) and, for problems too small to fill the GPU
with texel-run programs, "pairs" (``kplanes_bwd_kernel``: pairs (2i, 2i+1) in the same cell issue
one atomic, exact-zero corner weights issue none). The strategies measured and dropped (one atomic
per tap; a segmented scan) are described in docs/kernels.md's history.

Tuning (block sizes, row shapes, register cap, the small-problem threshold) is a frozen
``KPlanesTuning`` passed down to the launchers (``DEFAULT_TUNING`` unless a caller, such as the
bench script, passes another); nothing here is module state changed at run time.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from fasttomo.kernels.layout import PlaneLayout
from fasttomo.kernels.triton.launch import device_of, launch, sm_count, sum_parts


@triton.jit
def _axis(q, size_m1):
    """Unnormalize (align_corners=True), clamp to the border, split in cell index + fraction.

    Returns (i0 int32 in [0, size-2], frac in [0, 1], d(coord)/dq: (size-1)/2 inside, 0 clamped).
    Clamped and exactly-on-the-border coordinates get zero coordinate gradient, like grid_sample.
    """
    x = (q + 1.0) / 2.0 * size_m1
    inside = (x > 0.0) & (x < size_m1)
    xc = tl.minimum(tl.maximum(x, 0.0), size_m1)
    i0 = tl.minimum(tl.floor(xc), size_m1 - 1.0)
    f = xc - i0
    dq = tl.where(inside, size_m1 / 2.0, 0.0)
    return i0.to(tl.int32), f, dq


@triton.jit
def _points(pts_ptr, n, nmask):
    n64 = n.to(tl.int64)
    x = tl.load(pts_ptr + n64 * 3 + 0, mask=nmask, other=0.0)
    y = tl.load(pts_ptr + n64 * 3 + 1, mask=nmask, other=0.0)
    z = tl.load(pts_ptr + n64 * 3 + 2, mask=nmask, other=0.0)
    return x, y, z


@triton.jit
def _turn(mat_ptr, t, x, y, z):
    m = mat_ptr + t * 9
    q0 = tl.load(m + 0) * x + tl.load(m + 1) * y + tl.load(m + 2) * z
    q1 = tl.load(m + 3) * x + tl.load(m + 4) * y + tl.load(m + 5) * z
    q2 = tl.load(m + 6) * x + tl.load(m + 7) * y + tl.load(m + 8) * z
    return q0, q1, q2


@triton.jit
def _rotate(pts_ptr, mat_ptr, n, nmask, t):
    x, y, z = _points(pts_ptr, n, nmask)
    return _turn(mat_ptr, t, x, y, z)


@triton.jit
def _tap4(base, p00, row_stride, C, c, m2):
    """The 4 corner texels of a cell, C-channel chunk ``c``, in fp32 (bf16 planes are widened on
    load, so every sum and difference after it is fp32; a no-op for fp32 planes)."""
    p = base + p00[:, None] + c[None, :]
    v00 = tl.load(p, mask=m2, other=0.0).to(tl.float32)
    v01 = tl.load(p + C, mask=m2, other=0.0).to(tl.float32)
    v10 = tl.load(p + row_stride, mask=m2, other=0.0).to(tl.float32)
    v11 = tl.load(p + row_stride + C, mask=m2, other=0.0).to(tl.float32)
    return v00, v01, v10, v11


@triton.jit
def _lerp2(v00, v01, v10, v11, fu, fv):
    gu = 1.0 - fu
    gv = 1.0 - fv
    return (v00 * (gu * gv)[:, None] + v01 * (fu * gv)[:, None]
            + v10 * (gu * fv)[:, None] + v11 * (fu * fv)[:, None])


@triton.jit
def _red4(p, C, row_stride, a00, a01, a10, a11, m2, w00, w01, w10, w11):
    # clamped (outside) coordinates give exact-zero corner weights: no traffic
    tl.atomic_add(p, a00, mask=m2 & (w00 != 0.0)[:, None], sem="relaxed")
    tl.atomic_add(p + C, a01, mask=m2 & (w01 != 0.0)[:, None], sem="relaxed")
    tl.atomic_add(p + row_stride, a10, mask=m2 & (w10 != 0.0)[:, None], sem="relaxed")
    tl.atomic_add(p + row_stride + C, a11, mask=m2 & (w11 != 0.0)[:, None], sem="relaxed")


@triton.jit
def _pair_sum(a, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    return tl.sum(tl.reshape(a, [BLOCK_N // 2, 2, BLOCK_C]), axis=1)


@triton.jit
def _scatter4(gbase, p00, row_stride, C, c, m2, g, fu, fv, nmask, BLOCK_N: tl.constexpr,
              BLOCK_C: tl.constexpr):
    """Pair merge: points (2i, 2i+1) in the same cell (p00 equal) issue one atomic per corner for
    both; the others one each, none for exact-zero corner weights."""
    gu = 1.0 - fu
    gv = 1.0 - fv
    w00 = gu * gv
    w01 = fu * gv
    w10 = gu * fv
    w11 = fu * fv
    a00 = g * w00[:, None]
    a01 = g * w01[:, None]
    a10 = g * w10[:, None]
    a11 = g * w11[:, None]
    pp = tl.reshape(p00, [BLOCK_N // 2, 2])
    pmax = tl.max(pp, axis=1)
    eq = (pmax == tl.min(pp, axis=1)) & (tl.max(tl.reshape(nmask.to(tl.int32), [BLOCK_N // 2, 2]), axis=1) > 0)
    cm = (c < C)[None, :]
    pe = gbase + pmax[:, None] + c[None, :]
    me = eq[:, None] & cm
    tl.atomic_add(pe, _pair_sum(a00, BLOCK_N, BLOCK_C), mask=me, sem="relaxed")
    tl.atomic_add(pe + C, _pair_sum(a01, BLOCK_N, BLOCK_C), mask=me, sem="relaxed")
    tl.atomic_add(pe + row_stride, _pair_sum(a10, BLOCK_N, BLOCK_C), mask=me, sem="relaxed")
    tl.atomic_add(pe + row_stride + C, _pair_sum(a11, BLOCK_N, BLOCK_C), mask=me, sem="relaxed")
    eq_n = tl.reshape(tl.broadcast_to(eq[:, None], [BLOCK_N // 2, 2]), [BLOCK_N])
    _red4(gbase + p00[:, None] + c[None, :], C, row_stride, a00, a01, a10, a11,
          m2 & (eq_n == 0)[:, None], w00, w01, w10, w11)


@triton.jit
def _chunk_grads(g, b_xy, b_xz, b_yz, p_xy, p_xz, p_yz, RX, RY, C, c, m2, fx, fy, fz,
                 NEED_DQ: tl.constexpr):
    """Upstream gradients of the three planes' bilinear values for one channel chunk, and (when
    NEED_DQ) this chunk's share of d(feature)/d(unnormalized coordinate) per point: (sx, sy, sz)."""
    a00, a01, a10, a11 = _tap4(b_xy, p_xy, RX * C, C, c, m2)
    b00, b01, b10, b11 = _tap4(b_xz, p_xz, RX * C, C, c, m2)
    e00, e01, e10, e11 = _tap4(b_yz, p_yz, RY * C, C, c, m2)
    s_xy = _lerp2(a00, a01, a10, a11, fx, fy)
    s_xz = _lerp2(b00, b01, b10, b11, fx, fz)
    s_yz = _lerp2(e00, e01, e10, e11, fy, fz)
    g_xy = g * (s_xz * s_yz)
    g_xz = g * (s_xy * s_yz)
    g_yz = g * (s_xy * s_xz)
    if NEED_DQ:
        # d(bilinear)/d(column), d(bilinear)/d(row) per plane, weighted by its upstream grad
        du_xy = (a01 - a00) * (1.0 - fy)[:, None] + (a11 - a10) * fy[:, None]
        dv_xy = (a10 - a00) * (1.0 - fx)[:, None] + (a11 - a01) * fx[:, None]
        du_xz = (b01 - b00) * (1.0 - fz)[:, None] + (b11 - b10) * fz[:, None]
        dv_xz = (b10 - b00) * (1.0 - fx)[:, None] + (b11 - b01) * fx[:, None]
        du_yz = (e01 - e00) * (1.0 - fz)[:, None] + (e11 - e10) * fz[:, None]
        dv_yz = (e10 - e00) * (1.0 - fy)[:, None] + (e11 - e01) * fy[:, None]
        sx = tl.sum(g_xy * du_xy + g_xz * du_xz, axis=1)
        sy = tl.sum(g_xy * dv_xy + g_yz * du_yz, axis=1)
        sz = tl.sum(g_xz * dv_xz + g_yz * dv_yz, axis=1)
    else:
        sx = 0.0
        sy = 0.0
        sz = 0.0
    return g_xy, g_xz, g_yz, sx, sy, sz


@triton.jit
def _store_dq(dq_ptr, s, n, nmask, t, N, gx, gy, gz, ACCUM: tl.constexpr):
    """dL/dq of points n for rotation t into dq laid out (3, T, N) (coalesced along points;
    s = T * N, passed from the host: int32 arguments equal to 1 arrive as constants); ACCUM adds
    to what the previous scale wrote."""
    p = dq_ptr + t.to(tl.int64) * N + n
    if ACCUM:
        gx += tl.load(p, mask=nmask, other=0.0)
        gy += tl.load(p + s, mask=nmask, other=0.0)
        gz += tl.load(p + 2 * s, mask=nmask, other=0.0)
    tl.store(p, gx, mask=nmask)
    tl.store(p + s, gy, mask=nmask)
    tl.store(p + 2 * s, gz, mask=nmask)


@triton.jit
def _add_gm(gm_ptr, pts_ptr, n, nmask, gx, gy, gz):
    """This program's share of dL/dM_t, the sum over its points of dq p^T (9 floats), stored in
    its own slot ``gm_ptr`` of the partials buffer; the host sums the slots in a fixed order, so
    the frame matrices' gradient is deterministic (atomics would not be) and dq need not be written
    out and reduced over N afterwards."""
    x, y, z = _points(pts_ptr, n, nmask)
    _store_sums9(gm_ptr, gx * x, gx * y, gx * z, gy * x, gy * y, gy * z, gz * x, gz * y, gz * z)


@triton.jit
def _store_sums9(gm_ptr, g00, g01, g02, g10, g11, g12, g20, g21, g22):
    """A program's dL/dM_t partial: the sums of 9 tensors (any shape) into its slot ``gm_ptr``."""
    tl.store(gm_ptr + 0, tl.sum(tl.reshape(g00, [g00.numel]), axis=0))
    tl.store(gm_ptr + 1, tl.sum(tl.reshape(g01, [g00.numel]), axis=0))
    tl.store(gm_ptr + 2, tl.sum(tl.reshape(g02, [g00.numel]), axis=0))
    tl.store(gm_ptr + 3, tl.sum(tl.reshape(g10, [g00.numel]), axis=0))
    tl.store(gm_ptr + 4, tl.sum(tl.reshape(g11, [g00.numel]), axis=0))
    tl.store(gm_ptr + 5, tl.sum(tl.reshape(g12, [g00.numel]), axis=0))
    tl.store(gm_ptr + 6, tl.sum(tl.reshape(g20, [g00.numel]), axis=0))
    tl.store(gm_ptr + 7, tl.sum(tl.reshape(g21, [g00.numel]), axis=0))
    tl.store(gm_ptr + 8, tl.sum(tl.reshape(g22, [g00.numel]), axis=0))


@triton.jit
def kplanes_fwd_kernel(pts_ptr, mat_ptr, planes_ptr, out_ptr, N, F, col0,
                       off_xy, off_xz, off_yz, RX, RY, RZ,
                       T: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_C: tl.constexpr, OUT_BF16: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.program_id(1)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    q0, q1, q2 = _rotate(pts_ptr, mat_ptr, n, nmask, t)
    ix, fx, _dx = _axis(q0, (RX - 1).to(tl.float32))
    iy, fy, _dy = _axis(q1, (RY - 1).to(tl.float32))
    iz, fz, _dz = _axis(q2, (RZ - 1).to(tl.float32))
    # plane bases for rotation t (int64: the flat buffer may be large)
    b_xy = planes_ptr + off_xy + (t * RY * RX * C).to(tl.int64)
    b_xz = planes_ptr + off_xz + (t * RZ * RX * C).to(tl.int64)
    b_yz = planes_ptr + off_yz + (t * RZ * RY * C).to(tl.int64)
    p_xy = (iy * RX + ix) * C
    p_xz = (iz * RX + ix) * C
    p_yz = (iz * RY + iy) * C
    out_row = out_ptr + n.to(tl.int64) * F + col0 + t * C
    for c0 in tl.static_range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m2 = nmask[:, None] & (c < C)[None, :]
        a00, a01, a10, a11 = _tap4(b_xy, p_xy, RX * C, C, c, m2)
        s = _lerp2(a00, a01, a10, a11, fx, fy)
        a00, a01, a10, a11 = _tap4(b_xz, p_xz, RX * C, C, c, m2)
        s = s * _lerp2(a00, a01, a10, a11, fx, fz)
        a00, a01, a10, a11 = _tap4(b_yz, p_yz, RY * C, C, c, m2)
        s = s * _lerp2(a00, a01, a10, a11, fy, fz)
        if OUT_BF16:
            s = s.to(tl.bfloat16)
        tl.store(out_row[:, None] + c[None, :], s, mask=m2)


@triton.jit
def kplanes_bwd_kernel(grad_ptr, pts_ptr, mat_ptr, planes_ptr, gplanes_ptr, dq_ptr, dq_stride,
                       gm_ptr, gm_slot0, N, F, col0, off_xy, off_xz, off_yz, RX, RY, RZ,
                       T: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_C: tl.constexpr, NEED_DQ: tl.constexpr, ACCUM_DQ: tl.constexpr,
                       NEED_GM: tl.constexpr, NEED_S: tl.constexpr):
    """Backward "pairs": a program owns BLOCK_N consecutive points and one rotation t."""
    pid = tl.program_id(0)
    t = tl.program_id(1)
    lane = tl.arange(0, BLOCK_N)
    n = pid * BLOCK_N + lane
    nmask = n < N
    q0, q1, q2 = _rotate(pts_ptr, mat_ptr, n, nmask, t)
    ix, fx, dx = _axis(q0, (RX - 1).to(tl.float32))
    iy, fy, dy = _axis(q1, (RY - 1).to(tl.float32))
    iz, fz, dz = _axis(q2, (RZ - 1).to(tl.float32))
    p_xy = (iy * RX + ix) * C
    p_xz = (iz * RX + ix) * C
    p_yz = (iz * RY + iy) * C
    off_t_xy = off_xy + (t * RY * RX * C).to(tl.int64)
    off_t_xz = off_xz + (t * RZ * RX * C).to(tl.int64)
    off_t_yz = off_yz + (t * RZ * RY * C).to(tl.int64)
    g_row = grad_ptr + n.to(tl.int64) * F + col0 + t * C
    acc_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_y = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c0 in tl.static_range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m2 = nmask[:, None] & (c < C)[None, :]
        g = tl.load(g_row[:, None] + c[None, :], mask=m2, other=0.0).to(tl.float32)
        g_xy, g_xz, g_yz, sx, sy, sz = _chunk_grads(
            g, planes_ptr + off_t_xy, planes_ptr + off_t_xz, planes_ptr + off_t_yz,
            p_xy, p_xz, p_yz, RX, RY, C, c, m2, fx, fy, fz, NEED_S)
        if NEED_S:
            acc_x += sx
            acc_y += sy
            acc_z += sz
        _scatter4(gplanes_ptr + off_t_xy, p_xy, RX * C, C, c, m2, g_xy, fx, fy, nmask, BLOCK_N,
                  BLOCK_C)
        _scatter4(gplanes_ptr + off_t_xz, p_xz, RX * C, C, c, m2, g_xz, fx, fz, nmask, BLOCK_N,
                  BLOCK_C)
        _scatter4(gplanes_ptr + off_t_yz, p_yz, RY * C, C, c, m2, g_yz, fy, fz, nmask, BLOCK_N,
                  BLOCK_C)
    if NEED_DQ:
        _store_dq(dq_ptr, dq_stride, n.to(tl.int64), nmask, t, N, acc_x * dx, acc_y * dy,
                  acc_z * dz, ACCUM_DQ)
    if NEED_GM:
        _add_gm(gm_ptr + ((gm_slot0 + pid).to(tl.int64) * T + t) * 9, pts_ptr, n, nmask, acc_x * dx,
                acc_y * dy, acc_z * dz)


@triton.jit
def _outer3(a0, a1, a2, d, x, y, z):
    return a0 + d * x, a1 + d * y, a2 + d * z


@triton.jit
def _pick(acc00, acc01, acc10, acc11, ox, oy):
    """Per row, the accumulator of old corner (ox, oy) (column, row offsets), or 0 if outside."""
    cx0 = (ox == 0)[:, None]
    cx1 = (ox == 1)[:, None]
    r0 = tl.where(cx0, acc00, tl.where(cx1, acc01, 0.0))
    r1 = tl.where(cx0, acc10, tl.where(cx1, acc11, 0.0))
    return tl.where((oy == 0)[:, None], r0, tl.where((oy == 1)[:, None], r1, 0.0))


@triton.jit
def _run_step(gbase, acc00, acc01, acc10, acc11, pu, pv, du, dv, Ru, C: tl.constexpr, c, cmask,
              g, fu, fv):
    """Advance one plane's texel accumulators by one point of each row.

    The previous point's cell is (pu, pv); the new one is (pu + du, pv + dv). Old corner (x, y) is
    the texel (pu + x, pv + y); it is the new corner (x - du, y - dv) when that lies in {0,1}^2 and
    its sum carries on, otherwise its sum is final and flushed with one atomic per channel.
    """
    rs = Ru * C
    po = gbase + ((pv * Ru + pu) * C)[:, None] + c[None, :]
    kx0 = (du == 0) | (du == -1)  # old column 0 stays a corner
    kx1 = (du == 0) | (du == 1)
    ky0 = (dv == 0) | (dv == -1)
    ky1 = (dv == 0) | (dv == 1)
    cm = cmask[None, :]
    tl.atomic_add(po, acc00, mask=(~(kx0 & ky0))[:, None] & cm, sem="relaxed")
    tl.atomic_add(po + C, acc01, mask=(~(kx1 & ky0))[:, None] & cm, sem="relaxed")
    tl.atomic_add(po + rs, acc10, mask=(~(kx0 & ky1))[:, None] & cm, sem="relaxed")
    tl.atomic_add(po + rs + C, acc11, mask=(~(kx1 & ky1))[:, None] & cm, sem="relaxed")
    gu = 1.0 - fu
    gv = 1.0 - fv
    n00 = _pick(acc00, acc01, acc10, acc11, du, dv) + g * (gu * gv)[:, None]
    n01 = _pick(acc00, acc01, acc10, acc11, du + 1, dv) + g * (fu * gv)[:, None]
    n10 = _pick(acc00, acc01, acc10, acc11, du, dv + 1) + g * (gu * fv)[:, None]
    n11 = _pick(acc00, acc01, acc10, acc11, du + 1, dv + 1) + g * (fu * fv)[:, None]
    return n00, n01, n10, n11


@triton.jit
def _run_flush(gbase, acc00, acc01, acc10, acc11, pu, pv, Ru, C: tl.constexpr, c, m2):
    po = gbase + ((pv * Ru + pu) * C)[:, None] + c[None, :]
    tl.atomic_add(po, acc00, mask=m2, sem="relaxed")
    tl.atomic_add(po + C, acc01, mask=m2, sem="relaxed")
    tl.atomic_add(po + Ru * C, acc10, mask=m2, sem="relaxed")
    tl.atomic_add(po + Ru * C + C, acc11, mask=m2, sem="relaxed")


@triton.jit
def kplanes_bwd_runs_kernel(grad_ptr, pts_ptr, mat_ptr, planes_ptr, gplanes_ptr, dq_ptr,
                            dq_stride, gm_ptr, gm_slot0, N, F, col0, off_xy, off_xz, off_yz, RX, RY, RZ,
                            T: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr,
                            RUN: tl.constexpr, BLOCK_C: tl.constexpr, NEED_DQ: tl.constexpr,
                            ACCUM_DQ: tl.constexpr, NEED_GM: tl.constexpr, NEED_S: tl.constexpr):
    """Backward "runs": texel-run accumulation.

    A program owns ROWS rows of RUN consecutive points and one rotation t (grid axis 1); for each
    channel chunk it walks its rows' points in order. Each plane keeps, per row, the running
    gradient sums of the 4 corner texels of the current cell; moving to a neighbouring cell carries
    the shared corners' sums on and flushes only the others, so the samples of one ray (neighbours
    in memory) issue one atomic per texel they touch instead of one per point and corner. dL/dq is
    summed over the chunks in registers ([ROWS, RUN] per axis) and written once per scale; without
    dL/dq (a training step's frames only) the frame matrices' gradient sum(dq p^T) is summed along
    each row as the walk goes (9 values a row instead of 3 x RUN).
    """
    pid = tl.program_id(0)
    t = tl.program_id(1)
    row0 = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64) * RUN
    kk = tl.arange(0, RUN)
    off_t_xy = off_xy + (t * RY * RX * C).to(tl.int64)
    off_t_xz = off_xz + (t * RZ * RX * C).to(tl.int64)
    off_t_yz = off_yz + (t * RZ * RY * C).to(tl.int64)
    g_xy_base = gplanes_ptr + off_t_xy
    g_xz_base = gplanes_ptr + off_t_xz
    g_yz_base = gplanes_ptr + off_t_yz
    if NEED_DQ:
        dqx = tl.zeros([ROWS, RUN], dtype=tl.float32)
        dqy = tl.zeros([ROWS, RUN], dtype=tl.float32)
        dqz = tl.zeros([ROWS, RUN], dtype=tl.float32)
    zr = tl.zeros([ROWS], dtype=tl.float32)
    m00, m01, m02, m10, m11, m12, m20, m21, m22 = zr, zr, zr, zr, zr, zr, zr, zr, zr
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cmask = c < C
        zero = tl.zeros([ROWS, BLOCK_C], dtype=tl.float32)
        a00, a01, a10, a11 = zero, zero, zero, zero  # xy plane
        b00, b01, b10, b11 = zero, zero, zero, zero  # xz plane
        e00, e01, e10, e11 = zero, zero, zero, zero  # yz plane
        pix = tl.zeros([ROWS], dtype=tl.int32)
        piy = tl.zeros([ROWS], dtype=tl.int32)
        piz = tl.zeros([ROWS], dtype=tl.int32)
        for k in range(RUN):
            n = row0 + k
            nmask = n < N
            px, py, pz = _points(pts_ptr, n, nmask)
            q0, q1, q2 = _turn(mat_ptr, t, px, py, pz)
            ix, fx, dx = _axis(q0, (RX - 1).to(tl.float32))
            iy, fy, dy = _axis(q1, (RY - 1).to(tl.float32))
            iz, fz, dz = _axis(q2, (RZ - 1).to(tl.float32))
            m2 = nmask[:, None] & cmask[None, :]
            g = tl.load(grad_ptr + n[:, None] * F + col0 + t * C + c[None, :], mask=m2,
                        other=0.0).to(tl.float32)
            g_xy, g_xz, g_yz, sx, sy, sz = _chunk_grads(
                g, planes_ptr + off_t_xy, planes_ptr + off_t_xz, planes_ptr + off_t_yz,
                (iy * RX + ix) * C, (iz * RX + ix) * C, (iz * RY + iy) * C, RX, RY, C, c, m2,
                fx, fy, fz, NEED_S)
            if NEED_DQ:
                col = (kk == k)[None, :]
                dqx = tl.where(col, dqx + (sx * dx)[:, None], dqx)
                dqy = tl.where(col, dqy + (sy * dy)[:, None], dqy)
                dqz = tl.where(col, dqz + (sz * dz)[:, None], dqz)
            elif NEED_GM:
                m00, m01, m02 = _outer3(m00, m01, m02, sx * dx, px, py, pz)
                m10, m11, m12 = _outer3(m10, m11, m12, sy * dy, px, py, pz)
                m20, m21, m22 = _outer3(m20, m21, m22, sz * dz, px, py, pz)
            # points past N contribute zeros and stay in the previous cell; the first point of a
            # row opens its run (sums zero, nothing flushed)
            ix = tl.where(nmask, ix, pix)
            iy = tl.where(nmask, iy, piy)
            iz = tl.where(nmask, iz, piz)
            first = k == 0
            pix = tl.where(first, ix, pix)
            piy = tl.where(first, iy, piy)
            piz = tl.where(first, iz, piz)
            dxi = ix - pix
            dyi = iy - piy
            dzi = iz - piz
            a00, a01, a10, a11 = _run_step(g_xy_base, a00, a01, a10, a11, pix, piy, dxi, dyi, RX,
                                           C, c, cmask, g_xy, fx, fy)
            b00, b01, b10, b11 = _run_step(g_xz_base, b00, b01, b10, b11, pix, piz, dxi, dzi, RX,
                                           C, c, cmask, g_xz, fx, fz)
            e00, e01, e10, e11 = _run_step(g_yz_base, e00, e01, e10, e11, piy, piz, dyi, dzi, RY,
                                           C, c, cmask, g_yz, fy, fz)
            pix = ix
            piy = iy
            piz = iz
        m2 = (row0 < N)[:, None] & cmask[None, :]
        _run_flush(g_xy_base, a00, a01, a10, a11, pix, piy, RX, C, c, m2)
        _run_flush(g_xz_base, b00, b01, b10, b11, pix, piz, RX, C, c, m2)
        _run_flush(g_yz_base, e00, e01, e10, e11, piy, piz, RY, C, c, m2)
    gm_slot = gm_ptr + ((gm_slot0 + pid).to(tl.int64) * T + t) * 9
    if NEED_DQ:
        n2 = row0[:, None] + kk[None, :]
        _store_dq(dq_ptr, dq_stride, n2, n2 < N, t, N, dqx, dqy, dqz, ACCUM_DQ)
        if NEED_GM:
            _add_gm(gm_slot, pts_ptr, n2, n2 < N, dqx, dqy, dqz)
    elif NEED_GM:
        _store_sums9(gm_slot, m00, m01, m02, m10, m11, m12, m20, m21, m22)  # the rows' running sums


# ------------------------------------------------------------------------------------ launchers
def _block_c(C: int) -> int:
    if C % 16 == 0:
        return 16
    return min(32, triton.next_power_of_2(C))


BACKWARDS = ("runs", "pairs")


@dataclasses.dataclass(frozen=True)
class KPlanesTuning:
    """Launch settings of the interpolation kernels (defaults set by measurements:
    docs/kernels.md). Frozen: a variant is a new object passed down, never a changed global."""

    fwd_block_n: int = 32
    """Forward: points per program."""
    fwd_maxnreg: int | None = None
    """Forward: register cap per thread (None: the compiler's choice, which every cap timed by
    ``probe_bwd_knockout.py --fwd-maxnreg`` lost to; docs/kernels.md)."""
    backward: str = "runs"
    """"runs" (texel runs) or "pairs" (pair merge); "runs" falls back to "pairs" on small problems
    (``min_programs_per_sm``)."""
    pairs_block_n: int = 32
    """"pairs": points per program (even)."""
    run_rows: int = 8
    """"runs": rows per program (power of two)."""
    run_len: int = 16
    """"runs": consecutive points per row (power of two)."""
    run_warps: int = 1
    """"runs": warps per program."""
    run_maxnreg: int | None = 168
    """"runs": register cap per thread (None: the compiler's choice)."""
    few_channel_rows: int = 16
    """"runs": rows per program, instead of ``run_rows``, for a scale of few channels (C <= 16)
    whose planes are at most ``few_channel_max_res`` texels a side (0: ``run_rows`` everywhere).
    At the camera2k step's shape (C = 8) on an H100, 16 rows took the backward of its scales 256
    and 512 from 1.63 and 1.74 ms to 1.22 and 1.36, and that of its scale 1024 from 2.23 to 2.32
    (docs/kernels.md, "The camera step"). Only where that still launches ``min_programs_per_sm``
    programs an SM (:func:`scale_rows`)."""
    few_channel_max_res: int = 512
    """The largest plane side that takes ``few_channel_rows``."""
    small_tile_maxnreg: int | None = 128
    """"runs": register cap, instead of ``run_maxnreg``, for a launch whose channel chunk (rows x
    BLOCK_C) is at most 64 elements a warp, 2 a thread, such as 8 rows of C = 8 (None:
    ``run_maxnreg``). Such a walk fits 128 registers without spilling (a local sm_90 compile; 12
    or 16 channels do not), and it waits on its gathers: 3 warps a scheduler at 168 registers, 4 at
    128. At the camera2k step's scale 1024 on an H100 its backward took 2.04 ms against 2.18
    (docs/kernels.md, "Hardware counters")."""
    min_programs_per_sm: int = 16
    """A texel-run program walks its points one after another; with few programs (the embedded
    default: 49 k points, T = 2 -> 768 one-warp programs on 132 SMs) that serial walk is exposed.
    Below this many programs per SM "runs" becomes "pairs" (0: never)."""

    def __post_init__(self) -> None:
        if self.backward not in BACKWARDS:
            raise ValueError(f"KPlanesTuning.backward must be one of {BACKWARDS}, got {self.backward!r}")
        for name in ("run_rows", "run_len", "few_channel_rows"):
            v = getattr(self, name)
            if (v < 1 and not (name == "few_channel_rows" and v == 0)) or v & (v - 1):
                raise ValueError(f"KPlanesTuning.{name} must be a power of two, got {v}")
        if self.pairs_block_n < 2 or self.pairs_block_n & (self.pairs_block_n - 1):
            raise ValueError(f"KPlanesTuning.pairs_block_n must be a power of two >= 2, got {self.pairs_block_n}")

    def rows(self, channels: int, side: int) -> int:
        """"runs": rows per program for a scale of ``channels`` channels whose largest plane side
        is ``side`` texels."""
        if self.few_channel_rows and channels <= 16 and side <= self.few_channel_max_res:
            return self.few_channel_rows
        return self.run_rows

    def maxnreg(self, channels: int, rows: int) -> int | None:
        """"runs": the register cap of a launch of ``rows`` rows for ``channels`` channels."""
        if self.small_tile_maxnreg and rows * _block_c(channels) <= 64 * self.run_warps:
            return self.small_tile_maxnreg
        return self.run_maxnreg


DEFAULT_TUNING = KPlanesTuning()


def kplanes_forward(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor,
                    layout: PlaneLayout, out_bf16: bool,
                    tuning: KPlanesTuning = DEFAULT_TUNING) -> torch.Tensor:
    """Features (N, L*T*C), fp32 or (``out_bf16``) bf16. ``plane_data`` is fp32 or a bf16 copy of
    the planes (half the gathered bytes; widened to fp32 on load)."""
    points, matrices, plane_data = points.contiguous(), matrices.contiguous(), plane_data.contiguous()
    N = points.shape[0]
    T, C = layout.n_rot, layout.channels
    F = layout.n_features
    out = torch.empty((N, F), device=points.device,
                      dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if N == 0:
        return out
    bn = tuning.fwd_block_n
    grid = (triton.cdiv(N, bn), T)
    extra = {"maxnreg": int(tuning.fwd_maxnreg)} if tuning.fwd_maxnreg else {}
    for l, rx, ry, rz, oxy, oxz, oyz in layout.scales():
        launch(kplanes_fwd_kernel, grid, points, matrices, plane_data, out, N, F, l * T * C,
               oxy, oxz, oyz, rx, ry, rz, T=T, C=C, BLOCK_N=bn,
               BLOCK_C=_block_c(C), OUT_BF16=out_bf16, num_warps=4, **extra)
    return out


def _few_programs(n_points: int, n_rot: int, rows: int, device: torch.device, tuning: KPlanesTuning) -> bool:
    """Whether a texel-run launch of ``rows`` rows a program would give a CUDA device fewer than
    ``tuning.min_programs_per_sm`` programs an SM."""
    if device.type != "cuda" or not tuning.min_programs_per_sm:
        return False
    return triton.cdiv(n_points, rows * tuning.run_len) * n_rot < tuning.min_programs_per_sm * sm_count(device)


def backward_strategy(n_points: int, n_rot: int, device: torch.device,
                      tuning: KPlanesTuning = DEFAULT_TUNING) -> str:
    """The backward a call takes: ``tuning.backward``, except that "runs" becomes "pairs" when the
    texel-run kernel would launch fewer than ``tuning.min_programs_per_sm`` programs per SM of a
    CUDA device."""
    if tuning.backward == "runs" and _few_programs(n_points, n_rot, tuning.run_rows, device, tuning):
        return "pairs"
    return tuning.backward


def scale_rows(n_points: int, n_rot: int, channels: int, side: int, device: torch.device,
               tuning: KPlanesTuning = DEFAULT_TUNING) -> int:
    """Rows per program of one scale's texel-run launch: ``tuning.rows(channels, side)`` where that
    still gives ``tuning.min_programs_per_sm`` programs an SM (measured at the camera step's 6.3 M
    points), else ``tuning.run_rows``."""
    rows = tuning.rows(channels, side)
    if rows != tuning.run_rows and _few_programs(n_points, n_rot, rows, device, tuning):
        return tuning.run_rows
    return rows


def kplanes_backward(grad: torch.Tensor, points: torch.Tensor, matrices: torch.Tensor,
                     plane_data: torch.Tensor, layout: PlaneLayout, need_dq: bool,
                     tuning: KPlanesTuning = DEFAULT_TUNING, need_gm: bool = False,
                     gplanes: torch.Tensor | None = None):
    """Plane gradients (added to ``gplanes``, a contiguous fp32 buffer of the planes' shape, when
    given: the plane TV's gradient, so that no zeroed buffer is written and no second gradient
    added to this one), dL/dq laid out (3, T, N) (N = 0 unless need_dq) and, with need_gm, the
    frame matrices' gradient dL/dM (T, 3, 3) from per-program partial sums added up here in a fixed
    order, so it is deterministic ((0, 3, 3) without need_gm); the strategy from
    ``backward_strategy``. ``plane_data`` may be a bf16 copy (sampled from, as in
    :func:`kplanes_forward`); the plane gradients are fp32."""
    points, matrices, plane_data = points.contiguous(), matrices.contiguous(), plane_data.contiguous()
    N = points.shape[0]
    T, C = layout.n_rot, layout.channels
    F = layout.n_features
    strategy = backward_strategy(N, T, device_of(points), tuning)
    bc = _block_c(C)
    if gplanes is None:
        gplanes = torch.zeros(plane_data.shape, device=plane_data.device, dtype=torch.float32)
    dq = torch.empty((3, T, N if need_dq else 0), device=points.device, dtype=torch.float32)
    scales = list(layout.scales())
    dev = device_of(points)
    per_program = [scale_rows(N, T, C, max(s[1:4]), dev, tuning) * tuning.run_len if strategy == "runs"
                   else tuning.pairs_block_n for s in scales]
    n_progs = [triton.cdiv(N, n) for n in per_program]
    first = [sum(n_progs[:i]) for i in range(len(scales))]  # each scale's first slot
    # one slot of 9 partial sums per (scale, program, t), each written by one program
    partials = torch.empty((sum(n_progs) if need_gm else 0, T, 9), device=points.device,
                           dtype=torch.float32)
    if N == 0:
        return gplanes, dq, torch.zeros((T if need_gm else 0, 3, 3), device=points.device, dtype=torch.float32)
    grad = grad.contiguous()  # autograd may hand an expanded (stride-0) gradient
    for (l, rx, ry, rz, oxy, oxz, oyz), per in zip(scales, per_program):
        common = (grad, points, matrices, plane_data, gplanes, dq, T * N, partials, first[l], N, F,
                  l * T * C, oxy, oxz, oyz, rx, ry, rz)
        flags = dict(NEED_DQ=need_dq, ACCUM_DQ=l > 0, NEED_GM=need_gm, NEED_S=need_dq or need_gm)
        if strategy == "runs":
            rows, run = per // tuning.run_len, tuning.run_len
            cap = tuning.maxnreg(C, rows)
            extra = {"maxnreg": int(cap)} if cap else {}
            launch(kplanes_bwd_runs_kernel, (triton.cdiv(N, rows * run), T), *common, T=T, C=C, ROWS=rows,
                   RUN=run, BLOCK_C=bc, num_warps=tuning.run_warps, **flags, **extra)
        else:
            bn = tuning.pairs_block_n
            launch(kplanes_bwd_kernel, (triton.cdiv(N, bn), T), *common, T=T, C=C, BLOCK_N=bn, BLOCK_C=bc,
                   num_warps=4, **flags)
    gm = sum_parts(partials, dim=0).reshape(-1, 3, 3) if need_gm else partials.new_zeros((0, 3, 3))
    return gplanes, dq, gm
