"""The Triton kernels' logic on the CPU through Triton's interpreter (TRITON_INTERPRET=1), tiny inputs.

TRITON_INTERPRET must be set before triton is imported, and the rest of the suite (and the GPU
suite) must not run under it, so the checks run in ONE child process (this file executed as a
script); pytest parametrizes over the checks' results. opcheck is not here: the interpreter touches
data pointers, which fake tensors do not have (it runs in test_kernels_gpu.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


# ------------------------------------------------------------------------------------- the checks
def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _texel_runs(errs, g, pts, M, x, lay, res, gr):
    """The "runs" backward (texel runs) for several row shapes (each a frozen KPlanesTuning passed
    down), the last with 4 rows for the scales of planes at most 6 texels a side and 2 for the
    others (each scale's partial sums of dL/dM in its own slots); plane and point gradients
    against the twin."""
    import torch

    from fasttomo.kernels.triton import kplanes as kp
    for rows, run, few in ((4, 4, 0), (2, 8, 0), (16, 16, 0), (2, 8, 4)):
        tuning = kp.KPlanesTuning(backward="runs", run_rows=rows, run_len=run, run_warps=1,
                                  few_channel_rows=few, few_channel_max_res=6)
        if few:
            run = f"{run}few{few}"
        gp, dq, gm = kp.kplanes_backward(g, pts.detach(), M.detach(), x.detach(), lay, True, tuning,
                                         need_gm=True)
        errs[f"d_planes_runs{rows}x{run}"] = _rel(gp, gr[2])
        errs[f"d_points_runs{rows}x{run}"] = _rel(torch.einsum("itn,tij->nj", dq, M.detach()), gr[0])
        errs[f"d_matrices_runs{rows}x{run}"] = _rel(gm, gr[1])  # summed in the kernel
        # the matrices' gradient alone: dq is not written (N = 0) and gm is the same
        _, dq0, gm0 = kp.kplanes_backward(g, pts.detach(), M.detach(), x.detach(), lay, False, tuning,
                                          need_gm=True)
        errs[f"d_matrices_only_runs{rows}x{run}"] = _rel(gm0, gr[1]) + float(dq0.numel() != 0)


def _bf16_dots_in_the_interpreter() -> None:
    """Triton's interpreter keeps bf16 values as their uint16 bits and its ``tl.dot`` multiplies the
    bits (triton-lang/triton#11584; its maintainers: bf16 is not supported there yet). Widen bf16
    operands to fp32 first, as the tensor cores do (a product of two bf16 values is exact in fp32),
    so the fused decoder's bf16 path runs here. Its casts to bf16 still truncate (the GPU rounds to
    nearest), which the emulation below mirrors."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype, b.dtype):
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        def wide(h):
            return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype == tl.bfloat16 else h.data
        return interpreter.TensorHandle(np.matmul(wide(a), wide(b), dtype=np.float32) + d.data, d.dtype.scalar)
    builder.create_dot = create_dot


def _decoder_bf16_emulation(x, ps, g):
    """The fused decoder's bf16 kernels in torch, at their rounding points (kernels/triton/mlp.py),
    with the interpreter's truncating casts (dx too, stored as bf16 for bf16 features): (out, dx,
    dW1, db1, dW2, db2, dW3, db3)."""
    import torch

    def bf(t):
        return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)
    w1, b1, w2, b2, w3, b3 = (p.detach() for p in ps)
    xb = bf(x.detach())
    z1 = xb @ bf(w1).T + b1
    h1 = bf(z1.relu())
    z2 = h1 @ bf(w2).T + b2
    h2 = bf(z2.relu())
    dz2 = bf(torch.where(z2 > 0, g[:, None] * w3, 0.0))
    dz1 = bf(torch.where(z1 > 0, dz2 @ bf(w2), 0.0))
    dx = dz1 @ bf(w1)
    return (h2 @ w3[0] + b3, bf(dx) if x.dtype == torch.bfloat16 else dx, dz1.T @ xb, dz1.sum(0), dz2.T @ h1, dz2.sum(0),
            (h2 * g[:, None]).sum(0)[None], g.sum()[None])


def _checks():
    import torch

    from fasttomo.kernels import dispatch, reference
    from fasttomo.kernels.layout import PlaneLayout
    from fasttomo.kernels.triton import kplanes as kp
    from fasttomo.kernels.triton import ops  # noqa: F401  (registers torch.ops.fasttomo.*)

    torch.manual_seed(1234)
    tol = 2e-5
    out = {}

    def record(name, errs):
        worst = max(errs.values())
        out[name] = {"ok": bool(worst < tol and worst == worst), "errors": errs}

    def rays(n_rays, n_samples, spread=1.2):
        o = torch.rand(n_rays, 1, 3) * 2 * spread - spread
        d = torch.nn.functional.normalize(torch.randn(n_rays, 1, 3), dim=-1)
        s = torch.linspace(-0.4, 0.4, n_samples)[None, :, None]
        return (o + d * s).reshape(-1, 3)

    layouts = {
        "T2_C5_two_scales_aniso": PlaneLayout(2, 5, ((4, 6, 5), (7, 3, 9))),
        "T1_C3_one_scale": PlaneLayout(1, 3, ((3, 4, 2),)),
        "T3_C16_rect": PlaneLayout(3, 16, ((5, 2, 3),)),
    }
    for lname, lay in layouts.items():
        res = [v for r in lay.resolutions for v in r]
        for pname, pts in (("random_outside", torch.rand(29, 3) * 3.0 - 1.5),
                           ("rays", rays(3, 11))):
            pts = pts.requires_grad_()
            M = torch.linalg.qr(torch.randn(lay.n_rot, 3, 3))[0].requires_grad_()  # non-contiguous
            x = torch.randn(lay.numel).requires_grad_()
            ref = reference.tilted_kplanes(pts, M, x, lay)
            got = torch.ops.fasttomo.tilted_kplanes(pts, M, x, lay.n_rot, lay.channels, res, False)
            g = torch.randn_like(ref)
            gr = torch.autograd.grad(ref, [pts, M, x], g)
            gg = torch.autograd.grad(got, [pts, M, x], g)
            errs = {"out": _rel(got, ref), "d_points": _rel(gg[0], gr[0]),
                    "d_matrices": _rel(gg[1], gr[1]), "d_planes": _rel(gg[2], gr[2])}
            for bn in (16, 2):  # the "pairs" backward
                tuning = kp.KPlanesTuning(backward="pairs", pairs_block_n=bn)
                gp, dq, gm = kp.kplanes_backward(g, pts.detach(), M.detach(), x.detach(), lay, True,
                                                 tuning, need_gm=True)
                errs[f"d_planes_pairs{bn}"] = _rel(gp, gr[2])
                errs[f"d_points_pairs{bn}"] = _rel(torch.einsum("itn,tij->nj", dq, M.detach()), gr[0])
                errs[f"d_matrices_pairs{bn}"] = _rel(gm, gr[1])
                _, dq0, gm0 = kp.kplanes_backward(g, pts.detach(), M.detach(), x.detach(), lay, False,
                                                  tuning, need_gm=True)
                errs[f"d_matrices_only_pairs{bn}"] = _rel(gm0, gr[1]) + float(dq0.numel() != 0)
            _texel_runs(errs, g, pts, M, x, lay, res, gr)
            record(f"kplanes[{lname}-{pname}]", errs)

    # texel runs on dense rays: many samples per cell and moves to every neighbouring cell
    lay = PlaneLayout(2, 5, ((9, 7, 8),))
    res = [v for r in lay.resolutions for v in r]
    pts = rays(5, 40, spread=0.6).requires_grad_()
    M = torch.linalg.qr(torch.randn(2, 3, 3))[0].requires_grad_()
    x = torch.randn(lay.numel).requires_grad_()
    ref = reference.tilted_kplanes(pts, M, x, lay)
    g = torch.randn_like(ref)
    gr = torch.autograd.grad(ref, [pts, M, x], g)
    moves = set()
    for t in range(2):
        q = (pts.detach() @ M.detach()[t].T + 1) / 2 * torch.tensor([8.0, 6.0, 7.0])
        cells = q.clamp_min(0).floor().long()
        moves |= {tuple(d) for d in (cells[1:] - cells[:-1]).clamp(-2, 2).tolist()}
    errs = {}
    _texel_runs(errs, g, pts, M, x, lay, res, gr)
    record("kplanes[texel_runs_dense_rays]", errs)
    # the case must exercise the carries: unit moves along each axis and a diagonal one
    out["kplanes[texel_runs_dense_rays]"]["ok"] &= bool(
        {(1, 0, 0), (0, 1, 0), (0, 0, 1)} <= {tuple(abs(v) for v in m) for m in moves}
        and any(sum(v != 0 for v in m) >= 2 and max(abs(v) for v in m) == 1 for m in moves))

    # expanded (stride-0) output gradient, and only the planes learnable
    lay = layouts["T2_C5_two_scales_aniso"]
    res = [v for r in lay.resolutions for v in r]
    pts, M = torch.rand(13, 3) * 2 - 1, torch.linalg.qr(torch.randn(2, 3, 3))[0]
    x = torch.randn(lay.numel).requires_grad_()
    (ga,) = torch.autograd.grad(torch.ops.fasttomo.tilted_kplanes(pts, M, x, 2, 5, res, False).sum(), [x])
    (gb,) = torch.autograd.grad(reference.tilted_kplanes(pts, M, x, lay).sum(), [x])
    record("kplanes[stride0_grad]", {"d_planes": _rel(ga, gb)})

    # bf16 output: same values rounded to bf16
    got = torch.ops.fasttomo.tilted_kplanes(pts, M, x.detach(), 2, 5, res, True)
    ref = reference.tilted_kplanes(pts, M, x.detach(), lay)
    out["kplanes[bf16_out]"] = {"ok": bool(got.dtype == torch.bfloat16 and _rel(got.float(), ref) < 1e-2),
                                "errors": {"out": _rel(got.float(), ref)}}

    # bf16 planes (a bench variant): sampled from the bf16 copy, everything after the load in fp32,
    # so the fp32 twin on the rounded planes is the oracle; plane gradients come back fp32
    lay_b = PlaneLayout(2, 16, ((5, 4, 6), (9, 7, 8)))
    pts_b = rays(4, 12, spread=0.7)
    M_b = torch.linalg.qr(torch.randn(2, 3, 3))[0]
    xb = torch.randn(lay_b.numel).to(torch.bfloat16)
    xr = xb.float().requires_grad_()
    pr, Mr = pts_b.clone().requires_grad_(), M_b.clone().requires_grad_()
    ref = reference.tilted_kplanes(pr, Mr, xr, lay_b)
    g = torch.randn_like(ref)
    gr = torch.autograd.grad(ref, [pr, Mr, xr], g)
    errs = {"out": _rel(kp.kplanes_forward(pts_b, M_b, xb, lay_b, False), ref)}
    for tag, tuning in (("pairs", kp.KPlanesTuning(backward="pairs", pairs_block_n=16)),
                        ("runs", kp.KPlanesTuning(backward="runs", run_rows=4, run_len=8))):
        gp, dq, gm = kp.kplanes_backward(g, pts_b, M_b, xb, lay_b, True, tuning, need_gm=True)
        errs[f"d_planes_{tag}"] = _rel(gp, gr[2]) + float(gp.dtype != torch.float32)
        errs[f"d_points_{tag}"] = _rel(torch.einsum("itn,tij->nj", dq, M_b), gr[0])
        errs[f"d_matrices_{tag}"] = _rel(gm, gr[1])
    # precision.planes=bf16 through the custom op: fp32 planes in, the copy made inside, the plane
    # gradient fp32 and unrounded
    leaves = [t.clone().requires_grad_() for t in (pts_b, M_b, xb.float())]
    got = torch.ops.fasttomo.tilted_kplanes(*leaves, 2, 16, [v for r in lay_b.resolutions for v in r], False, True)
    gg = torch.autograd.grad(got, leaves, g)
    errs["op_out"] = _rel(got, ref)
    for name, a, b in zip(("points", "matrices", "planes"), gg, gr):
        errs[f"op_d_{name}"] = _rel(a, b) + float(a.dtype != torch.float32)
    record("kplanes[bf16_planes]", errs)

    # create_graph: the backward routes to the twin's formula; double backward is exact
    dispatch.reset_counters()
    pts = (torch.rand(11, 3) * 2 - 1).requires_grad_()
    (gp1,) = torch.autograd.grad(torch.ops.fasttomo.tilted_kplanes(pts, M, x, 2, 5, res, False).square().sum(),
                                 [pts], create_graph=True)
    spy = dict(dispatch.counters.get("tilted_kplanes_bwd", {}))
    (gp2,) = torch.autograd.grad(reference.tilted_kplanes(pts, M, x, lay).square().sum(), [pts],
                                 create_graph=True)
    errs = {"grad": _rel(gp1, gp2)}
    try:  # some torch versions lack grid_sampler_2d_backward's derivative: then both must raise
        (gg2,) = torch.autograd.grad(gp2.sum(), [x])
    except RuntimeError:
        gg2 = None
    if gg2 is None:
        try:
            torch.autograd.grad(gp1.sum(), [x])
            errs["double_should_raise_like_twin"] = 1.0
        except RuntimeError:
            pass
    else:
        (gg1,) = torch.autograd.grad(gp1.sum(), [x])
        errs["double"] = _rel(gg1, gg2)
    record("kplanes[create_graph]", errs)
    out["kplanes[create_graph]"]["ok"] &= spy == {"torch": 1}  # create_graph backward -> twin formula

    # plane TV (the last layout: planes of several strips, rows of W*C up to 560 elements and up
    # to 70 rows, neither a multiple of a strip's)
    strips = {"T2_C8_strips": PlaneLayout(2, 8, ((40, 70, 20), (70, 18, 65)))}
    for lname, lay in {**layouts, **strips}.items():
        res = [v for r in lay.resolutions for v in r]
        x = torch.randn(lay.numel).requires_grad_()
        ref = reference.plane_tv(x, lay)
        got = torch.ops.fasttomo.plane_tv(x, lay.n_rot, lay.channels, res)
        (gr,) = torch.autograd.grad(ref * 1.7, [x])
        (gg,) = torch.autograd.grad(got * 1.7, [x])
        record(f"plane_tv[{lname}]", {"out": _rel(got, ref), "grad": _rel(gg, gr)})

    # volume TV
    for shape in ((5, 6, 7), (2, 3, 2, 5), (2, 2, 2)):
        for kind in ("squared", "l1"):
            v = torch.randn(shape).requires_grad_()
            ref = reference.volume_tv(v, kind)
            got = torch.ops.fasttomo.volume_tv(v, kind == "l1")
            (gr,) = torch.autograd.grad(ref * 0.3, [v])
            (gg,) = torch.autograd.grad(got * 0.3, [v])
            record(f"volume_tv[{'x'.join(map(str, shape))}-{kind}]", {"out": _rel(got, ref), "grad": _rel(gg, gr)})

    # the fused decoder in fp32: values and every gradient through the op's autograd against the
    # twin, ragged N and F, each hidden width; dx skipped when not asked for; create_graph through
    # the twin
    from fasttomo.kernels.triton import mlp

    for n, f, h in ((300, 20, 32), (37, 48, 16), (5, 64, 64)):
        x = torch.randn(n, f).requires_grad_()
        ps = [(torch.randn(*shape) * 0.3).requires_grad_() for shape in ((h, f), (h,), (h, h), (h,), (1, h), (1,))]
        ref = reference.decoder_mlp(x, *ps)
        got = torch.ops.fasttomo.decoder_mlp(x, *ps, False)
        g = torch.randn(n)
        gr = torch.autograd.grad(ref, [x, *ps], g)
        dispatch.reset_counters()
        gg = torch.autograd.grad(got, [x, *ps], g)
        errs = {"out": _rel(got, ref) + float(got.dtype != torch.float32)}
        for name, a, b in zip(("x", "w1", "b1", "w2", "b2", "w3", "b3"), gg, gr):
            errs[f"d_{name}"] = _rel(a, b) + float(a.shape != b.shape)
        errs["spy"] = float(dispatch.counters.get("decoder_mlp_bwd") != {"triton": 1})
        dx, *dw = mlp.mlp_backward(x.detach(), g, *(p.detach() for p in ps[:5]), False, need_dx=False, programs=2)
        errs["no_dx"] = float(dx.shape != (0, f)) + _rel(dw[0], gr[1])
        dispatch.reset_counters()
        (c1,) = torch.autograd.grad(torch.ops.fasttomo.decoder_mlp(x, *ps, False).square().sum(), [x],
                                    create_graph=True)
        (c2,) = torch.autograd.grad(reference.decoder_mlp(x, *ps).square().sum(), [x], create_graph=True)
        errs["create_graph"] = _rel(c1, c2) + float(dispatch.counters.get("decoder_mlp_bwd") != {"torch": 1})
        errs["double"] = _rel(torch.autograd.grad(c1.sum(), [ps[0]])[0], torch.autograd.grad(c2.sum(), [ps[0]])[0])
        record(f"decoder_mlp[n{n}-f{f}-h{h}]", errs)

    # features wider than the kernels hold: the door's cuBLAS product first, the kernels through an
    # identity first layer; values and every gradient against the twin's (fp32)
    for n, f, h in ((77, 96, 32), (40, 200, 16)):
        x = torch.randn(n, f).requires_grad_()
        ps = [(torch.randn(*shape) * 0.3).requires_grad_() for shape in ((h, f), (h,), (h, h), (h,), (1, h), (1,))]
        ref = reference.decoder_mlp(x, *ps)
        dispatch.reset_counters()
        got = dispatch._fused_decoder(x, tuple(ps), False)
        g = torch.randn(n)
        gr = torch.autograd.grad(ref, [x, *ps], g)
        gg = torch.autograd.grad(got, [x, *ps], g)
        errs = {"out": _rel(got, ref) + float(got.dtype != torch.float32)}
        for name, a, b in zip(("x", "w1", "b1", "w2", "b2", "w3", "b3"), gg, gr):
            errs[f"d_{name}"] = _rel(a, b) + float(a.shape != b.shape)
        errs["spy"] = float(dispatch.counters.get("decoder_mlp_bwd") != {"triton": 1})
        record(f"decoder_mlp_wide[n{n}-f{f}-h{h}]", errs)

    # the decoder's bf16 path (the one the door takes), with the interpreter's bf16 products widened:
    # the kernels compute exactly their documented rounding points (the emulation above), for bf16
    # and fp32 features; dx comes back in the features' dtype
    _bf16_dots_in_the_interpreter()
    for n, f, h in ((300, 20, 32), (45, 64, 64)):
        for xd in (torch.bfloat16, torch.float32):
            x = (torch.rand(n, f) * 2).to(xd).requires_grad_()
            ps = [(torch.randn(*shape) * 0.3).requires_grad_() for shape in ((h, f), (h,), (h, h), (h,), (1, h), (1,))]
            g = torch.randn(n)
            want = _decoder_bf16_emulation(x, ps, g)
            got = torch.ops.fasttomo.decoder_mlp(x, *ps, True)
            grads = torch.autograd.grad(got, [x, *ps], g)
            errs = {"out": _rel(got, want[0]) + float(got.dtype != torch.float32)}
            for name, a, b in zip(("x", "w1", "b1", "w2", "b2", "w3", "b3"), grads, want[1:]):
                errs[f"d_{name}"] = _rel(a.float(), b) + float(a.dtype != (xd if name == "x" else torch.float32))
            record(f"decoder_mlp_bf16[n{n}-f{f}-h{h}-{str(xd)[6:]}]", errs)

    # the SIRT projector pair, with int32 and with int64 offsets (the variant above 2**31 elements)
    from fasttomo.geometry.so3 import rot_y, rot_z
    from fasttomo.kernels.triton import tomo

    vol = torch.rand(5, 6, 7)
    ang = torch.tensor([-50.0, -10.0, 0.0, 35.0])
    rot = rot_y(torch.deg2rad(ang)) @ rot_z(torch.full((4,), 0.2))  # tilts with an in-plane rotation
    shift = torch.randn(4, 2) * 0.7
    ref_p = reference.ray_project(vol, rot, shift, (6, 8), 0.75)
    imgs = torch.rand(4, 6, 8)
    ref_b = reference.voxel_backproject(imgs, rot, shift, (5, 6, 7))
    for big in (False, True):
        got_p = tomo.ray_project(vol, rot, shift, 6, 8, 0.75, int64=big)
        got_b = tomo.voxel_backproject(imgs, rot, shift, 5, 6, 7, int64=big)
        record(f"tomo[int64={big}]", {"project": _rel(got_p, ref_p), "backproject": _rel(got_b, ref_b)})
    _ray_points(record)
    _kplanes_tv(record, layouts["T2_C5_two_scales_aniso"], rays(3, 11))
    return out


def _kplanes_tv(record, lay, pts):
    """The features and plane TV in one op (its backward adds the interpolation's plane gradient to
    the TV's buffer) against the two twins, and with only one of its outputs used."""
    import torch

    from fasttomo.kernels import reference

    res = [v for r in lay.resolutions for v in r]
    pts = pts.requires_grad_()
    M = torch.linalg.qr(torch.randn(lay.n_rot, 3, 3))[0].requires_grad_()
    x = torch.randn(lay.numel).requires_grad_()
    f, tv = torch.ops.fasttomo.tilted_kplanes_tv(pts, M, x, lay.n_rot, lay.channels, res, False, False)
    fr, tvr = reference.tilted_kplanes(pts, M, x, lay), reference.plane_tv(x, lay)
    g, gt = torch.randn_like(fr), torch.tensor(0.7)
    gg = torch.autograd.grad([f, tv], [pts, M, x], [g, gt], retain_graph=True)
    gr = torch.autograd.grad([fr, tvr], [pts, M, x], [g, gt], retain_graph=True)
    errs = {"out": _rel(f, fr), "tv": _rel(tv, tvr), "d_points": _rel(gg[0], gr[0]), "d_matrices": _rel(gg[1], gr[1]),
            "d_planes": _rel(gg[2], gr[2])}
    errs["tv_alone"] = _rel(torch.autograd.grad(tv, [x], gt, retain_graph=True)[0],
                            torch.autograd.grad(tvr, [x], gt, retain_graph=True)[0])
    errs["features_alone"] = _rel(torch.autograd.grad(f, [x], g)[0], torch.autograd.grad(fr, [x], g)[0])
    record("kplanes_tv", errs)


def _ray_points(record):
    """The rays' samples against the twin, bit for bit: rays that miss the box, a ray with a NaN
    origin, S and B * S not multiples of the kernel's block."""
    import torch

    from fasttomo.geometry.rays import INSIDE_TOL, Box, ray_segments, segment_samples
    from fasttomo.geometry.so3 import rot_y, rot_z
    from fasttomo.kernels.triton import rays

    box = Box((5, 12, 9))
    B = 37
    R = rot_y(torch.deg2rad(torch.rand(B) * 120 - 60)) @ rot_z(torch.randn(B) * 0.1)
    shift = torch.randn(B, 2) * 3
    for S in (13, 1, 64):
        seg = ray_segments(torch.randint(0, 12, (B,)), torch.randint(-4, 14, (B,)), R, shift, (12, 9), box, S)
        seg.origin[int(seg.hit.nonzero()[0])] = float("nan")  # a ray that hits: its points NaN
        ref = segment_samples(seg, box, S)
        pts, inside = rays.ray_points(seg.origin, seg.direction, seg.t_in, seg.dt, seg.hit, box.half_extent, S,
                                      1.0 + INSIDE_TOL)
        nan = ref.points.isnan()
        record(f"ray_points[S{S}]", {
            "points_differ": float((pts != ref.points)[~nan].sum()) + float(not torch.equal(pts.isnan(), nan)),
            "inside_differ": float((inside != ref.inside).sum()),
            "misses_and_nan_present": float(bool(seg.hit.all()) or not bool(nan.any()))})


# ------------------------------------------------------------------------------------- pytest side
NAMES = (
    [f"kplanes[{l}-{p}]" for l in ("T2_C5_two_scales_aniso", "T1_C3_one_scale", "T3_C16_rect")
     for p in ("random_outside", "rays")]
    + ["kplanes[texel_runs_dense_rays]", "kplanes[stride0_grad]", "kplanes[bf16_out]",
       "kplanes[bf16_planes]", "kplanes[create_graph]"]
    + [f"plane_tv[{l}]" for l in ("T2_C5_two_scales_aniso", "T1_C3_one_scale", "T3_C16_rect", "T2_C8_strips")]
    + [f"volume_tv[{s}-{k}]" for s in ("5x6x7", "2x3x2x5", "2x2x2") for k in ("squared", "l1")]
    + ["tomo[int64=False]", "tomo[int64=True]"]
    + [f"ray_points[S{s}]" for s in (13, 1, 64)] + ["kplanes_tv"]
    + [f"decoder_mlp[{c}]" for c in ("n300-f20-h32", "n37-f48-h16", "n5-f64-h64")]
    + [f"decoder_mlp_wide[{c}]" for c in ("n77-f96-h32", "n40-f200-h16")]
    + [f"decoder_mlp_bf16[{c}-{d}]" for c in ("n300-f20-h32", "n45-f64-h64") for d in ("bfloat16", "float32")]
)


@pytest.fixture(scope="module")
def interp_results():
    from cli_helpers import run_interpreted  # tests/ is on sys.path under pytest (not when run as a script)

    return run_interpreted(HERE)


@pytest.mark.parametrize("name", NAMES)
def test_interpreted_kernel_matches_twin(interp_results, name):
    assert name in interp_results, f"check {name} did not run; got {sorted(interp_results)}"
    r = interp_results[name]
    assert r["ok"], f"{name}: relative errors {r['errors']}"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    print("RESULTS " + json.dumps(_checks()), flush=True)
