"""GPU suite of the fused kernels: parity with the twins, opcheck, dispatch spy, autocast,
torch.compile and CUDA-graph capture. Skipped (with the reason) where CUDA or triton is missing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fasttomo.kernels import dispatch, reference
from fasttomo.kernels.layout import PlaneLayout

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON),
                                 reason="needs a CUDA GPU and triton (fused-kernel GPU suite)")]

LAYOUTS = {
    "flagshiplike_T8_C48_3scales": PlaneLayout(8, 48, ((13, 13, 13), (26, 26, 26), (50, 50, 50))),
    "aniso_T2_C5": PlaneLayout(2, 5, ((4, 6, 5), (17, 3, 9))),
    "T1_C16_one_scale_rect": PlaneLayout(1, 16, ((31, 7, 12),)),
    "T3_C20": PlaneLayout(3, 20, ((6, 5, 4), (11, 9, 8))),
}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _rays(n_rays, n_samples, device, spread=1.0):
    o = (torch.rand(n_rays, 1, 3, device=device) * 2 - 1) * spread
    d = torch.nn.functional.normalize(torch.randn(n_rays, 1, 3, device=device), dim=-1)
    s = torch.linspace(-1.2, 1.2, n_samples, device=device)[None, :, None]
    return (o + d * s).reshape(-1, 3).contiguous()


def _rot(T, device):
    q = torch.linalg.qr(torch.randn(T, 3, 3, device=device, dtype=torch.float64))[0]
    return (q + 0.05 * torch.randn_like(q)).float()  # not exactly orthogonal: general linear maps


def _off_edge(g, pts, M, lay, tol=1e-4):
    """g with the rows of points near a texel edge zeroed.

    The coordinate gradient of bilinear sampling jumps at texel edges, so where two fp32 codes
    round q = M p to different sides of an edge their point and rotation gradients differ by O(1)
    (measured: about 1 draw in 12 of 64 rays x 97 samples at the flagship-like layout fails a
    2e-5 norm check, for every backward variant alike). A point whose coordinates all lie more than
    `tol` texels from an edge (in float64, every scale and rotation) is on the same side for both.
    """
    q = torch.einsum("tij,nj->nti", M.detach().double(), pts.detach().double())
    near = torch.zeros(pts.shape[0], dtype=torch.bool, device=pts.device)
    for res in lay.resolutions:
        u = (q + 1) / 2 * (torch.tensor(res, dtype=torch.float64, device=pts.device) - 1)
        near |= ((u - u.round()).abs() < tol).any(-1).any(-1)
    assert near.float().mean() < 0.2, "too many points on texel edges for the check to mean much"
    return g * (~near).to(g.dtype)[:, None]


CASES = [(l, p) for l in LAYOUTS for p in ("rays", "uniform_outside", "odd_n")]


@pytest.mark.parametrize("lname,pkind", CASES)
def test_kplanes_parity(lname, pkind):
    """The door's path (default tuning) and both backward strategies, each forced by a frozen
    KPlanesTuning passed down (no module state changed), against the twin."""
    from fasttomo.kernels.triton import kplanes as kp
    lay, dev = LAYOUTS[lname], "cuda"
    if pkind == "rays":
        pts = _rays(64, 97, dev)
    elif pkind == "uniform_outside":
        pts = torch.rand(5000, 3, device=dev) * 3 - 1.5
    else:
        pts = torch.rand(1, 3, device=dev) * 2 - 1 if lname == "aniso_T2_C5" else torch.rand(333, 3, device=dev) * 2 - 1
    pts.requires_grad_()
    M = _rot(lay.n_rot, dev).requires_grad_()
    x = torch.randn(lay.numel, device=dev).requires_grad_()
    out = dispatch.tilted_kplanes(pts, M, x, lay)
    ref = reference.tilted_kplanes(pts, M, x, lay)
    assert dispatch.counters["tilted_kplanes"] == {"triton": 1}
    g = _off_edge(torch.randn_like(ref), pts, M, lay)
    gg = torch.autograd.grad(out, [pts, M, x], g)
    gr = torch.autograd.grad(ref, [pts, M, x], g)
    assert dispatch.counters["tilted_kplanes_bwd"] == {"triton": 1}
    errs = {"out": rel(out, ref), "points": rel(gg[0], gr[0]), "matrices": rel(gg[1], gr[1]),
            "planes": rel(gg[2], gr[2])}
    for tuning in (kp.KPlanesTuning(backward="runs", min_programs_per_sm=0),
                   kp.KPlanesTuning(backward="pairs")):
        assert kp.backward_strategy(pts.shape[0], lay.n_rot, pts.device, tuning) == tuning.backward
        gp, dq, gm = kp.kplanes_backward(g, pts.detach(), M.detach(), x.detach(), lay, True, tuning,
                                         need_gm=True)
        errs[f"planes_{tuning.backward}"] = rel(gp, gr[2])
        errs[f"points_{tuning.backward}"] = rel(torch.einsum("itn,tij->nj", dq, M.detach()), gr[0])
        errs[f"matrices_{tuning.backward}"] = rel(gm, gr[1])  # the kernel's partial sums
        # per-program partials added up in a fixed order: the same bits on every call (atomics
        # were not, and a captured-vs-eager training test then failed 2 of 3 suites at a3a6832)
        gm2 = kp.kplanes_backward(g, pts.detach(), M.detach(), x.detach(), lay, True, tuning, need_gm=True)[2]
        assert torch.equal(gm, gm2)
        # without dq the kernel is compiled apart (its float contractions may differ): close, not
        # equal bits
        gm3 = kp.kplanes_backward(g, pts.detach(), M.detach(), x.detach(), lay, False, tuning, need_gm=True)[2]
        errs[f"matrices_{tuning.backward}_no_dq"] = rel(gm3, gr[1])
    assert max(errs.values()) < 2e-5, errs
    assert torch.isfinite(out).all()


def test_small_problems_take_the_pair_merge_backward():
    from fasttomo.kernels.triton import kplanes as kp
    dev = torch.device("cuda")
    tu = kp.DEFAULT_TUNING
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if sms * tu.min_programs_per_sm > 768:  # an H200 (132 SMs); not a small GPU
        assert kp.backward_strategy(1024 * 48, 2, dev) == "pairs"  # embedded default
    assert kp.backward_strategy(8192 * 200, 8, dev) == tu.backward == "runs"  # flagship
    edge = tu.min_programs_per_sm * sms * tu.run_rows * tu.run_len
    assert kp.backward_strategy(edge, 1, dev) == "runs"
    assert kp.backward_strategy(edge - tu.run_rows * tu.run_len, 1, dev) == "pairs"
    assert kp.backward_strategy(10, 1, torch.device("cpu")) == "runs"
    never = kp.KPlanesTuning(min_programs_per_sm=0)
    assert kp.backward_strategy(10, 1, dev, never) == "runs"


def test_kplanes_planes_only_and_stride0_grad():
    lay = LAYOUTS["T3_C20"]
    pts, M = torch.rand(1000, 3, device="cuda") * 2 - 1, _rot(3, "cuda")
    x = torch.randn(lay.numel, device="cuda", requires_grad=True)
    (a,) = torch.autograd.grad(dispatch.tilted_kplanes(pts, M, x, lay).sum(), [x])  # expanded grad
    (b,) = torch.autograd.grad(reference.tilted_kplanes(pts, M, x, lay).sum(), [x])
    assert rel(a, b) < 2e-5


def test_kplanes_far_points_finite():
    lay = LAYOUTS["aniso_T2_C5"]
    pts = torch.tensor([[1e6, -1e6, 3e7], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], device="cuda")
    pts.requires_grad_()
    M, x = _rot(2, "cuda"), torch.randn(lay.numel, device="cuda", requires_grad=True)
    out = dispatch.tilted_kplanes(pts, M, x, lay)
    ref = reference.tilted_kplanes(pts, M, x, lay)
    assert torch.isfinite(out).all() and rel(out, ref) < 2e-5
    gp, gx = torch.autograd.grad(out.sum(), [pts, x])
    rp, rx = torch.autograd.grad(ref.sum(), [pts, x])
    assert torch.isfinite(gp).all() and rel(gx, rx) < 2e-5


def test_kplanes_non_finite_points_as_the_twin():
    """NaN and infinite points (a diverged pose): the fused kernels clamp them as the twin does (NaN
    to the first texel, +-inf to the border), no coordinate gradient, the same plane gradient."""
    lay = LAYOUTS["aniso_T2_C5"]
    pts = torch.rand(6, 3, device="cuda") * 2 - 1
    pts[0, 0], pts[1, 1], pts[2, 2] = float("nan"), float("inf"), -float("inf")
    pts.requires_grad_()
    M, x = _rot(2, "cuda"), torch.randn(lay.numel, device="cuda", requires_grad=True)
    out = dispatch.tilted_kplanes(pts, M, x, lay)
    ref = reference.tilted_kplanes(pts, M, x, lay)
    assert dispatch.counters["tilted_kplanes"] == {"triton": 1}
    assert torch.isfinite(out).all() and rel(out, ref) < 2e-5
    gp, gx = torch.autograd.grad(out.sum(), [pts, x])
    rp, rx = torch.autograd.grad(ref.sum(), [pts, x])
    assert (gp[:3] == 0).all() and torch.isfinite(gp).all() and rel(gx, rx) < 2e-5


def test_kplanes_bf16_autocast():
    lay = LAYOUTS["T3_C20"]
    pts, M = torch.rand(2000, 3, device="cuda") * 2 - 1, _rot(3, "cuda")
    x = torch.randn(lay.numel, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dispatch.tilted_kplanes(pts, M, x, lay)
    assert out.dtype == torch.bfloat16
    ref = reference.tilted_kplanes(pts, M, x, lay)
    assert rel(out.float(), ref) < 1e-2
    (gx,) = torch.autograd.grad(out.float().sum(), [x])
    (rx,) = torch.autograd.grad(ref.sum(), [x])
    assert gx.dtype == torch.float32 and rel(gx, rx) < 1e-5


def test_kplanes_bf16_planes_through_the_door():
    """precision.planes=bf16 on the GPU: the fused path (fp32 and bf16 features) matches the twin on
    the rounded planes, the plane gradient is fp32, and the door counts the fused path."""
    lay = LAYOUTS["T3_C20"]
    pts = (torch.rand(3000, 3, device="cuda") * 2 - 1).requires_grad_()
    M, x = _rot(3, "cuda").requires_grad_(), torch.randn(lay.numel, device="cuda", requires_grad=True)
    ref = reference.tilted_kplanes(pts, M, reference.bf16_planes(x), lay)
    g = _off_edge(torch.randn_like(ref), pts, M, lay)
    want = torch.autograd.grad(ref, [pts, M, x], g)
    dispatch.reset_counters()
    out = dispatch.tilted_kplanes(pts, M, x, lay, planes_bf16=True)
    got = torch.autograd.grad(out, [pts, M, x], g)
    assert dispatch.counters["tilted_kplanes"] == {"triton": 1} and got[2].dtype == torch.float32
    errs = {"out": rel(out, ref), **{k: rel(a, b) for k, a, b in zip(("points", "matrices", "planes"), got, want)}}
    assert max(errs.values()) < 2e-5, errs
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out16 = dispatch.tilted_kplanes(pts, M, x, lay, planes_bf16=True)
    assert out16.dtype == torch.bfloat16 and rel(out16.float(), ref) < 1e-2


def test_plane_tv_parity():
    for lay in LAYOUTS.values():
        x = torch.randn(lay.numel, device="cuda", requires_grad=True)
        out, ref = dispatch.plane_tv(x, lay), reference.plane_tv(x, lay)
        (g1,) = torch.autograd.grad(out * 3.0, [x])
        (g2,) = torch.autograd.grad(ref * 3.0, [x])
        assert rel(out, ref) < 1e-5 and rel(g1, g2) < 1e-5
    assert dispatch.counters["plane_tv"] == {"triton": len(LAYOUTS)}
    assert dispatch.counters["plane_tv_bwd"] == {"triton": len(LAYOUTS)}


@pytest.mark.parametrize("shape", [(2, 2, 2), (7, 5, 3), (2, 33, 64, 65), (128, 128, 129)])
@pytest.mark.parametrize("kind", ["squared", "l1"])
def test_volume_tv_parity(shape, kind):
    v = torch.randn(shape, device="cuda", requires_grad=True)
    out, ref = dispatch.volume_tv(v, kind), reference.volume_tv(v, kind)
    (g1,) = torch.autograd.grad(out * 0.7, [v])
    (g2,) = torch.autograd.grad(ref * 0.7, [v])
    assert rel(out, ref) < 1e-5 and rel(g1, g2) < 1e-5
    assert dispatch.counters["volume_tv"] == {"triton": 1}


# ------------------------------------------------------------------------------- spy and switch
def test_spy_kill_switch_cpu_dtype_create_graph():
    lay = LAYOUTS["aniso_T2_C5"]
    pts = (torch.rand(100, 3, device="cuda") * 2 - 1).requires_grad_()
    M, x = _rot(2, "cuda"), torch.randn(lay.numel, device="cuda", requires_grad=True)
    dispatch.configure("torch")
    dispatch.tilted_kplanes(pts, M, x, lay).sum().backward()
    dispatch.plane_tv(x, lay)
    dispatch.volume_tv(torch.randn(4, 4, 4, device="cuda"))
    assert dispatch.counters == {"tilted_kplanes": {"torch": 1}, "plane_tv": {"torch": 1},
                                 "volume_tv": {"torch": 1}}
    dispatch.configure("auto")
    dispatch.reset_counters()
    dispatch.tilted_kplanes(pts.detach().cpu(), M.cpu(), x.detach().cpu(), lay)  # CPU: kernels/cpu.py
    dispatch.tilted_kplanes(pts.double(), M.double(), x.double(), lay)  # CUDA fp64: the twin
    dispatch.volume_tv(torch.randn(4, 4, 4, device="cuda", dtype=torch.float64))
    dispatch.volume_tv(torch.randn(1, 4, 4, device="cuda"))  # a size-1 axis: twin
    assert dispatch.counters == {"tilted_kplanes": {"cpu": 1, "torch": 1}, "volume_tv": {"torch": 2}}
    dispatch.reset_counters()
    out = dispatch.tilted_kplanes(pts, M, x, lay)
    (gp,) = torch.autograd.grad(out.square().sum(), [pts], create_graph=True)
    assert dispatch.counters["tilted_kplanes"] == {"triton": 1}
    assert dispatch.counters["tilted_kplanes_bwd"] == {"torch": 1}
    (rp,) = torch.autograd.grad(reference.tilted_kplanes(pts, M, x, lay).square().sum(), [pts],
                                create_graph=True)
    assert rel(gp, rp) < 2e-5
    try:  # CUDA grid_sampler_2d_backward has no derivative in some torch versions: then both raise
        (rx,) = torch.autograd.grad(rp.sum(), [x], retain_graph=True)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            torch.autograd.grad(gp.sum(), [x])
    else:
        (gx,) = torch.autograd.grad(gp.sum(), [x])
        assert rel(gx, rx) < 2e-5
    dispatch.configure("triton")
    with pytest.raises(dispatch.KernelUnavailableError, match="float32"):
        dispatch.tilted_kplanes(pts.double(), M.double(), x.double(), lay)
    with pytest.raises(dispatch.KernelUnavailableError, match="CUDA"):
        dispatch.plane_tv(x.detach().cpu(), lay)


# ------------------------------------------------------------------------------- opcheck
def _opcheck(op, args):
    torch.library.opcheck(op, args)


def test_opcheck_tilted_kplanes():
    from fasttomo.kernels.triton import ops  # noqa: F401
    lay = LAYOUTS["aniso_T2_C5"]
    res = [v for r in lay.resolutions for v in r]
    pts = (torch.rand(50, 3, device="cuda") * 2 - 1).requires_grad_()
    M, x = _rot(2, "cuda").requires_grad_(), torch.randn(lay.numel, device="cuda", requires_grad=True)
    _opcheck(torch.ops.fasttomo.tilted_kplanes.default, (pts, M, x, 2, 5, res, False))
    _opcheck(torch.ops.fasttomo.tilted_kplanes.default, (pts.detach(), M.detach(), x, 2, 5, res, True))
    _opcheck(torch.ops.fasttomo.tilted_kplanes.default, (pts, M, x, 2, 5, res, False, True))  # bf16 planes
    g = torch.randn(50, lay.n_features, device="cuda")
    _opcheck(torch.ops.fasttomo.tilted_kplanes_bwd.default, (g, pts.detach(), M.detach(), x.detach(), 2, 5, res, True,
                                                             True))
    _opcheck(torch.ops.fasttomo.tilted_kplanes_bwd.default, (g, pts.detach(), M.detach(), x.detach(), 2, 5, res, False,
                                                             True))
    _opcheck(torch.ops.fasttomo.tilted_kplanes_bwd.default, (g, pts.detach(), M.detach(),
                                                             x.detach().to(torch.bfloat16), 2, 5, res, True, True))


def test_opcheck_tv():
    from fasttomo.kernels.triton import ops  # noqa: F401
    lay = LAYOUTS["T3_C20"]
    res = [v for r in lay.resolutions for v in r]
    x = torch.randn(lay.numel, device="cuda", requires_grad=True)
    _opcheck(torch.ops.fasttomo.plane_tv.default, (x, 3, 20, res))
    _opcheck(torch.ops.fasttomo.plane_tv_bwd.default, (torch.tensor(1.3, device="cuda"), x.detach(), 3, 20, res))
    v = torch.randn(2, 5, 6, 7, device="cuda", requires_grad=True)
    for l1 in (False, True):
        _opcheck(torch.ops.fasttomo.volume_tv.default, (v, l1))
        _opcheck(torch.ops.fasttomo.volume_tv_bwd.default, (torch.tensor(0.4, device="cuda"), v.detach(), l1))


# ------------------------------------------------------------------------------- compile, graphs
def _loss(pts, M, x, v, lay):
    f = dispatch.tilted_kplanes(pts, M, x, lay)
    return f.square().mean() + 0.1 * dispatch.plane_tv(x, lay) + 0.1 * dispatch.volume_tv(v, "l1")


def test_torch_compile_matches_eager():
    lay = LAYOUTS["T3_C20"]
    pts = (torch.rand(3000, 3, device="cuda") * 2 - 1).requires_grad_()
    M = _rot(3, "cuda").requires_grad_()
    x = torch.randn(lay.numel, device="cuda", requires_grad=True)
    v = torch.randn(8, 9, 10, device="cuda", requires_grad=True)
    ge = torch.autograd.grad(_loss(pts, M, x, v, lay), [pts, M, x, v])
    fn = torch.compile(lambda *a: _loss(*a, lay))
    gc = torch.autograd.grad(fn(pts, M, x, v), [pts, M, x, v])
    for a, b in zip(gc, ge):
        assert rel(a, b) < 1e-4


def test_cuda_graph_capture_replays():
    lay = LAYOUTS["T3_C20"]
    pts = (torch.rand(3000, 3, device="cuda") * 2 - 1).requires_grad_()
    M = _rot(3, "cuda").requires_grad_()
    x = torch.randn(lay.numel, device="cuda", requires_grad=True)
    v = torch.randn(8, 9, 10, device="cuda", requires_grad=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compiles the kernels, builds the plane-TV table
        for _ in range(2):
            torch.autograd.grad(_loss(pts, M, x, v, lay), [pts, M, x, v])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = torch.autograd.grad(_loss(pts, M, x, v, lay), [pts, M, x, v])
    with torch.no_grad():
        pts.copy_(torch.rand_like(pts) * 2 - 1)
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.autograd.grad(_loss(pts, M, x, v, lay), [pts, M, x, v])
    for a, b in zip(static, ref):
        assert rel(a, b) < 1e-5


# ------------------------------------------------------------------------------- the decoder
def _decoder(features=48, hidden=32, seed=0):
    from fasttomo.models.decoder import Decoder

    return Decoder(features, "hybrid", hidden, generator=torch.Generator().manual_seed(seed)).cuda()


def _grads(out, x, dec, g):
    return torch.autograd.grad(out.float(), [x, *dec.parameters()] if x.requires_grad else list(dec.parameters()), g)


def test_the_decoder_where_the_fused_kernels_do_not_apply_is_its_nn_sequential():
    """In fp32, and under bf16 autocast for widths the fused kernels do not take, with
    kernels.backend=torch or with kernels.gpu_decoder=cublas (under any backend), the
    Decoder takes the twin (path 'torch'): the same calls as its nn.Sequential, so outputs and
    gradients are its bits."""
    for features, hidden, autocast, backend, decoder in (
            (48, 32, False, "auto", "fused"), (96, 32, False, "auto", "fused"), (48, 128, True, "auto", "fused"),
            (1152, 128, True, "auto", "fused"), (96, 32, True, "auto", "cublas"),
            (48, 32, True, "torch", "fused"), (48, 32, True, "auto", "cublas"), (48, 32, True, "triton", "cublas")):
        dispatch.configure(backend, gpu_decoder=decoder)
        dec = _decoder(features, hidden)
        x = torch.randn(5000, features, device="cuda", requires_grad=True)
        dispatch.reset_counters()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out, ref = dec(x), dec.net(x).squeeze(-1)
        assert dispatch.counters == {"decoder_mlp": {"torch": 1}}, (features, hidden, autocast, backend, decoder)
        assert out.dtype == ref.dtype == (torch.bfloat16 if autocast else torch.float32)
        assert torch.equal(out, ref)
        g = torch.randn(5000, device="cuda")
        assert all(torch.equal(a, b) for a, b in zip(_grads(out, x, dec, g), _grads(ref, x, dec, g)))


@pytest.mark.parametrize("features,hidden", [(48, 32), (48, 64), (20, 16), (64, 64), (96, 32), (1152, 64)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_the_bf16_decoder_takes_the_fused_kernels_and_is_as_close_as_the_twin(features, hidden, x_dtype):
    """Under bf16 autocast, with kernels.gpu_decoder=fused, the Decoder takes the fused kernels (path
    'triton', fp32 output; features wider than 64 after cuBLAS's first product): output and every
    gradient (features bf16, as the fused interpolation writes them, or fp32) are as close to the
    fp32 decoder's as the bf16 twin's are, the backward is the same bits twice (its partial sums
    add in one order), and without dL/dx the weights' gradients are the same sums."""
    dispatch.configure("auto", gpu_decoder="fused")
    torch.manual_seed(0)  # fixed features and output gradient: the test compares two noisy errors
    dec = _decoder(features, hidden)
    n = 10007  # not a multiple of any block
    x = (torch.rand(n, features, device="cuda") * 2).to(x_dtype).requires_grad_()
    g = torch.randn(n, device="cuda")
    oracle = dec.net(x.float()).squeeze(-1)
    want = _grads(oracle, x, dec, g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        twin = dec.net(x).squeeze(-1)
        dispatch.reset_counters()
        out, again = dec(x), dec(x)
    assert dispatch.counters == {"decoder_mlp": {"triton": 2}} and out.dtype == torch.float32
    got, got_again, twin_g = _grads(out, x, dec, g), _grads(again, x, dec, g), _grads(twin, x, dec, g)
    assert dispatch.counters["decoder_mlp_bwd"] == {"triton": 2}
    assert got[0].dtype == x_dtype and all(a.dtype == torch.float32 for a in got[1:])
    assert all(torch.equal(a, b) for a, b in zip(got, got_again))
    errs = {"out": (rel(out, oracle), rel(twin.float(), oracle))}
    for name, a, t, w in zip(("x", "w1", "b1", "w2", "b2", "w3", "b3"), got, twin_g, want):
        errs[name] = (rel(a, w), rel(t, w))
    assert all(fused <= 1.5 * twin_err + 2e-3 for fused, twin_err in errs.values()), errs
    with torch.autocast("cuda", dtype=torch.bfloat16):
        weights_only = _grads(dec(x.detach()), x.detach(), dec, g)
    assert all(rel(a, b) < 1e-6 for a, b in zip(weights_only, got[1:]))  # another compile: same sums


def test_the_fused_decoder_double_backward_runs_the_twin():
    dispatch.configure("auto", gpu_decoder="fused")
    dec = _decoder()
    x = torch.randn(300, 48, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dec(x)
        ref = dec.net(x).squeeze(-1)
    dispatch.reset_counters()
    (gx,) = torch.autograd.grad(out.square().sum(), [x], create_graph=True)
    assert dispatch.counters == {"decoder_mlp_bwd": {"torch": 1}}
    (rx,) = torch.autograd.grad(ref.float().square().sum(), [x], create_graph=True)
    assert rel(gx, rx) < 2e-2
    w1 = dec.net[0].weight
    assert rel(torch.autograd.grad(gx.sum(), [w1])[0], torch.autograd.grad(rx.sum(), [w1])[0]) < 5e-2


def test_opcheck_decoder_mlp():
    from fasttomo.kernels.triton import ops  # noqa: F401
    dec = _decoder(20, 16)
    params = [p.detach().requires_grad_() for p in dec.parameters()]
    for x, bf16 in ((torch.randn(77, 20, device="cuda", dtype=torch.bfloat16, requires_grad=True), True),
                    (torch.randn(77, 20, device="cuda", requires_grad=True), False)):
        _opcheck(torch.ops.fasttomo.decoder_mlp.default, (x, *params, bf16))
        g = torch.randn(77, device="cuda")
        for need_dx in (True, False):
            _opcheck(torch.ops.fasttomo.decoder_mlp_bwd.default,
                     (g, x.detach(), *(p.detach() for p in params[:5]), bf16, need_dx))


def test_the_fused_decoder_in_a_captured_step():
    """The fused pair inside CUDA-graph capture: a replay on new features gives the eager bits."""
    dispatch.configure("auto", gpu_decoder="fused")
    dec = _decoder()
    x = torch.rand(4099, 48, device="cuda").to(torch.bfloat16).requires_grad_()
    params = [x, *dec.parameters()]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return torch.autograd.grad(dec(x).square().mean(), params)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        x.copy_(torch.rand_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(static, step()))


# ------------------------------------------------------------------------------- the rays' samples
def _segments(B, S, device, requires_grad=False):
    from fasttomo.geometry.rays import Box, ray_segments
    from fasttomo.geometry.so3 import rot_y, rot_z

    gen = torch.Generator(device="cpu").manual_seed(0)
    box = Box((40, 96, 80))
    R = (rot_y(torch.deg2rad(torch.rand(B, generator=gen) * 120 - 60))
         @ rot_z(torch.randn(B, generator=gen) * 0.05)).to(device)
    shift = (torch.randn(B, 2, generator=gen) * 4).to(device)
    if requires_grad:
        shift.requires_grad_()
    row = torch.randint(0, 96, (B,), generator=gen).to(device)
    col = torch.randint(-20, 100, (B,), generator=gen).to(device)  # some rays miss the box
    return ray_segments(row, col, R, shift, (96, 80), box, S), box


@pytest.mark.parametrize("S", [768, 37, 1])
def test_ray_samples_are_the_twins_bits(S):
    """The fused samples on CUDA: the twin's points and inside mask bit for bit (no contracted
    multiply-adds, an IEEE division), missed rays and a NaN origin included; the spy says triton."""
    from fasttomo.geometry.rays import segment_samples

    dispatch.configure("auto", step_fusion=True)
    seg, box = _segments(1000, S, "cuda")
    seg.origin[int(seg.hit.nonzero()[0])] = float("nan")
    assert not bool(seg.hit.all())
    ref = segment_samples(seg, box, S)
    got = dispatch.ray_samples(seg, box, S)
    assert dispatch.counters["ray_points"] == {"triton": 1}
    nan = ref.points.isnan()
    assert bool(nan.any()) and torch.equal(got.points.isnan(), nan)
    assert torch.equal(got.points[~nan], ref.points[~nan])
    assert torch.equal(got.inside, ref.inside) and got.dt is seg.dt


def test_ray_samples_with_learned_poses_run_the_twin_even_under_backend_triton():
    seg, box = _segments(64, 16, "cuda", requires_grad=True)
    dispatch.configure("triton", step_fusion=True)
    got = dispatch.ray_samples(seg, box, 16)
    assert dispatch.counters["ray_points"] == {"torch": 1} and got.points.requires_grad
    with torch.no_grad():  # validation: no gradient, the kernel
        dispatch.ray_samples(seg, box, 16)
    assert dispatch.counters["ray_points"] == {"torch": 1, "triton": 1}


def test_opcheck_ray_points():
    seg, box = _segments(50, 24, "cuda")
    _opcheck(torch.ops.fasttomo.ray_points.default,
             (seg.origin, seg.direction, seg.t_in, seg.dt, seg.hit, list(box.half_extent), 24, 1.00001))


# ------------------------------------------------------------------------------- features and plane TV
@pytest.mark.parametrize("planes_bf16", [False, True])
def test_kplanes_tv_in_one_op_matches_the_two(planes_bf16):
    """The features and plane TV of one op (its backward adds the interpolation's plane gradient to
    the TV's buffer) against the two ops, under bf16 autocast as a step calls them."""
    dispatch.configure("auto", step_fusion=True)
    lay = LAYOUTS["T3_C20"]
    pts = _rays(64, 48, "cuda")
    M = _rot(3, "cuda").requires_grad_()
    x = (torch.randn(lay.numel, device="cuda") * 0.5).requires_grad_()
    g = torch.randn(pts.shape[0], lay.n_features, device="cuda")
    outs = []
    for fused in (True, False):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if fused:
                f, tv = dispatch.tilted_kplanes_tv(pts, M, x, lay, planes_bf16)
            else:
                f, tv = dispatch.tilted_kplanes(pts, M, x, lay, planes_bf16), dispatch.plane_tv(x, lay)
        grads = torch.autograd.grad([f, tv], [M, x], [g.to(f.dtype), torch.tensor(2.5, device="cuda")])
        outs.append((f.float(), tv, *grads))
    assert dispatch.counters["tilted_kplanes_bwd"] == {"triton": 2} and dispatch.counters["plane_tv_bwd"] == {"triton": 2}
    for a, b in zip(*outs):
        assert rel(a, b) < 1e-5, (rel(a, b))


def test_opcheck_tilted_kplanes_tv():
    lay = LAYOUTS["aniso_T2_C5"]
    res = lay.flat_resolutions
    pts, M = _rays(16, 8, "cuda").requires_grad_(), _rot(2, "cuda").requires_grad_()
    x = torch.randn(lay.numel, device="cuda").requires_grad_()
    _opcheck(torch.ops.fasttomo.tilted_kplanes_tv.default, (pts, M, x, 2, 5, res, False, False))
    g = torch.randn(pts.shape[0], lay.n_features, device="cuda")
    _opcheck(torch.ops.fasttomo.tilted_kplanes_tv_bwd.default,
             (g, torch.tensor(0.3, device="cuda"), pts.detach(), M.detach(), x.detach(), 2, 5, res, True, True, False))
