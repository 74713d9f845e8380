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
dq by two small einsums on the host side. Atomic traffic reduction (samples of one ray are
neighbours), chosen by MERGE. The default, 3, is ``kplanes_bwd_runs_kernel`` (texel runs): each
row of consecutive points keeps its current cell's 4 corner-texel sums in registers, carries the
corners a neighbouring cell shares and flushes one atomic per texel it leaves. 0, 1 and 2 are
``kplanes_bwd_kernel``, kept as measured alternatives: 0 one atomic per point and corner, 1 a
segmented scan over runs of equal cells, 2 pairs (2i, 2i+1) in the same cell; its SKIP_ZERO drops
atomics of exact-zero corner weights (coordinates clamped at the border).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _rotate(pts_ptr, mat_ptr, n, nmask, t):
    n64 = n.to(tl.int64)
    x = tl.load(pts_ptr + n64 * 3 + 0, mask=nmask, other=0.0)
    y = tl.load(pts_ptr + n64 * 3 + 1, mask=nmask, other=0.0)
    z = tl.load(pts_ptr + n64 * 3 + 2, mask=nmask, other=0.0)
    m = mat_ptr + t * 9
    q0 = tl.load(m + 0) * x + tl.load(m + 1) * y + tl.load(m + 2) * z
    q1 = tl.load(m + 3) * x + tl.load(m + 4) * y + tl.load(m + 5) * z
    q2 = tl.load(m + 6) * x + tl.load(m + 7) * y + tl.load(m + 8) * z
    return q0, q1, q2


@triton.jit
def _cells(pts_ptr, mat_ptr, n, nmask, t, RX, RY, RZ):
    """Texel-cell keys (one int per plane kind) of points n; used to find runs of equal cells."""
    q0, q1, q2 = _rotate(pts_ptr, mat_ptr, n, nmask, t)
    ix, _fx, _dx = _axis(q0, (RX - 1).to(tl.float32))
    iy, _fy, _dy = _axis(q1, (RY - 1).to(tl.float32))
    iz, _fz, _dz = _axis(q2, (RZ - 1).to(tl.float32))
    return iy * RX + ix, iz * RX + ix, iz * RY + iy


@triton.jit
def _tap4(base, p00, row_stride, C, c, m2):
    p = base + p00[:, None] + c[None, :]
    v00 = tl.load(p, mask=m2, other=0.0)
    v01 = tl.load(p + C, mask=m2, other=0.0)
    v10 = tl.load(p + row_stride, mask=m2, other=0.0)
    v11 = tl.load(p + row_stride + C, mask=m2, other=0.0)
    return v00, v01, v10, v11


@triton.jit
def _lerp2(v00, v01, v10, v11, fu, fv):
    gu = 1.0 - fu
    gv = 1.0 - fv
    return (v00 * (gu * gv)[:, None] + v01 * (fu * gv)[:, None]
            + v10 * (gu * fv)[:, None] + v11 * (fu * fv)[:, None])


@triton.jit
def _seg_add(fa, a0, a1, a2, a3, fb, b0, b1, b2, b3):
    # segmented sum: b starts a new segment when fb != 0
    keep = fb != 0
    return (fa | fb, tl.where(keep, b0, a0 + b0), tl.where(keep, b1, a1 + b1),
            tl.where(keep, b2, a2 + b2), tl.where(keep, b3, a3 + b3))


@triton.jit
def _red4(p, C, row_stride, a00, a01, a10, a11, m2, w00, w01, w10, w11, SKIP_ZERO: tl.constexpr):
    if SKIP_ZERO:  # clamped (outside) coordinates give exact-zero corner weights: no traffic
        tl.atomic_add(p, a00, mask=m2 & (w00 != 0.0)[:, None], sem="relaxed")
        tl.atomic_add(p + C, a01, mask=m2 & (w01 != 0.0)[:, None], sem="relaxed")
        tl.atomic_add(p + row_stride, a10, mask=m2 & (w10 != 0.0)[:, None], sem="relaxed")
        tl.atomic_add(p + row_stride + C, a11, mask=m2 & (w11 != 0.0)[:, None], sem="relaxed")
    else:
        tl.atomic_add(p, a00, mask=m2, sem="relaxed")
        tl.atomic_add(p + C, a01, mask=m2, sem="relaxed")
        tl.atomic_add(p + row_stride, a10, mask=m2, sem="relaxed")
        tl.atomic_add(p + row_stride + C, a11, mask=m2, sem="relaxed")


@triton.jit
def _pair_sum(a, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    return tl.sum(tl.reshape(a, [BLOCK_N // 2, 2, BLOCK_C]), axis=1)


@triton.jit
def _scatter4(gbase, p00, row_stride, C, c, m2, g, fu, fv, start, end, nmask,
              MERGE: tl.constexpr, SKIP_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_C: tl.constexpr):
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
    if MERGE == 1:
        # segmented scan over runs of equal cells; the last point of a run flushes the run's sum
        flag = tl.broadcast_to(start[:, None], a00.shape)
        _f, a00, a01, a10, a11 = tl.associative_scan((flag, a00, a01, a10, a11), 0, _seg_add)
        m2 = m2 & (end[:, None] != 0)
        _red4(gbase + p00[:, None] + c[None, :], C, row_stride, a00, a01, a10, a11, m2,
              w00, w01, w10, w11, False)
    elif MERGE == 2:
        # pairs (2i, 2i+1) in the same cell (p00 equal) issue one atomic for both
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
              m2 & (eq_n == 0)[:, None], w00, w01, w10, w11, SKIP_ZERO)
    else:
        _red4(gbase + p00[:, None] + c[None, :], C, row_stride, a00, a01, a10, a11, m2,
              w00, w01, w10, w11, SKIP_ZERO)


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
                       N, F, col0, off_xy, off_xz, off_yz, RX, RY, RZ,
                       T: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_C: tl.constexpr, NEED_DQ: tl.constexpr, ACCUM_DQ: tl.constexpr,
                       MERGE: tl.constexpr, SKIP_ZERO: tl.constexpr):
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
    if MERGE == 1:
        # runs of equal cells among consecutive points (within this block)
        k_xy = iy * RX + ix
        k_xz = iz * RX + ix
        k_yz = iz * RY + iy
        pm_xy, pm_xz, pm_yz = _cells(pts_ptr, mat_ptr, n - 1, nmask & (lane > 0), t, RX, RY, RZ)
        nx_xy, nx_xz, nx_yz = _cells(pts_ptr, mat_ptr, n + 1, (n + 1) < N, t, RX, RY, RZ)
        first = lane == 0
        last = (lane == BLOCK_N - 1) | ((n + 1) >= N)
        st_xy = (first | (pm_xy != k_xy)).to(tl.int32)
        st_xz = (first | (pm_xz != k_xz)).to(tl.int32)
        st_yz = (first | (pm_yz != k_yz)).to(tl.int32)
        en_xy = (last | (nx_xy != k_xy)).to(tl.int32)
        en_xz = (last | (nx_xz != k_xz)).to(tl.int32)
        en_yz = (last | (nx_yz != k_yz)).to(tl.int32)
    else:
        st_xy = lane
        st_xz = lane
        st_yz = lane
        en_xy = lane
        en_xz = lane
        en_yz = lane
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
            p_xy, p_xz, p_yz, RX, RY, C, c, m2, fx, fy, fz, NEED_DQ)
        if NEED_DQ:
            acc_x += sx
            acc_y += sy
            acc_z += sz
        _scatter4(gplanes_ptr + off_t_xy, p_xy, RX * C, C, c, m2, g_xy, fx, fy, st_xy, en_xy, nmask,
                  MERGE, SKIP_ZERO, BLOCK_N, BLOCK_C)
        _scatter4(gplanes_ptr + off_t_xz, p_xz, RX * C, C, c, m2, g_xz, fx, fz, st_xz, en_xz, nmask,
                  MERGE, SKIP_ZERO, BLOCK_N, BLOCK_C)
        _scatter4(gplanes_ptr + off_t_yz, p_yz, RY * C, C, c, m2, g_yz, fy, fz, st_yz, en_yz, nmask,
                  MERGE, SKIP_ZERO, BLOCK_N, BLOCK_C)
    if NEED_DQ:
        _store_dq(dq_ptr, dq_stride, n.to(tl.int64), nmask, t, N, acc_x * dx, acc_y * dy,
                  acc_z * dz, ACCUM_DQ)


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
                            dq_stride, N, F, col0, off_xy, off_xz, off_yz, RX, RY, RZ,
                            T: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr,
                            RUN: tl.constexpr, BLOCK_C: tl.constexpr, NEED_DQ: tl.constexpr,
                            ACCUM_DQ: tl.constexpr):
    """Backward with texel-run accumulation (MERGE=3).

    A program owns ROWS rows of RUN consecutive points and one rotation t (grid axis 1); for each
    channel chunk it walks its rows' points in order. Each plane keeps, per row, the running
    gradient sums of the 4 corner texels of the current cell; moving to a neighbouring cell carries
    the shared corners' sums on and flushes only the others, so the samples of one ray (neighbours
    in memory) issue one atomic per texel they touch instead of one per point and corner. dL/dq is
    summed over the chunks in registers ([ROWS, RUN] per axis) and written once per scale.
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
    dqx = tl.zeros([ROWS, RUN], dtype=tl.float32)
    dqy = tl.zeros([ROWS, RUN], dtype=tl.float32)
    dqz = tl.zeros([ROWS, RUN], dtype=tl.float32)
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
            q0, q1, q2 = _rotate(pts_ptr, mat_ptr, n, nmask, t)
            ix, fx, dx = _axis(q0, (RX - 1).to(tl.float32))
            iy, fy, dy = _axis(q1, (RY - 1).to(tl.float32))
            iz, fz, dz = _axis(q2, (RZ - 1).to(tl.float32))
            m2 = nmask[:, None] & cmask[None, :]
            g = tl.load(grad_ptr + n[:, None] * F + col0 + t * C + c[None, :], mask=m2,
                        other=0.0).to(tl.float32)
            g_xy, g_xz, g_yz, sx, sy, sz = _chunk_grads(
                g, planes_ptr + off_t_xy, planes_ptr + off_t_xz, planes_ptr + off_t_yz,
                (iy * RX + ix) * C, (iz * RX + ix) * C, (iz * RY + iy) * C, RX, RY, C, c, m2,
                fx, fy, fz, NEED_DQ)
            if NEED_DQ:
                col = (kk == k)[None, :]
                dqx = tl.where(col, dqx + (sx * dx)[:, None], dqx)
                dqy = tl.where(col, dqy + (sy * dy)[:, None], dqy)
                dqz = tl.where(col, dqz + (sz * dz)[:, None], dqz)
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
    if NEED_DQ:
        n2 = row0[:, None] + kk[None, :]
        _store_dq(dq_ptr, dq_stride, n2, n2 < N, t, N, dqx, dqy, dqz, ACCUM_DQ)


# ------------------------------------------------------------------------------------ launchers
def _block_c(C: int) -> int:
    if C % 16 == 0:
        return 16
    return min(32, triton.next_power_of_2(C))


def _scales(n_rot: int, channels: int, resolutions: list[int]):
    """Yield (l, rx, ry, rz, off_xy, off_xz, off_yz) for the flat layout (same as PlaneLayout)."""
    pos = 0
    res = [tuple(resolutions[3 * i: 3 * i + 3]) for i in range(len(resolutions) // 3)]
    for l, (rx, ry, rz) in enumerate(res):
        offs = []
        for h, w in ((ry, rx), (rz, rx), (rz, ry)):
            offs.append(pos)
            pos += n_rot * h * w * channels
        yield l, rx, ry, rz, offs[0], offs[1], offs[2]


BLOCK_N_FWD = 32
BLOCK_N_BWD = 32
MERGE_DEFAULT = 3  # 0: one atomic per point and corner, 1: segmented scan, 2: pair merge,
# 3: texel runs (kplanes_bwd_runs_kernel)
RUN_ROWS = 8  # merge 3: rows per program
RUN_LEN = 16  # merge 3: consecutive points per row
RUN_WARPS = 1  # merge 3: warps per program
RUN_MAXNREG = 168  # merge 3: register cap per thread (None: the compiler's choice)
# A texel-run program walks its points one after another; with few programs (the embedded
# default: 49 k points, T = 2 -> 768 one-warp programs on 132 SMs) that serial walk is exposed.
# Below this many programs per SM the default backward is the pair-merge kernel instead.
RUN_MIN_PROGRAMS_PER_SM = 16
RUN_SMALL_FALLBACK = 2
SKIP_ZERO_DEFAULT = True  # no atomics for exact-zero corner weights (clamped coordinates)
# (defaults set by measurements: docs/kernels.md)


def _maxnreg(value):
    value = RUN_MAXNREG if value is None else value
    return {"maxnreg": int(value)} if value else {}


def kplanes_forward(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor,
                    n_rot: int, channels: int, resolutions: list[int], out_bf16: bool,
                    block_n: int | None = None) -> torch.Tensor:
    points, matrices, plane_data = points.contiguous(), matrices.contiguous(), plane_data.contiguous()
    N = points.shape[0]
    L = len(resolutions) // 3
    F = L * n_rot * channels
    out = torch.empty((N, F), device=points.device,
                      dtype=torch.bfloat16 if out_bf16 else torch.float32)
    if N == 0:
        return out
    bn = block_n or BLOCK_N_FWD
    grid = (triton.cdiv(N, bn), n_rot)
    for l, rx, ry, rz, oxy, oxz, oyz in _scales(n_rot, channels, resolutions):
        kplanes_fwd_kernel[grid](points, matrices, plane_data, out, N, F, l * n_rot * channels,
                                 oxy, oxz, oyz, rx, ry, rz, T=n_rot, C=channels, BLOCK_N=bn,
                                 BLOCK_C=_block_c(channels), OUT_BF16=out_bf16, num_warps=4)
    return out


def default_merge(n_points: int, n_rot: int, device: torch.device, rows: int | None = None,
                  run: int | None = None) -> int:
    """MERGE_DEFAULT, or RUN_SMALL_FALLBACK when the texel-run kernel would launch fewer than
    RUN_MIN_PROGRAMS_PER_SM programs per SM of a CUDA device."""
    merge = MERGE_DEFAULT
    if merge == 3 and device.type == "cuda" and RUN_MIN_PROGRAMS_PER_SM:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = triton.cdiv(n_points, (rows or RUN_ROWS) * (run or RUN_LEN)) * n_rot
        if programs < RUN_MIN_PROGRAMS_PER_SM * sms:
            merge = RUN_SMALL_FALLBACK
    return merge


def kplanes_backward(grad: torch.Tensor, points: torch.Tensor, matrices: torch.Tensor,
                     plane_data: torch.Tensor, n_rot: int, channels: int, resolutions: list[int],
                     need_dq: bool, merge: int | None = None, block_n: int | None = None,
                     skip_zero: bool | None = None, run: int | None = None,
                     warps: int | None = None, maxnreg: int | None = None):
    """Plane gradients and dL/dq, laid out (3, T, N) (N = 0 unless need_dq).

    merge 0/1/2 run ``kplanes_bwd_kernel`` (block_n points per program); merge 3 runs
    ``kplanes_bwd_runs_kernel`` (block_n rows of ``run`` consecutive points per program). With
    merge=None the default applies, except that a problem too small to give the texel-run kernel
    RUN_MIN_PROGRAMS_PER_SM programs per SM takes RUN_SMALL_FALLBACK instead.
    """
    points, matrices, plane_data = points.contiguous(), matrices.contiguous(), plane_data.contiguous()
    N = points.shape[0]
    L = len(resolutions) // 3
    F = L * n_rot * channels
    merge = default_merge(N, n_rot, points.device, block_n, run) if merge is None else int(merge)
    bc = _block_c(channels)
    gplanes = torch.zeros_like(plane_data)
    dq = torch.empty((3, n_rot, N if need_dq else 0), device=points.device, dtype=torch.float32)
    if N == 0:
        return gplanes, dq
    grad = grad.contiguous()  # autograd may hand an expanded (stride-0) gradient
    for l, rx, ry, rz, oxy, oxz, oyz in _scales(n_rot, channels, resolutions):
        common = (grad, points, matrices, plane_data, gplanes, dq, n_rot * N, N, F,
                  l * n_rot * channels, oxy, oxz, oyz, rx, ry, rz)
        if merge == 3:
            rows, run = block_n or RUN_ROWS, run or RUN_LEN
            if rows & (rows - 1) or run & (run - 1):
                raise ValueError(f"texel-run backward needs power-of-two rows and run, got {rows}, {run}")
            kplanes_bwd_runs_kernel[(triton.cdiv(N, rows * run), n_rot)](
                *common, T=n_rot, C=channels, ROWS=rows, RUN=run, BLOCK_C=bc, NEED_DQ=need_dq,
                ACCUM_DQ=l > 0, num_warps=warps or RUN_WARPS, **_maxnreg(maxnreg))
        else:
            bn = block_n or BLOCK_N_BWD
            skip = SKIP_ZERO_DEFAULT if skip_zero is None else bool(skip_zero)
            kplanes_bwd_kernel[(triton.cdiv(N, bn), n_rot)](
                *common, T=n_rot, C=channels, BLOCK_N=bn, BLOCK_C=bc, NEED_DQ=need_dq,
                ACCUM_DQ=l > 0, MERGE=merge, SKIP_ZERO=skip, num_warps=4)
    return gplanes, dq
