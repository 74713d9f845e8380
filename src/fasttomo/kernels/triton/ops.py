"""torch custom ops (fake + autograd registrations) over the Triton kernels.

Importing this module imports triton and registers the ops ``torch.ops.fasttomo.*``. Only
``fasttomo.kernels.dispatch`` imports it (lazily, when a fast path may be used), and the tests; it
imports nothing of the door back (backward passes are counted in ``kernels/counters.py``). The ops
carry the plane layout as ``(n_rot, channels, flat_resolutions)`` and rebuild it with
``PlaneLayout.from_flat``: offsets come from ``PlaneLayout`` only.
The ops are opaque to torch.compile (torch.library ops with fake kernels) and allocate their outputs with torch, so they work
inside CUDA-graph capture once the kernels are compiled and the plane-TV table is built (any call
before capture does both).

``fasttomo::decoder_mlp`` (the hybrid decoder, ``mlp.py``) saves its inputs and runs the backward
kernel in its backward; a ``create_graph=True`` backward differentiates the twin, under bf16
autocast when the op ran its bf16 kernels (as the door calls it: only under bf16 autocast).

The tomography ops ``fasttomo::ray_project`` and ``fasttomo::voxel_backproject`` (the SIRT
projector pair) and ``fasttomo::ray_points`` (the rays' midpoint samples) are FORWARD-ONLY: they
have a fake registration but no autograd one, and ``dispatch`` routes any call that would need a
gradient (grad mode on and an input requiring it) to the pure-torch twin.

The ops are defined with ``torch.library.define`` / ``impl`` (not ``torch.library.custom_op``):
custom_op wraps each kernel in ``torch._disable_dynamo``, whose first call imports ``torch._dynamo``
(3.6 s of a run's start on an H200), although nothing here is compiled. With ``define`` the
dispatcher calls the Python function directly; the fake and autograd registrations are the same
public ``torch.library`` calls.

Double backward: the registered backward checks ``torch.is_grad_enabled()`` (true only for a
``create_graph=True`` backward) and then computes the gradient through the pure-torch twin with a
graph, so higher-order autograd is exact; the spy counts it as the 'torch' path of '<op>_bwd'.
"""

from __future__ import annotations

import torch

from fasttomo.kernels import reference
from fasttomo.kernels.counters import count as _count
from fasttomo.kernels.layout import PlaneLayout
from fasttomo.kernels.triton import kplanes as _kp
from fasttomo.kernels.triton import mlp as _mlp
from fasttomo.kernels.triton import rays as _rays
from fasttomo.kernels.triton import tomo as _tomo
from fasttomo.kernels.triton import tv as _tv


def _layout(n_rot: int, channels: int, resolutions) -> PlaneLayout:
    return PlaneLayout.from_flat(n_rot, channels, resolutions)


_LIB = torch.library.Library("fasttomo", "FRAGMENT")  # kept alive: the registrations live with it


def _op(schema: str):
    """Define ``fasttomo::<schema>`` and register the decorated function as its kernel for every
    device (CompositeExplicitAutograd, as custom_op does). Returns the function."""
    name = schema.split("(", 1)[0]

    def deco(fn):
        _LIB.define(schema)
        torch.library.impl(f"fasttomo::{name}", "default", fn, lib=_LIB)
        return fn
    return deco


def _fake(name: str):
    return torch.library.register_fake(f"fasttomo::{name}", lib=_LIB)


# ------------------------------------------------------------------------- op 1: tilted k-planes
def _sampled(plane_data: torch.Tensor, planes_bf16: bool) -> torch.Tensor:
    """What the kernels read: the planes, or (precision.planes=bf16) their bf16 copy, made in the
    forward and again in the backward (0.1 ms at the flagship; nothing extra is kept)."""
    return plane_data.to(torch.bfloat16) if planes_bf16 else plane_data


@_op("tilted_kplanes(Tensor points, Tensor matrices, Tensor plane_data, int n_rot, int channels, "
     "int[] resolutions, bool out_bf16, bool planes_bf16=False) -> Tensor")
def tilted_kplanes(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor,
                   n_rot: int, channels: int, resolutions: list[int], out_bf16: bool,
                   planes_bf16: bool = False) -> torch.Tensor:
    return _kp.kplanes_forward(points.contiguous(), matrices.contiguous(),
                               _sampled(plane_data.contiguous(), planes_bf16),
                               _layout(n_rot, channels, resolutions), out_bf16)


@_fake("tilted_kplanes")
def _(points, matrices, plane_data, n_rot, channels, resolutions, out_bf16, planes_bf16=False):
    return points.new_empty((points.shape[0], _layout(n_rot, channels, resolutions).n_features),
                            dtype=torch.bfloat16 if out_bf16 else torch.float32)


@_op("tilted_kplanes_bwd(Tensor grad, Tensor points, Tensor matrices, Tensor plane_data, int n_rot, "
     "int channels, int[] resolutions, bool need_dq, bool need_gm) -> (Tensor, Tensor, Tensor)")
def tilted_kplanes_bwd(grad: torch.Tensor, points: torch.Tensor, matrices: torch.Tensor,
                       plane_data: torch.Tensor, n_rot: int, channels: int,
                       resolutions: list[int], need_dq: bool,
                       need_gm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(plane gradients, dL/dq (3, T, N or 0), dL/dmatrices (T or 0, 3, 3))."""
    return _kp.kplanes_backward(grad.contiguous(), points.contiguous(), matrices.contiguous(),
                                plane_data.contiguous(), _layout(n_rot, channels, resolutions),
                                need_dq, need_gm=need_gm)


@_fake("tilted_kplanes_bwd")
def _(grad, points, matrices, plane_data, n_rot, channels, resolutions, need_dq, need_gm):
    n = points.shape[0] if need_dq else 0
    return (plane_data.new_empty(plane_data.shape, dtype=torch.float32),  # a bf16 copy's gradient too
            points.new_empty((3, n_rot, n), dtype=torch.float32),
            points.new_empty((n_rot if need_gm else 0, 3, 3), dtype=torch.float32))


def _kp_setup(ctx, inputs, output):
    points, matrices, plane_data, n_rot, channels, resolutions = inputs[:6]
    ctx.save_for_backward(points, matrices, plane_data)
    ctx.cfg = (n_rot, channels, list(resolutions), bool(inputs[7]) if len(inputs) > 7 else False)
    ctx.n_inputs = len(inputs)


def _twin_grads(ctx, grad: torch.Tensor, grad_tv: torch.Tensor | None = None) -> list:
    """A create_graph backward of the interpolation (and, given ``grad_tv``, of the plane TV of the
    same planes): exact higher-order autograd through the twins. [d points, d matrices, d planes],
    None where not needed."""
    points, matrices, plane_data = ctx.saved_tensors
    n_rot, channels, resolutions, planes_bf16 = ctx.cfg
    layout = _layout(n_rot, channels, resolutions)
    need_p, need_m, need_x = ctx.needs_input_grad[:3]
    _count("tilted_kplanes_bwd", "torch")
    wrt = [(i, t) for i, (t, need) in enumerate(((points, need_p), (matrices, need_m), (plane_data, need_x))) if need]
    out = reference.tilted_kplanes(points, matrices, reference.bf16_planes(plane_data) if planes_bf16 else plane_data,
                                   layout)
    outs, grads = [out], [grad.to(out.dtype)]
    if grad_tv is not None:
        _count("plane_tv_bwd", "torch")
        if need_x:  # the TV depends on the planes alone
            tv = reference.plane_tv(plane_data, layout)
            outs.append(tv)
            grads.append(grad_tv.to(tv.dtype))
    got = torch.autograd.grad(outs, [t for _, t in wrt], grads, create_graph=True, allow_unused=True)
    res = [None, None, None]
    for (i, t), g in zip(wrt, got):
        res[i] = torch.zeros_like(t) if g is None else g
    return res


def _kernel_grads(ctx, gplanes: torch.Tensor, dq: torch.Tensor, gm: torch.Tensor) -> list:
    """[d points, d matrices, d planes] from the backward kernels' results, None where not needed.
    dq (3, T, N) is there only for the points' gradient; the matrices' gradient (sum over N of
    dq p^T) comes from per-program partial sums of the kernel (an N-long einsum over dq ran on a
    single GEMM tile: 0.105 ms of a 1.57 ms small128 step)."""
    _, matrices, plane_data = ctx.saved_tensors
    need_p, need_m, need_x = ctx.needs_input_grad[:3]
    return [torch.einsum("itn,tij->nj", dq, matrices) if need_p else None,
            gm.to(matrices.dtype) if need_m else None,
            gplanes.to(plane_data.dtype) if need_x else None]


def _kp_backward(ctx, grad):
    rest = (None,) * (ctx.n_inputs - 3)
    if torch.is_grad_enabled():  # create_graph backward
        return (*_twin_grads(ctx, grad), *rest)
    points, matrices, plane_data = ctx.saved_tensors
    n_rot, channels, resolutions, planes_bf16 = ctx.cfg
    need_p, need_m = ctx.needs_input_grad[:2]
    _count("tilted_kplanes_bwd", "triton")
    gplanes, dq, gm = torch.ops.fasttomo.tilted_kplanes_bwd(grad, points, matrices, _sampled(plane_data, planes_bf16),
                                                            n_rot, channels, resolutions, bool(need_p), bool(need_m))
    return (*_kernel_grads(ctx, gplanes, dq, gm), *rest)


torch.library.register_autograd("fasttomo::tilted_kplanes", _kp_backward, setup_context=_kp_setup, lib=_LIB)


# ------------------------------------------------------------------------- op 3: plane TV
@_op("plane_tv(Tensor plane_data, int n_rot, int channels, int[] resolutions) -> Tensor")
def plane_tv(plane_data: torch.Tensor, n_rot: int, channels: int,
             resolutions: list[int]) -> torch.Tensor:
    return _tv.plane_tv_forward(plane_data.contiguous(), _layout(n_rot, channels, resolutions))


@_fake("plane_tv")
def _(plane_data, n_rot, channels, resolutions):
    return plane_data.new_empty(())


@_op("plane_tv_bwd(Tensor grad, Tensor plane_data, int n_rot, int channels, int[] resolutions) -> Tensor")
def plane_tv_bwd(grad: torch.Tensor, plane_data: torch.Tensor, n_rot: int, channels: int,
                 resolutions: list[int]) -> torch.Tensor:
    return _tv.plane_tv_backward(grad, plane_data.contiguous(), _layout(n_rot, channels, resolutions))


@_fake("plane_tv_bwd")
def _(grad, plane_data, n_rot, channels, resolutions):
    return torch.empty_like(plane_data)


def _ptv_setup(ctx, inputs, output):
    plane_data, n_rot, channels, resolutions = inputs
    ctx.save_for_backward(plane_data)
    ctx.cfg = (n_rot, channels, list(resolutions))


def _ptv_backward(ctx, grad):
    (plane_data,) = ctx.saved_tensors
    n_rot, channels, resolutions = ctx.cfg
    if torch.is_grad_enabled():
        _count("plane_tv_bwd", "torch")
        out = reference.plane_tv(plane_data, _layout(n_rot, channels, resolutions))
        (g,) = torch.autograd.grad(out, [plane_data], grad.to(out.dtype), create_graph=True)
        return g, None, None, None
    _count("plane_tv_bwd", "triton")
    return (torch.ops.fasttomo.plane_tv_bwd(grad, plane_data, n_rot, channels, resolutions),
            None, None, None)


torch.library.register_autograd("fasttomo::plane_tv", _ptv_backward, setup_context=_ptv_setup, lib=_LIB)


# ------------------------------------------------------------------------- ops 1 and 3 in one
# A training step's features and plane TV in one op, so that its backward writes the plane TV's
# gradient first and the interpolation's backward adds to that buffer: no zeroed buffer, and no
# second plane-sized gradient for autograd to add (0.08 + 0.25 ms of a camera2k step on an H100).
@_op("tilted_kplanes_tv(Tensor points, Tensor matrices, Tensor plane_data, int n_rot, int channels, "
     "int[] resolutions, bool out_bf16, bool planes_bf16) -> (Tensor, Tensor)")
def tilted_kplanes_tv(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor, n_rot: int,
                      channels: int, resolutions: list[int], out_bf16: bool, planes_bf16: bool):
    plane_data = plane_data.contiguous()
    layout = _layout(n_rot, channels, resolutions)
    return (_kp.kplanes_forward(points.contiguous(), matrices.contiguous(), _sampled(plane_data, planes_bf16),
                                layout, out_bf16),
            _tv.plane_tv_forward(plane_data, layout))


@_fake("tilted_kplanes_tv")
def _(points, matrices, plane_data, n_rot, channels, resolutions, out_bf16, planes_bf16):
    return (points.new_empty((points.shape[0], _layout(n_rot, channels, resolutions).n_features),
                             dtype=torch.bfloat16 if out_bf16 else torch.float32),
            plane_data.new_empty(()))


@_op("tilted_kplanes_tv_bwd(Tensor grad, Tensor grad_tv, Tensor points, Tensor matrices, Tensor plane_data, "
     "int n_rot, int channels, int[] resolutions, bool need_dq, bool need_gm, bool planes_bf16) "
     "-> (Tensor, Tensor, Tensor)")
def tilted_kplanes_tv_bwd(grad: torch.Tensor, grad_tv: torch.Tensor, points: torch.Tensor, matrices: torch.Tensor,
                          plane_data: torch.Tensor, n_rot: int, channels: int, resolutions: list[int],
                          need_dq: bool, need_gm: bool, planes_bf16: bool):
    """(the plane TV's and the features' plane gradients in one buffer, dL/dq, dL/dmatrices)."""
    plane_data = plane_data.contiguous()
    layout = _layout(n_rot, channels, resolutions)
    gplanes = _tv.plane_tv_backward(grad_tv, plane_data, layout)
    return _kp.kplanes_backward(grad.contiguous(), points.contiguous(), matrices.contiguous(),
                                _sampled(plane_data, planes_bf16), layout, need_dq, need_gm=need_gm,
                                gplanes=gplanes)


@_fake("tilted_kplanes_tv_bwd")
def _(grad, grad_tv, points, matrices, plane_data, n_rot, channels, resolutions, need_dq, need_gm, planes_bf16):
    n = points.shape[0] if need_dq else 0
    return (plane_data.new_empty(plane_data.shape, dtype=torch.float32),
            points.new_empty((3, n_rot, n), dtype=torch.float32),
            points.new_empty((n_rot if need_gm else 0, 3, 3), dtype=torch.float32))


def _kptv_setup(ctx, inputs, output):
    points, matrices, plane_data, n_rot, channels, resolutions, _, planes_bf16 = inputs
    ctx.save_for_backward(points, matrices, plane_data)
    ctx.cfg = (n_rot, channels, list(resolutions), bool(planes_bf16))


def _kptv_backward(ctx, grad, grad_tv):
    points, matrices, plane_data = ctx.saved_tensors
    n_rot, channels, resolutions, planes_bf16 = ctx.cfg
    need_p, need_m = ctx.needs_input_grad[:2]
    rest = (None,) * 5
    if grad is None:
        grad = points.new_zeros((points.shape[0], _layout(n_rot, channels, resolutions).n_features))
    grad_tv = torch.zeros((), device=points.device, dtype=torch.float32) if grad_tv is None else grad_tv
    if torch.is_grad_enabled():  # create_graph backward
        return (*_twin_grads(ctx, grad, grad_tv), *rest)
    _count("tilted_kplanes_bwd", "triton")
    _count("plane_tv_bwd", "triton")
    gplanes, dq, gm = torch.ops.fasttomo.tilted_kplanes_tv_bwd(grad, grad_tv, points, matrices, plane_data, n_rot,
                                                               channels, resolutions, bool(need_p), bool(need_m),
                                                               planes_bf16)
    return (*_kernel_grads(ctx, gplanes, dq, gm), *rest)


torch.library.register_autograd("fasttomo::tilted_kplanes_tv", _kptv_backward, setup_context=_kptv_setup, lib=_LIB)


# ------------------------------------------------------------------------- op 2: volume TV
@_op("volume_tv(Tensor volume, bool l1) -> Tensor")
def volume_tv(volume: torch.Tensor, l1: bool) -> torch.Tensor:
    return _tv.volume_tv_forward(volume.contiguous(), l1)


@_fake("volume_tv")
def _(volume, l1):
    return volume.new_empty(())


@_op("volume_tv_bwd(Tensor grad, Tensor volume, bool l1) -> Tensor")
def volume_tv_bwd(grad: torch.Tensor, volume: torch.Tensor, l1: bool) -> torch.Tensor:
    return _tv.volume_tv_backward(grad, volume.contiguous(), l1)


@_fake("volume_tv_bwd")
def _(grad, volume, l1):
    return torch.empty_like(volume)


def _vtv_setup(ctx, inputs, output):
    volume, l1 = inputs
    ctx.save_for_backward(volume)
    ctx.l1 = l1


def _vtv_backward(ctx, grad):
    (volume,) = ctx.saved_tensors
    if torch.is_grad_enabled():
        _count("volume_tv_bwd", "torch")
        out = reference.volume_tv(volume, "l1" if ctx.l1 else "squared")
        (g,) = torch.autograd.grad(out, [volume], grad.to(out.dtype), create_graph=True)
        return g, None
    _count("volume_tv_bwd", "triton")
    return torch.ops.fasttomo.volume_tv_bwd(grad, volume, ctx.l1), None


torch.library.register_autograd("fasttomo::volume_tv", _vtv_backward, setup_context=_vtv_setup, lib=_LIB)


# ------------------------------------------------------------------------- the hybrid decoder
@_op("decoder_mlp(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor w3, Tensor b3, bool bf16) -> Tensor")
def decoder_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                w3: torch.Tensor, b3: torch.Tensor, bf16: bool) -> torch.Tensor:
    """(N,) fp32 raw density of (N, F) features (``kernels/triton/mlp.py``)."""
    return _mlp.mlp_forward(x.contiguous(), *(p.contiguous() for p in (w1, b1, w2, b2, w3, b3)), bf16)


@_fake("decoder_mlp")
def _(x, w1, b1, w2, b2, w3, b3, bf16):
    return x.new_empty((x.shape[0],), dtype=torch.float32)


@_op("decoder_mlp_bwd(Tensor grad, Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor w3, bool bf16, "
     "bool need_dx) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def decoder_mlp_bwd(grad: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                    b2: torch.Tensor, w3: torch.Tensor, bf16: bool, need_dx: bool):
    """(dL/dx (N, F) in x's dtype, or (0, F) without ``need_dx``; dL/dW1, db1, dW2, db2, dW3, db3 fp32)."""
    dx, *dw = _mlp.mlp_backward(x.contiguous(), grad.contiguous(), *(p.contiguous() for p in (w1, b1, w2, b2, w3)),
                                bf16, need_dx)
    return (dx, *(t.clone() for t in dw))  # views of one sum: each output its own tensor


@_fake("decoder_mlp_bwd")
def _(grad, x, w1, b1, w2, b2, w3, bf16, need_dx):
    f32 = torch.float32
    return (x.new_empty((x.shape[0] if need_dx else 0, x.shape[1])), w1.new_empty(w1.shape, dtype=f32),
            b1.new_empty(b1.shape, dtype=f32), w2.new_empty(w2.shape, dtype=f32), b2.new_empty(b2.shape, dtype=f32),
            w3.new_empty(w3.shape, dtype=f32), w3.new_empty((1,), dtype=f32))


def _mlp_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:7])
    ctx.bf16 = bool(inputs[7])


def _mlp_backward(ctx, grad):
    saved = ctx.saved_tensors
    needs = ctx.needs_input_grad[:7]
    if torch.is_grad_enabled():
        # create_graph backward: exact higher-order autograd through the twin, under bf16 autocast
        # for the bf16 kernels (the door calls them only there)
        _count("decoder_mlp_bwd", "torch")
        wrt = [(i, t) for i, (t, need) in enumerate(zip(saved, needs)) if need]
        with torch.autocast(saved[0].device.type, dtype=torch.bfloat16, enabled=ctx.bf16):
            out = reference.decoder_mlp(*saved)
        got = torch.autograd.grad(out, [t for _, t in wrt], grad.to(out.dtype), create_graph=True, allow_unused=True)
        res = [None] * 7
        for (i, t), g in zip(wrt, got):
            res[i] = torch.zeros_like(t) if g is None else g.to(t.dtype)
        return (*res, None)
    _count("decoder_mlp_bwd", "triton")
    x, w1, b1, w2, b2, w3, b3 = saved
    got = torch.ops.fasttomo.decoder_mlp_bwd(grad, x, w1, b1, w2, b2, w3, ctx.bf16, bool(needs[0]))
    return (*((g.to(t.dtype) if need else None) for g, t, need in zip(got, saved, needs)), None)


torch.library.register_autograd("fasttomo::decoder_mlp", _mlp_backward, setup_context=_mlp_setup, lib=_LIB)


# ------------------------------------------------------------------------- ops 4, 5: SIRT projectors
# Forward-only (no register_autograd): the door sends calls that need a gradient to the twins.
@_op("ray_project(Tensor volume, Tensor rot, Tensor shift, int height, int width, float step) -> Tensor")
def ray_project(volume: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor, height: int,
                width: int, step: float) -> torch.Tensor:
    return _tomo.ray_project(volume.contiguous(), rot, shift, height, width, step)


@_fake("ray_project")
def _(volume, rot, shift, height, width, step):
    return volume.new_empty((rot.shape[0], height, width), dtype=torch.float32)


@_op("voxel_backproject(Tensor images, Tensor rot, Tensor shift, int depth, int height, int width) -> Tensor")
def voxel_backproject(images: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor, depth: int,
                      height: int, width: int) -> torch.Tensor:
    return _tomo.voxel_backproject(images.contiguous(), rot, shift, depth, height, width)


@_fake("voxel_backproject")
def _(images, rot, shift, depth, height, width):
    return images.new_empty((depth, height, width), dtype=torch.float32)


# ------------------------------------------------------------------------- op 6: the rays' samples
# Forward-only, like the projectors: with learned poses the door takes the twin.
@_op("ray_points(Tensor origin, Tensor direction, Tensor t_in, Tensor dt, Tensor hit, float[] half_extent, "
     "int n_samples, float bound) -> (Tensor, Tensor)")
def ray_points(origin: torch.Tensor, direction: torch.Tensor, t_in: torch.Tensor, dt: torch.Tensor,
               hit: torch.Tensor, half_extent: list[float], n_samples: int, bound: float):
    return _rays.ray_points(origin, direction, t_in, dt, hit, tuple(half_extent), n_samples, bound)


@_fake("ray_points")
def _(origin, direction, t_in, dt, hit, half_extent, n_samples, bound):
    B = origin.shape[0]
    return origin.new_empty((B, n_samples, 3)), origin.new_empty((B, n_samples), dtype=torch.bool)
