"""Triton kernels of the two total-variation regularizers (forward partial sums + analytic backward).

plane_tv: all planes of all scales and rotations in ONE launch. The flat buffer is cut into groups
(one per scale and plane kind: the T planes of a group share (H, W)); every program owns a strip
of one plane (rows of elements of a row of W*C, one shape a kernel: PLANE_TV_FWD_STRIP,
PLANE_TV_BWD_STRIP), found from a small per-layout table (built once per layout, device and strip,
so build it before a CUDA-graph capture: the first call does), and walks its rows keeping the row
above and below in registers, so each element is read from memory about once and the neighbours
along w come from the same lines.
Forward writes one partial sum per program (summed by torch: deterministic); backward writes the
whole gradient in one launch.

volume_tv: (..., D, H, W) contiguous volume, squared or L1 forward differences along 3 axes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasttomo.kernels.layout import PlaneLayout
from fasttomo.kernels.triton.launch import launch, sum_parts

PLANE_TV_FWD_STRIP = (16, 256)
"""Plane TV forward: a program's strip, (rows, elements of a row of W*C)."""
PLANE_TV_BWD_STRIP = (8, 512)
"""Plane TV backward: a program's strip (the fastest of ``scripts/bench_plane_tv.py --shapes`` for
each kernel at the camera2k and flagship layouts, benchmarks/README.md)."""
VOLUME_TV_BLOCK = 2048


@triton.jit
def _group_of(pid, blk_ptr, G: tl.constexpr):
    grp = pid * 0
    for g in tl.static_range(1, G):
        grp += (pid >= tl.load(blk_ptr + g)).to(tl.int32)
    return grp


@triton.jit
def _strip(pid, blk_ptr, itab_ptr, ftab_ptr, G: tl.constexpr, ROWS: tl.constexpr, BW: tl.constexpr):
    """Program pid's strip from the tables: ROWS rows (from h0) of BW elements (columns wc of a
    row of W*C elements) of one plane of one group, whose first element is at ``base``. Returns
    (base offset, W*C, H, h0, wc, TV weights along h and w). Scalar index arithmetic only: a
    group's sizes fit 32 bits (the door takes buffers below 2**31 elements)."""
    grp = _group_of(pid, blk_ptr, G)
    local = pid - tl.load(blk_ptr + grp)
    off = tl.load(itab_ptr + grp * 4 + 0)
    WC = tl.load(itab_ptr + grp * 4 + 1).to(tl.int32)
    H = tl.load(itab_ptr + grp * 4 + 2).to(tl.int32)
    n_cb = tl.load(itab_ptr + grp * 4 + 3).to(tl.int32)
    n_rb = (H + ROWS - 1) // ROWS
    cb = local % n_cb
    rest = local // n_cb
    h0 = (rest % n_rb) * ROWS
    plane = rest // n_rb
    base = off + plane.to(tl.int64) * H * WC
    wc = cb * BW + tl.arange(0, BW)
    return base, WC, H, h0, wc, tl.load(ftab_ptr + grp * 2 + 0), tl.load(ftab_ptr + grp * 2 + 1)


@triton.jit
def plane_tv_fwd_kernel(x_ptr, part_ptr, blk_ptr, itab_ptr, ftab_ptr, C, G: tl.constexpr,
                        ROWS: tl.constexpr, BW: tl.constexpr):
    """One partial sum per program: its strip's squared differences along w (to the right) and
    along h (downwards), walking the rows and keeping each one for the next row's difference."""
    pid = tl.program_id(0)
    base, WC, H, h0, wc, wh, ww = _strip(pid, blk_ptr, itab_ptr, ftab_ptr, G, ROWS, BW)
    row = x_ptr + base + wc
    mc = wc < WC
    mw = wc + C < WC
    x0 = tl.load(row + h0 * WC, mask=mc, other=0.0)
    acc = tl.zeros([BW], dtype=tl.float32)
    for i in range(ROWS):
        h = h0 + i
        hv = h + 0 * wc  # as a tensor: masks of tensors only
        mh = mc & (hv + 1 < H)
        m_w = mw & (hv < H)
        xw = tl.load(row + h * WC + C, mask=m_w, other=0.0)
        xh = tl.load(row + (h + 1) * WC, mask=mh, other=0.0)
        dh = tl.where(mh, xh - x0, 0.0)
        dw = tl.where(m_w, xw - x0, 0.0)
        acc += wh * (dh * dh) + ww * (dw * dw)
        x0 = xh
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def plane_tv_bwd_kernel(x_ptr, go_ptr, gx_ptr, blk_ptr, itab_ptr, ftab_ptr, C, G: tl.constexpr,
                        ROWS: tl.constexpr, BW: tl.constexpr):
    """The gradient of a strip, walking its rows with the rows above and below in registers."""
    pid = tl.program_id(0)
    base, WC, H, h0, wc, wh, ww = _strip(pid, blk_ptr, itab_ptr, ftab_ptr, G, ROWS, BW)
    go = tl.load(go_ptr).to(tl.float32)
    row = x_ptr + base + wc
    out = gx_ptr + base + wc
    mc = wc < WC
    m_rt = wc + C < WC
    m_lf = mc & (wc >= C)
    x_up = tl.load(row + (h0 - 1) * WC, mask=mc & (h0 + 0 * wc >= 1), other=0.0)
    x0 = tl.load(row + h0 * WC, mask=mc, other=0.0)
    for i in range(ROWS):
        h = h0 + i
        hv = h + 0 * wc  # as a tensor: masks of tensors only
        inside = hv < H
        m_dn = mc & (hv + 1 < H)
        m_up = mc & (hv >= 1) & inside
        m_r = m_rt & inside
        m_l = m_lf & inside
        x_dn = tl.load(row + (h + 1) * WC, mask=m_dn, other=0.0)
        x_rt = tl.load(row + h * WC + C, mask=m_r, other=0.0)
        x_lf = tl.load(row + h * WC - C, mask=m_l, other=0.0)
        gh = tl.where(m_dn, x0 - x_dn, 0.0) + tl.where(m_up, x0 - x_up, 0.0)
        gw = tl.where(m_r, x0 - x_rt, 0.0) + tl.where(m_l, x0 - x_lf, 0.0)
        g = go * (2.0 * wh * gh + 2.0 * ww * gw)
        tl.store(out + h * WC, g, mask=mc & inside)
        x_up = x0
        x0 = x_dn


@triton.jit
def volume_tv_fwd_kernel(x_ptr, part_ptr, E, D, H, W, wd, wh, ww, L1: tl.constexpr,
                         BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    w = e % W
    h = (e // W) % H
    d = (e // (W * H)) % D
    md = mask & (d < D - 1)
    mh = mask & (h < H - 1)
    mw = mask & (w < W - 1)
    x0 = tl.load(x_ptr + e, mask=mask, other=0.0)
    xd = tl.load(x_ptr + e + W * H, mask=md, other=0.0)
    xh = tl.load(x_ptr + e + W, mask=mh, other=0.0)
    xw = tl.load(x_ptr + e + 1, mask=mw, other=0.0)
    dd = tl.where(md, xd - x0, 0.0)
    dh = tl.where(mh, xh - x0, 0.0)
    dw = tl.where(mw, xw - x0, 0.0)
    if L1:
        s = wd * tl.sum(tl.abs(dd), axis=0) + wh * tl.sum(tl.abs(dh), axis=0) \
            + ww * tl.sum(tl.abs(dw), axis=0)
    else:
        s = wd * tl.sum(dd * dd, axis=0) + wh * tl.sum(dh * dh, axis=0) \
            + ww * tl.sum(dw * dw, axis=0)
    tl.store(part_ptr + pid, s)


@triton.jit
def _dphi(d, L1: tl.constexpr):
    if L1:
        return tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    else:
        return 2.0 * d


@triton.jit
def volume_tv_bwd_kernel(x_ptr, go_ptr, gx_ptr, E, D, H, W, wd, wh, ww, L1: tl.constexpr,
                         BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    mask = e < E
    go = tl.load(go_ptr).to(tl.float32)
    w = e % W
    h = (e // W) % H
    d = (e // (W * H)) % D
    x0 = tl.load(x_ptr + e, mask=mask, other=0.0)
    g = tl.zeros_like(x0)
    # forward difference x[i+1]-x[i] contributes -phi' to x[i] and +phi' to x[i+1]
    m = mask & (d < D - 1)
    g -= wd * tl.where(m, _dphi(tl.load(x_ptr + e + W * H, mask=m, other=0.0) - x0, L1), 0.0)
    m = mask & (d > 0)
    g += wd * tl.where(m, _dphi(x0 - tl.load(x_ptr + e - W * H, mask=m, other=0.0), L1), 0.0)
    m = mask & (h < H - 1)
    g -= wh * tl.where(m, _dphi(tl.load(x_ptr + e + W, mask=m, other=0.0) - x0, L1), 0.0)
    m = mask & (h > 0)
    g += wh * tl.where(m, _dphi(x0 - tl.load(x_ptr + e - W, mask=m, other=0.0), L1), 0.0)
    m = mask & (w < W - 1)
    g -= ww * tl.where(m, _dphi(tl.load(x_ptr + e + 1, mask=m, other=0.0) - x0, L1), 0.0)
    m = mask & (w > 0)
    g += ww * tl.where(m, _dphi(x0 - tl.load(x_ptr + e - 1, mask=m, other=0.0), L1), 0.0)
    tl.store(gx_ptr + e, go * g, mask=mask)


# ------------------------------------------------------------------------------------ launchers
_TABLES: dict = {}


def _plane_tables(layout: PlaneLayout, device: torch.device, strip: tuple[int, int]):
    """Per (scale, plane kind) group, in buffer order (``PlaneLayout.groups``): the first program
    of each group (blk: T planes x row blocks x column blocks of strips), (offset, W*C, H,
    column blocks) (itab) and the TV weights along H and W (ftab), for strips of ``strip`` = (rows,
    elements a row). Built once per layout, device and strip."""
    rows, bw = strip
    key = (layout, str(device), strip)
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    C = layout.channels
    count = 3 * layout.n_scales * layout.n_rot
    blk, itab, ftab, nb = [0], [], [], 0
    for off, h, w, numel in layout.groups():
        n_cb = triton.cdiv(w * C, bw)
        itab += [off, w * C, h, n_cb]
        ftab += [1.0 / ((h - 1) * w * C) / count, 1.0 / (h * (w - 1) * C) / count]
        nb += (numel // (h * w * C)) * triton.cdiv(h, rows) * n_cb
        blk.append(nb)
    hit = (torch.tensor(blk, dtype=torch.int32, device=device),
           torch.tensor(itab, dtype=torch.int64, device=device),
           torch.tensor(ftab, dtype=torch.float32, device=device), nb, 3 * layout.n_scales)
    _TABLES[key] = hit
    return hit


def plane_tv_forward(plane_data: torch.Tensor, layout: PlaneLayout,
                     strip: tuple[int, int] = PLANE_TV_FWD_STRIP) -> torch.Tensor:
    """The plane TV's value; ``strip`` (rows, elements a row): a program's strip (the bench's
    shapes)."""
    blk, itab, ftab, nb, G = _plane_tables(layout, plane_data.device, strip)
    part = torch.empty(nb, device=plane_data.device, dtype=torch.float32)
    launch(plane_tv_fwd_kernel, (nb,), plane_data, part, blk, itab, ftab, layout.channels, G=G,
           ROWS=strip[0], BW=strip[1], num_warps=4)
    return sum_parts(part)


def plane_tv_backward(grad: torch.Tensor, plane_data: torch.Tensor, layout: PlaneLayout,
                      strip: tuple[int, int] = PLANE_TV_BWD_STRIP) -> torch.Tensor:
    """The plane TV's gradient for the output gradient ``grad``; ``strip`` as in
    :func:`plane_tv_forward`."""
    blk, itab, ftab, nb, G = _plane_tables(layout, plane_data.device, strip)
    gx = torch.empty(plane_data.shape, device=plane_data.device, dtype=plane_data.dtype)  # see sum_parts
    launch(plane_tv_bwd_kernel, (nb,), plane_data, grad.contiguous(), gx, blk, itab, ftab, layout.channels,
           G=G, ROWS=strip[0], BW=strip[1], num_warps=4)
    return gx


def _vol_weights(volume: torch.Tensor):
    D, H, W = volume.shape[-3:]
    B = volume.numel() // (D * H * W)
    return D, H, W, 1.0 / (B * (D - 1) * H * W), 1.0 / (B * D * (H - 1) * W), 1.0 / (B * D * H * (W - 1))


def volume_tv_forward(volume: torch.Tensor, l1: bool) -> torch.Tensor:
    D, H, W, wd, wh, ww = _vol_weights(volume)
    E = volume.numel()
    nb = triton.cdiv(E, VOLUME_TV_BLOCK)
    part = torch.empty(nb, device=volume.device, dtype=torch.float32)
    launch(volume_tv_fwd_kernel, (nb,), volume, part, E, D, H, W, wd, wh, ww, L1=l1,
           BLOCK=VOLUME_TV_BLOCK, num_warps=8)
    return sum_parts(part)


def volume_tv_backward(grad: torch.Tensor, volume: torch.Tensor, l1: bool) -> torch.Tensor:
    D, H, W, wd, wh, ww = _vol_weights(volume)
    E = volume.numel()
    nb = triton.cdiv(E, VOLUME_TV_BLOCK)
    gx = torch.empty(volume.shape, device=volume.device, dtype=volume.dtype)  # see sum_parts
    launch(volume_tv_bwd_kernel, (nb,), volume, grad.contiguous(), gx, E, D, H, W, wd, wh, ww, L1=l1,
           BLOCK=VOLUME_TV_BLOCK, num_warps=8)
    return gx
