"""CPU fast paths of ``tilted_kplanes`` and ``plane_tv``: the twins' results with hand-written
backwards (plane TV: see ``PlaneTVCPU`` at the end).

The pure-torch twin (``reference.tilted_kplanes``) builds a large autograd graph per scale and
plane kind (select, stack, grid_sample, product, permute/reshape, cat) whose backward makes many
full-size passes, most of them zero fills and copies. Here the forward runs without a graph and the
backward is written out:

- forward: q = M_t p by the twin's einsum; ONE grid (3T, N, 1, 2) holds the (column, row)
  coordinates of the 3 plane kinds (kind-major, as the buffer stores them) and serves every
  scale. Per scale, the kinds that share (H, W) (``PlaneLayout.kind_runs``: all three for a cubic
  resolution) are back to back in ``plane_data``, so one ``grid_sampler_2d`` call samples them as
  one batch of channels-last planes (a view, no copy). The Hadamard product (s0 * s1) * s2 is
  taken in the twin's order (fp32 features equal the twin's bit for bit) and copied, transposed,
  into the output (N, L, T, C).
- saved: the inputs, the grid and per scale the products of the other two kinds (s1 s2, s0 s2,
  s0 s1), made while the samples are hot in cache (the twin's graph keeps more).
- backward: one pass of the product rule per scale (dL/ds_k = g * others[k]) into a (3, T, C, N)
  buffer, then ``aten.grid_sampler_2d_backward`` with output_mask = (planes need grad, points or
  matrices need grad); plane gradients are copied into a flat buffer laid out like
  ``plane_data`` (every element written once: no zero fill); grid gradients are summed over the
  scales and contracted with the matrices / points into dL/dpoints and dL/dmatrices.
- create_graph: a backward under grad mode computes the gradient through the twin with a graph
  (counted 'torch' under ``tilted_kplanes_bwd``), so higher-order autograd is the twin's.
- without a gradient to take (grad mode off, or no input requiring grad) the forward alone runs,
  keeping nothing.

Native kernels: where the C kernels of ``kernels/cpu_native.py`` can be built (a C compiler on the
machine; compiled once and cached), forward and backward run there instead (one pass over the
points per frame and scale, no grid, products or transposing copies; nothing saved but the
inputs); ``native=False`` keeps the aten path described above (the tests pin it where they check
aten's calls or the twin's bits).

Computes in the input dtype (float32, float64). The door (``dispatch.tilted_kplanes``) sends CPU
float32/float64 inputs here under ``kernels.backend=auto`` and counts path 'cpu'. Measurements and
what did not help: docs/kernels.md, "CPU path (tilted_kplanes)".
"""

from __future__ import annotations

import torch

from fasttomo.kernels import counters as _spy
from fasttomo.kernels import cpu_native, reference
from fasttomo.kernels.layout import PLANE_AXES, PlaneLayout

_BILINEAR, _BORDER = 0, 1  # grid_sampler's interpolation_mode / padding_mode codes
_ALIGN_CORNERS = True
_AXES = [a for ab in PLANE_AXES for a in ab]  # q columns of the 3 kinds: (x, y), (x, z), (y, z)


def _grid(q: torch.Tensor) -> torch.Tensor:
    """(T, N, 3) rotated points -> (3T, N, 1, 2) sample coordinates, kind-major like the buffer
    (three slice copies: a gather q[..., [0, 1, 0, 2, 1, 2]] took 4x as long); non-finite ones as
    the twin sets them (grid_sampler_2d_backward crashes on NaN and inf)."""
    T, N, _ = q.shape
    grid = q.new_empty((3, T, N, 2))
    grid[0].copy_(q[..., 0:2])   # xy: (x, y)
    grid[1].copy_(q[..., 0::2])  # xz: (x, z)
    grid[2].copy_(q[..., 1:3])   # yz: (y, z)
    return torch.nan_to_num_(grid, nan=-1.0, posinf=1.0, neginf=-1.0).view(3 * T, N, 1, 2)


def _planes(plane_data: torch.Tensor, layout: PlaneLayout, l: int, k0: int, k1: int) -> torch.Tensor:
    """((k1-k0)*T, C, H, W) channels-last view of a run of plane kinds (no copy)."""
    return layout.view_kinds(plane_data, l, k0, k1).permute(0, 3, 1, 2)


def _forward(points, matrices, plane_data, layout: PlaneLayout, keep: bool):
    """Features (N, L*T*C); with ``keep``, also what the backward needs: the grid and per scale
    the products of the other two kinds' samples (3, T, C, N)."""
    T, C, L = layout.n_rot, layout.channels, layout.n_scales
    n = points.shape[0]
    q = torch.einsum("tij,nj->tni", matrices, points)  # the twin's q, bit for bit
    grid = _grid(q)
    prods = points.new_empty((L, T, C, n))
    others_per_scale = []
    for l in range(L):
        parts = [torch.ops.aten.grid_sampler_2d(_planes(plane_data, layout, l, k0, k1),
                                                grid[k0 * T:k1 * T], _BILINEAR, _BORDER, _ALIGN_CORNERS)
                 for k0, k1, _, _ in layout.kind_runs(l)]  # each ((k1-k0)*T, C, N, 1)
        s = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(3, T, C, n)
        if not keep:
            torch.mul(s[0], s[1], out=prods[l]).mul_(s[2])  # (s0 * s1) * s2, the twin's order
            continue
        # the products of the other two kinds, made while s is hot in cache, so that the backward
        # makes one pass: dL/ds_k = g * others[k]
        others = torch.empty_like(s)
        torch.mul(s[0], s[1], out=others[2])
        torch.mul(others[2], s[2], out=prods[l])  # (s0 * s1) * s2, the twin's order
        torch.mul(s[1], s[2], out=others[0])
        torch.mul(s[0], s[2], out=others[1])
        others_per_scale.append(others)
    # one transposing copy per scale into (N, L, T, C); the product written straight into that
    # strided output was slower than the contiguous product plus this copy
    out = points.new_empty((n, L, T, C))
    for l in range(L):
        out[:, l].permute(1, 2, 0).copy_(prods[l])
    return out.view(n, L * T * C), grid, others_per_scale


class TiltedKPlanesCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, points, matrices, plane_data, layout: PlaneLayout, lib=None):
        ctx.layout, ctx.lib = layout, lib
        if lib is not None:  # native kernels: the backward recomputes what it needs from the inputs
            ctx.save_for_backward(points, matrices, plane_data)
            return cpu_native.forward(lib, points, matrices, plane_data, layout)
        out, grid, others = _forward(points, matrices, plane_data, layout, keep=True)
        ctx.save_for_backward(points, matrices, plane_data, grid, *others)
        return out

    @staticmethod
    def backward(ctx, grad):
        points, matrices, plane_data, *kept = ctx.saved_tensors
        layout: PlaneLayout = ctx.layout
        need_p, need_m, need_x = ctx.needs_input_grad[:3]
        if torch.is_grad_enabled():
            # create_graph backward: exact higher-order autograd through the twin
            _spy.count("tilted_kplanes_bwd", "torch")
            wrt = [(i, t) for i, (t, need) in enumerate(((points, need_p), (matrices, need_m),
                                                         (plane_data, need_x))) if need]
            out = reference.tilted_kplanes(points, matrices, plane_data, layout)
            got = torch.autograd.grad(out, [t for _, t in wrt], grad.to(out.dtype), create_graph=True,
                                      allow_unused=True)
            res = [None, None, None]
            for (i, t), g in zip(wrt, got):
                res[i] = torch.zeros_like(t) if g is None else g
            return res[0], res[1], res[2], None, None
        _spy.count("tilted_kplanes_bwd", "cpu")
        if ctx.lib is not None:
            return (*cpu_native.backward(ctx.lib, points, matrices, plane_data, layout, grad,
                                         need_p, need_m, need_x), None, None)
        grid, *others = kept
        T, C, L = layout.n_rot, layout.channels, layout.n_scales
        n = points.shape[0]
        need_grid = bool(need_p or need_m)
        # (L, T, C, N) contiguous: one transposing copy (products against a strided view of the
        # gradient were 10x slower than contiguous ones)
        g = grad.to(points.dtype).reshape(n, L, T, C).permute(1, 2, 3, 0).contiguous()
        gplanes = torch.empty_like(plane_data) if need_x else None
        dgrid = None
        gs = points.new_empty((3, T, C, n))  # sample gradients of one scale (reused)
        for l in range(L):
            torch.mul(others[l], g[l], out=gs)  # product rule: dL/ds_k = g * (product of the others)
            for k0, k1, _, _ in layout.kind_runs(l):
                gi, gg = torch.ops.aten.grid_sampler_2d_backward(
                    gs[k0:k1].view((k1 - k0) * T, C, n, 1), _planes(plane_data, layout, l, k0, k1),
                    grid[k0 * T:k1 * T], _BILINEAR, _BORDER, _ALIGN_CORNERS, [bool(need_x), need_grid])
                if need_x:
                    _planes(gplanes, layout, l, k0, k1).copy_(gi)
                if not need_grid:
                    continue
                if dgrid is None and k1 - k0 == 3:
                    dgrid = gg  # all kinds: a fresh tensor, later scales add into it
                    continue
                if dgrid is None:
                    dgrid = torch.zeros_like(grid)
                dgrid[k0 * T:k1 * T] += gg
        gp = gm = None
        if need_grid:
            dg = dgrid.view(3, T, n, 2)
            m6 = matrices[:, _AXES, :].view(T, 3, 2, 3).transpose(0, 1)  # (3, T, 2, 3): rows of q per kind
            if need_p:
                gp = torch.einsum("ktni,ktij->nj", dg, m6)
            if need_m:  # (3T, 2, N) @ (N, 3): a transposed operand, no copy
                gm6 = torch.matmul(dgrid.view(3 * T, n, 2).transpose(1, 2), points).view(3, T, 2, 3)
                gm = matrices.new_zeros((T, 3, 3)).index_add_(1, torch.tensor(_AXES),
                                                              gm6.transpose(0, 1).reshape(T, 6, 3))
        return gp, gm, gplanes, None, None


def tilted_kplanes(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor,
                   layout: PlaneLayout, native: bool | None = None) -> torch.Tensor:
    """The twin's ``tilted_kplanes`` on CPU float32/float64 tensors (same dtype, points (N, 3),
    matrices (T, 3, 3), plane_data the contiguous 1-D buffer of ``layout``); no autocast.
    ``native``: None uses the C kernels where they can be built, False the aten path, True
    requires the C kernels (RuntimeError where they cannot be built)."""
    lib = None
    if native is not False:
        lib = cpu_native.library(points.dtype, layout.channels)
        if lib is None and native:
            raise RuntimeError("tilted_kplanes: the native CPU kernels could not be built (see the log)")
        if lib is not None:
            points, matrices = points.contiguous(), matrices.contiguous()
    if torch.is_grad_enabled() and (points.requires_grad or matrices.requires_grad
                                    or plane_data.requires_grad):
        return TiltedKPlanesCPU.apply(points, matrices, plane_data, layout, lib)
    if lib is not None:
        return cpu_native.forward(lib, points, matrices, plane_data, layout)
    return _forward(points, matrices, plane_data, layout, keep=False)[0]  # nothing to differentiate


# ------------------------------------------------------------------------------------ plane TV
def _tv_runs(plane_data: torch.Tensor, layout: PlaneLayout):
    """Per run of plane kinds sharing (H, W) (``PlaneLayout.kind_runs``): its (P, H, W, C) view."""
    for l in range(layout.n_scales):
        for k0, k1, _, _ in layout.kind_runs(l):
            yield layout.view_kinds(plane_data, l, k0, k1)


class PlaneTVCPU(torch.autograd.Function):
    """The twin's plane TV (each plane's mean squared neighbour difference along H and W, averaged
    over the 3 L T planes) with one pass per run of same-shaped plane kinds instead of one per
    kind, and its gradient written out: d/dv of sum(d^2) / n is 2 d / n, added at the later
    neighbour and taken from the earlier one."""

    @staticmethod
    def forward(ctx, plane_data, layout: PlaneLayout):
        ctx.layout = layout
        lib = _tv_library(plane_data, layout)
        if lib is not None:  # value and gradient in one native pass; the backward scales the gradient
            value, g = cpu_native.plane_tv(lib, plane_data, layout, with_grad=True)
            ctx.save_for_backward(plane_data, g)
            return value
        ctx.save_for_backward(plane_data, None)
        return _plane_tv_value(plane_data, layout)

    @staticmethod
    def backward(ctx, grad):
        plane_data, g_native = ctx.saved_tensors
        layout: PlaneLayout = ctx.layout
        if torch.is_grad_enabled():  # create_graph backward: higher-order autograd through the twin
            _spy.count("plane_tv_bwd", "torch")
            out = reference.plane_tv(plane_data, layout)
            (g,) = torch.autograd.grad(out, [plane_data], grad.to(out.dtype), create_graph=True)
            return g, None
        _spy.count("plane_tv_bwd", "cpu")
        if g_native is not None:
            return g_native * grad.to(plane_data.dtype), None
        gx = torch.empty_like(plane_data)
        scale = grad.to(plane_data.dtype) * (2.0 / (3 * layout.n_scales * layout.n_rot))
        for v, gv in zip(_tv_runs(plane_data, layout), _tv_runs(gx, layout)):
            _, h, w, c = v.shape
            dh = torch.diff(v, dim=1).mul_(scale / ((h - 1) * w * c))
            dw = torch.diff(v, dim=2).mul_(scale / (h * (w - 1) * c))
            gv.zero_()
            gv[:, 1:] += dh
            gv[:, :-1] -= dh
            gv[:, :, 1:] += dw
            gv[:, :, :-1] -= dw
        return gx, None


def _plane_tv_value(plane_data: torch.Tensor, layout: PlaneLayout) -> torch.Tensor:
    total = plane_data.new_zeros(())
    for v in _tv_runs(plane_data, layout):
        _, h, w, c = v.shape
        # planes of one run share their shape, so the sum of their means is one sum over n
        total = total + torch.diff(v, dim=1).square().sum() / ((h - 1) * w * c)
        total = total + torch.diff(v, dim=2).square().sum() / (h * (w - 1) * c)
    return total / (3 * layout.n_scales * layout.n_rot)


def _tv_library(plane_data: torch.Tensor, layout: PlaneLayout):
    """The native kernels for the plane TV of this buffer, or None (the aten passes then)."""
    if plane_data.dtype not in (torch.float32, torch.float64) or not plane_data.is_contiguous():
        return None
    return cpu_native.library(plane_data.dtype, layout.channels)


def plane_tv(plane_data: torch.Tensor, layout: PlaneLayout) -> torch.Tensor:
    """The twin's ``plane_tv`` on a CPU float32/float64 contiguous 1-D buffer of ``layout`` (whose
    planes are at least 2 x 2 texels: PlaneLayout refuses less): one native pass for the value and
    the gradient where the native kernels build (``kernels/cpu_native.py``), aten passes otherwise."""
    if torch.is_grad_enabled() and plane_data.requires_grad:
        return PlaneTVCPU.apply(plane_data, layout)
    lib = _tv_library(plane_data, layout)
    if lib is not None:
        return cpu_native.plane_tv(lib, plane_data, layout, with_grad=False)[0]
    return _plane_tv_value(plane_data, layout)
