"""Triton kernels of the two total-variation regularizers (forward partial sums + analytic backward).

plane_tv: all planes of all scales and rotations in ONE launch. The flat buffer is cut into groups
(one per scale and plane kind: the T planes of a group share (H, W)); every program owns BLOCK
elements of one group, found from a small per-layout table (built once per layout and device, so
build it before a CUDA-graph capture: the first call does). Forward writes one partial sum per
program (summed by torch: deterministic); backward writes the whole gradient in one launch.

volume_tv: (..., D, H, W) contiguous volume, squared or L1 forward differences along 3 axes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasttomo.kernels.layout import PlaneLayout
from fasttomo.kernels.triton.launch import launch, sum_parts

PLANE_TV_BLOCK = 2048
VOLUME_TV_BLOCK = 2048


@triton.jit
def _group_of(pid, blk_ptr, G: tl.constexpr):
    grp = pid * 0
    for g in tl.static_range(1, G):
        grp += (pid >= tl.load(blk_ptr + g)).to(tl.int32)
    return grp


@triton.jit
def _group_block(pid, blk_ptr, itab_ptr, ftab_ptr, G: tl.constexpr, BLOCK: tl.constexpr):
    """Program pid's plane group from the tables: (flat offset, W*C, H*W*C, TV weights along h and
    w, element indices of this block within the group, their mask)."""
    grp = _group_of(pid, blk_ptr, G)
    b0 = tl.load(blk_ptr + grp)
    off = tl.load(itab_ptr + grp * 4 + 0)
    # a group's sizes fit 32 bits (the door takes buffers below 2**31 elements; the element indices
    # are int32); in 64 bits each `%` below is a call to a software division (16 a thread)
    WC = tl.load(itab_ptr + grp * 4 + 1).to(tl.int32)
    HWC = tl.load(itab_ptr + grp * 4 + 2).to(tl.int32)
    numel = tl.load(itab_ptr + grp * 4 + 3).to(tl.int32)
    wh = tl.load(ftab_ptr + grp * 2 + 0)
    ww = tl.load(ftab_ptr + grp * 2 + 1)
    e = (pid - b0) * BLOCK + tl.arange(0, BLOCK)
    return off, WC, HWC, wh, ww, e, e < numel


@triton.jit
def plane_tv_fwd_kernel(x_ptr, part_ptr, blk_ptr, itab_ptr, ftab_ptr, C, G: tl.constexpr,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    off, WC, HWC, wh, ww, e, mask = _group_block(pid, blk_ptr, itab_ptr, ftab_ptr, G, BLOCK)
    within = e % HWC
    wc = within % WC
    mh = mask & (within + WC < HWC)
    mw = mask & (wc + C < WC)
    base = x_ptr + off
    x0 = tl.load(base + e, mask=mask, other=0.0)
    xh = tl.load(base + e + WC, mask=mh, other=0.0)
    xw = tl.load(base + e + C, mask=mw, other=0.0)
    dh = tl.where(mh, xh - x0, 0.0)
    dw = tl.where(mw, xw - x0, 0.0)
    s = wh * tl.sum(dh * dh, axis=0) + ww * tl.sum(dw * dw, axis=0)
    tl.store(part_ptr + pid, s)


@triton.jit
def plane_tv_bwd_kernel(x_ptr, go_ptr, gx_ptr, blk_ptr, itab_ptr, ftab_ptr, C, G: tl.constexpr,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    off, WC, HWC, wh, ww, e, mask = _group_block(pid, blk_ptr, itab_ptr, ftab_ptr, G, BLOCK)
    go = tl.load(go_ptr).to(tl.float32)
    within = e % HWC
    wc = within % WC
    m_dn = mask & (within + WC < HWC)
    m_up = mask & (within >= WC)
    m_rt = mask & (wc + C < WC)
    m_lf = mask & (wc >= C)
    base = x_ptr + off
    x0 = tl.load(base + e, mask=mask, other=0.0)
    x_dn = tl.load(base + e + WC, mask=m_dn, other=0.0)
    x_up = tl.load(base + e - WC, mask=m_up, other=0.0)
    x_rt = tl.load(base + e + C, mask=m_rt, other=0.0)
    x_lf = tl.load(base + e - C, mask=m_lf, other=0.0)
    gh = tl.where(m_dn, x0 - x_dn, 0.0) + tl.where(m_up, x0 - x_up, 0.0)
    gw = tl.where(m_rt, x0 - x_rt, 0.0) + tl.where(m_lf, x0 - x_lf, 0.0)
    g = go * (2.0 * wh * gh + 2.0 * ww * gw)
    tl.store(gx_ptr + off + e, g, mask=mask)


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


def _plane_tables(layout: PlaneLayout, device: torch.device):
    """Per (scale, plane kind) group, in buffer order (``PlaneLayout.groups``): the first program
    of each group (blk), (offset, W*C, H*W*C, numel) (itab) and the TV weights along H and W
    (ftab). Built once per layout and device."""
    key = (layout, str(device))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    C = layout.channels
    count = 3 * layout.n_scales * layout.n_rot
    blk, itab, ftab, nb = [0], [], [], 0
    for off, h, w, numel in layout.groups():
        itab += [off, w * C, h * w * C, numel]
        ftab += [1.0 / ((h - 1) * w * C) / count, 1.0 / (h * (w - 1) * C) / count]
        nb += triton.cdiv(numel, PLANE_TV_BLOCK)
        blk.append(nb)
    hit = (torch.tensor(blk, dtype=torch.int32, device=device),
           torch.tensor(itab, dtype=torch.int64, device=device),
           torch.tensor(ftab, dtype=torch.float32, device=device), nb, 3 * layout.n_scales)
    _TABLES[key] = hit
    return hit


def plane_tv_forward(plane_data: torch.Tensor, layout: PlaneLayout) -> torch.Tensor:
    blk, itab, ftab, nb, G = _plane_tables(layout, plane_data.device)
    part = torch.empty(nb, device=plane_data.device, dtype=torch.float32)
    launch(plane_tv_fwd_kernel, (nb,), plane_data, part, blk, itab, ftab, layout.channels, G=G,
           BLOCK=PLANE_TV_BLOCK, num_warps=8)
    return sum_parts(part)


def plane_tv_backward(grad: torch.Tensor, plane_data: torch.Tensor,
                      layout: PlaneLayout) -> torch.Tensor:
    blk, itab, ftab, nb, G = _plane_tables(layout, plane_data.device)
    gx = torch.empty(plane_data.shape, device=plane_data.device, dtype=plane_data.dtype)  # see sum_parts
    launch(plane_tv_bwd_kernel, (nb,), plane_data, grad.contiguous(), gx, blk, itab, ftab, layout.channels,
           G=G, BLOCK=PLANE_TV_BLOCK, num_warps=8)
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
