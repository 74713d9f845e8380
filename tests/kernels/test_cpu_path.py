"""The CPU path of tilted_kplanes (kernels/cpu.py) against its oracle, the pure-torch twin
(kernels/reference.py): forward values and the three gradients in float64 (tight) and float32,
on several layouts, points partly outside the box (border clamping), every combination of inputs
needing a gradient; gradcheck; double backward; what the backward asks of aten; the door's spy."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fasttomo.kernels import cpu, cpu_native, dispatch, reference
from fasttomo.kernels.layout import PlaneLayout
from twin_checks import assert_double_backward_is_the_twins

LAYOUTS = {
    "T1_C2_cubic": PlaneLayout(1, 2, ((5, 5, 5),)),
    "T3_C8_4_345": PlaneLayout(3, 8, ((4, 4, 4), (3, 4, 5))),  # model.resolutions=[4, [3, 4, 5]]
    # runs of kinds sharing (H, W): [xy+xz, yz], [xy, xz+yz], three single kinds
    "T3_C2_three_scales": PlaneLayout(3, 2, ((6, 4, 4), (4, 4, 7), (3, 5, 6))),
    "T1_C8_two_scales": PlaneLayout(1, 8, ((7, 6, 5), (4, 4, 4))),
    # 12 channels: the native backward's whole vectors (8 floats, 4 doubles) and a tail of 4 floats
    "T2_C12_vectors_and_tail": PlaneLayout(2, 12, ((5, 4, 6),)),
}
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _inputs(lay: PlaneLayout, n: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pts = torch.rand(n, 3, generator=g, dtype=dtype) * 2.8 - 1.4  # partly outside [-1, 1]^3
    M = torch.linalg.qr(torch.randn(lay.n_rot, 3, 3, generator=g, dtype=dtype))[0] * 1.1
    x = torch.randn(lay.numel, generator=g, dtype=dtype)
    return pts, M, x


def _grads(fn, pts, M, x, lay, need, gout):
    leaves = [t.detach().clone().requires_grad_(r) for t, r in zip((pts, M, x), need)]
    out = fn(*leaves, lay)
    wrt = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(out, wrt, gout) if wrt else []
    return out.detach(), got


def _native_or_skip(native):
    if native and cpu_native.library(torch.float64, 2) is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler)")
    return native


@pytest.mark.parametrize("native", [False, True], ids=["aten", "native"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lname", list(LAYOUTS))
def test_values_and_gradients_match_the_twin(lname, dtype, native):
    """Both implementations of the CPU path (aten's grid sampler; the C kernels of cpu_native)."""
    fn = functools.partial(cpu.tilted_kplanes, native=_native_or_skip(native))
    lay = LAYOUTS[lname]
    pts, M, x = _inputs(lay, 97, dtype)
    q = torch.einsum("tij,nj->tni", M, pts)
    assert (q.abs() > 1).any() and (q.abs() < 1).all(dim=-1).any()  # clamped and inner points both
    gout = torch.randn(pts.shape[0], lay.n_features, dtype=dtype, generator=torch.Generator().manual_seed(1))
    for need in itertools.product((False, True), repeat=3):
        ref, gref = _grads(reference.tilted_kplanes, pts, M, x, lay, need, gout)
        got, ggot = _grads(fn, pts, M, x, lay, need, gout)
        assert got.shape == ref.shape == (pts.shape[0], lay.n_features) and got.dtype == dtype
        torch.testing.assert_close(got, ref, **TOL[dtype])
        assert len(ggot) == len(gref) == sum(need)
        for a, b in zip(ggot, gref):
            assert a.dtype == dtype
            torch.testing.assert_close(a, b, **TOL[dtype])


def test_fp32_forward_is_the_twin_bit_for_bit():
    """The aten path: same q, same grid values, same product order: the fp32 features are
    identical, with a graph (the autograd Function), without one (nothing requires grad) and
    under no_grad. (The native kernels round differently: within TOL, tested above.)"""
    for lay in LAYOUTS.values():
        pts, M, x = _inputs(lay, 200, torch.float32, seed=3)
        ref = reference.tilted_kplanes(pts, M, x, lay)
        assert torch.equal(cpu.tilted_kplanes(pts, M, x, lay, native=False), ref)
        x.requires_grad_()
        out = cpu.tilted_kplanes(pts, M, x, lay, native=False)
        assert out.requires_grad and torch.equal(out.detach(), ref)
        with torch.no_grad():
            out = cpu.tilted_kplanes(pts, M, x, lay, native=False)
        assert not out.requires_grad and torch.equal(out, ref)


def test_expanded_and_strided_output_gradients():
    """Autograd hands backward expanded (stride-0) gradients, e.g. of .sum(); and a column slice
    of a larger gradient is strided."""
    lay = LAYOUTS["T3_C8_4_345"]
    pts, M, x = _inputs(lay, 31, torch.float64, seed=4)
    for fn_out in (lambda o: o.sum(), lambda o: (torch.cat([o, o], 1)[:, ::2] * 1.5).sum()):
        got = torch.autograd.grad(fn_out(cpu.tilted_kplanes(pts.requires_grad_(), M.requires_grad_(),
                                                            x.requires_grad_(), lay)), [pts, M, x])
        ref = torch.autograd.grad(fn_out(reference.tilted_kplanes(pts, M, x, lay)), [pts, M, x])
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck_float64():
    lay = PlaneLayout(2, 2, ((3, 4, 3), (4, 3, 3)))
    pts, M, x = _inputs(lay, 6, torch.float64, seed=5)
    # keep points off texel edges, where bilinear sampling has kinks finite differences straddle
    assert torch.autograd.gradcheck(lambda p, m, v: cpu.tilted_kplanes(p, m, v, lay),
                                    (pts.requires_grad_(), M.requires_grad_(), x.requires_grad_()),
                                    eps=1e-7, atol=1e-6)


def test_double_backward_matches_the_twin():
    """A create_graph backward runs the twin's formula with a graph (spy: 'torch'); the second
    derivatives are the twin's."""
    lay = LAYOUTS["T3_C8_4_345"]
    pts, M, x = _inputs(lay, 23, torch.float64, seed=6)
    assert_double_backward_is_the_twins(lambda *t: cpu.tilted_kplanes(*t, lay),
                                        lambda *t: reference.tilted_kplanes(*t, lay), (pts, M, x), "tilted_kplanes")


class _AtenLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("need", [(False, False, True), (True, False, False), (False, True, True),
                                  (True, True, True)])
def test_backward_asks_aten_only_for_what_is_needed(need):
    """output_mask of grid_sampler_2d_backward follows needs_input_grad, and no full-size buffer
    is zero-filled for the plane gradient (every element is written by a copy)."""
    lay = PlaneLayout(2, 4, ((6, 6, 6), (9, 9, 9)))  # cubic: one batched call per scale
    pts, M, x = _inputs(lay, 50, torch.float32, seed=7)
    leaves = [t.clone().requires_grad_(r) for t, r in zip((pts, M, x), need)]
    out = cpu.tilted_kplanes(*leaves, lay, native=False)
    with _AtenLog() as log:
        torch.autograd.grad(out, [t for t in leaves if t.requires_grad], torch.ones_like(out))
    bw = [a for f, a in log.calls if f is torch.ops.aten.grid_sampler_2d_backward.default]
    assert len(bw) == lay.n_scales
    assert all(list(a[6]) == [need[2], need[0] or need[1]] for a in bw)
    zeroed = [f for f, a in log.calls if f in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default,
                                                torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)
              and a and isinstance(a[0], torch.Tensor) and a[0].numel() == lay.numel]
    assert not zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_door_routes_cpu_inputs_to_the_cpu_path(dtype):
    lay = LAYOUTS["T3_C8_4_345"]
    pts, M, x = _inputs(lay, 40, dtype, seed=8)
    x.requires_grad_()
    out = dispatch.tilted_kplanes(pts, M, x, lay)
    out.sum().backward()
    assert dispatch.counters == {"tilted_kplanes": {"cpu": 1}, "tilted_kplanes_bwd": {"cpu": 1}}
    (gref,) = torch.autograd.grad(reference.tilted_kplanes(pts, M, x, lay).sum(), [x])
    torch.testing.assert_close(x.grad, gref, **TOL[dtype])


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["cpu-path", "twin"])
def test_bf16_planes_sample_the_rounded_values_and_pass_gradients_through(backend):
    """precision.planes=bf16 on the CPU: the features and every gradient are those of the same path
    evaluated on the planes rounded to bf16 (bit for bit), the plane gradient reaches the fp32
    parameters unrounded, and the rounding is real (the features differ from fp32 planes')."""
    dispatch.configure(backend)
    lay = LAYOUTS["T3_C8_4_345"]
    pts, M, x = _inputs(lay, 60, torch.float32, seed=11)
    gout = torch.randn(60, lay.n_features, generator=torch.Generator().manual_seed(3))
    leaves = [t.clone().requires_grad_() for t in (pts, M, x)]
    out = dispatch.tilted_kplanes(*leaves, lay, planes_bf16=True)
    got = torch.autograd.grad(out, leaves, gout)
    rounded = x.to(torch.bfloat16).float()
    ref_leaves = [t.clone().requires_grad_() for t in (pts, M, rounded)]
    ref = dispatch.tilted_kplanes(*ref_leaves, lay)
    want = torch.autograd.grad(ref, ref_leaves, gout)
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[2].dtype == torch.float32 and not torch.equal(got[2], got[2].to(torch.bfloat16).float())
    assert not torch.equal(out, dispatch.tilted_kplanes(pts, M, x, lay))


def test_backend_torch_keeps_the_twin():
    dispatch.configure("torch")
    lay = LAYOUTS["T3_C8_4_345"]
    pts, M, x = _inputs(lay, 40, torch.float32, seed=9)
    x.requires_grad_()
    dispatch.tilted_kplanes(pts, M, x, lay).sum().backward()
    assert dispatch.counters == {"tilted_kplanes": {"torch": 1}}  # the twin's backward is autograd's


def test_autocast_other_dtypes_and_odd_buffers_take_the_twin():
    lay = LAYOUTS["T1_C2_cubic"]
    pts, M, x = _inputs(lay, 40, torch.float32, seed=10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dispatch.tilted_kplanes(pts, M, x, lay)
    assert out.dtype == torch.float32  # the twin keeps fp32 under autocast
    strided = torch.randn(2 * lay.numel)[::2]  # not contiguous: the twin's views still work
    torch.testing.assert_close(dispatch.tilted_kplanes(pts, M, strided, lay),
                               reference.tilted_kplanes(pts, M, strided.contiguous(), lay), rtol=0, atol=0)
    assert dispatch.counters == {"tilted_kplanes": {"torch": 2}}
    why = dispatch._why_not_cpu_kplanes(pts.bfloat16(), M.bfloat16(), x.bfloat16(), lay)
    assert why is not None and "dtype" in why
    assert dispatch._why_not_cpu_kplanes(pts, M, x, lay) is None


def test_layout_kind_runs_and_views():
    """The runs of kinds the CPU path batches: consecutive kinds of equal (H, W), whose views are
    the per-kind views back to back."""
    for lay in LAYOUTS.values():
        x = torch.arange(lay.numel, dtype=torch.float64)
        for l in range(lay.n_scales):
            runs = lay.kind_runs(l)
            assert [k for k0, k1, _, _ in runs for k in range(k0, k1)] == [0, 1, 2]
            for k0, k1, h, w in runs:
                assert all(lay.plane_shape(l, k) == (h, w) for k in range(k0, k1))
                assert torch.equal(lay.view_kinds(x, l, k0, k1),
                                   torch.cat([lay.view(x, l, k) for k in range(k0, k1)]))
            assert all(a[2:] != b[2:] for a, b in zip(runs, runs[1:]))  # maximal runs
    assert [r[:2] for r in LAYOUTS["T3_C2_three_scales"].kind_runs(0)] == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="differ"):
        LAYOUTS["T3_C2_three_scales"].view_kinds(torch.zeros(LAYOUTS["T3_C2_three_scales"].numel), 0, 0, 3)


def test_native_kernels_agree_across_thread_counts():
    """The points are split among the worker threads: the features are the same bits, the
    gradients (per-thread plane buffers and float64 matrix sums, added up in a fixed order) agree."""
    _native_or_skip(True)
    lay = LAYOUTS["T3_C8_4_345"]
    pts, M, x = _inputs(lay, 301, torch.float64, seed=11)
    gout = torch.randn(pts.shape[0], lay.n_features, dtype=torch.float64)
    before = torch.get_num_threads()
    res = []
    try:
        for nt in (1, 3):
            torch.set_num_threads(nt)
            res.append(_grads(functools.partial(cpu.tilted_kplanes, native=True), pts, M, x, lay,
                              (True, True, True), gout))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(res[0][0], res[1][0])
    for a, b in zip(res[0][1], res[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("native", [False, True], ids=["aten", "native"])
def test_non_finite_points_sample_the_border_as_the_twin(native):
    """A diverged pose gives NaN or infinite points: the twin sets NaN to the first texel and
    +-inf to the border (grid_sample's forward; its backward crashed the process on them), with a
    zero coordinate gradient; both CPU paths give the same values and gradients."""
    _native_or_skip(native)
    lay = LAYOUTS["T3_C8_4_345"]
    pts, M, x = _inputs(lay, 40, torch.float64, seed=13)
    bad = [(0, 0, float("nan")), (1, 1, float("inf")), (2, 2, -float("inf")), (3, 0, 1e30)]
    for i, j, v in bad:
        pts[i, j] = v
    gout = torch.randn(pts.shape[0], lay.n_features, dtype=torch.float64)
    ref, gref = _grads(reference.tilted_kplanes, pts, M, x, lay, (True, True, True), gout)
    assert ref.isfinite().all() and gref[0].isfinite().all() and gref[2].isfinite().all()
    assert (gref[0][:3] == 0).all()  # NaN and inf points: no coordinate gradient
    assert gref[1].isnan().all()  # the frames' gradient, sum of dq p^T, is NaN (0 * nan) as torch's
    got, ggot = _grads(functools.partial(cpu.tilted_kplanes, native=native), pts, M, x, lay, (True, True, True),
                       gout)
    torch.testing.assert_close(got, ref, **TOL[torch.float64])
    for a, b in zip(ggot, gref):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL[torch.float64])
    # the NaN point's q is NaN in every frame (0 * nan): the first texel of every plane, the
    # features of q = (-1, -1, -1)
    corner = reference.tilted_kplanes(torch.full((1, 3), -1.0, dtype=torch.float64),
                                      torch.eye(3, dtype=torch.float64).expand(lay.n_rot, 3, 3), x, lay)
    torch.testing.assert_close(ref[:1], corner, rtol=0, atol=0)


def test_native_kernels_fall_back_without_a_compiler(monkeypatch, tmp_path):
    lay = LAYOUTS["T1_C2_cubic"]
    pts, M, x = _inputs(lay, 20, torch.float64, seed=12)
    monkeypatch.setattr(cpu_native, "_libs", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_native.library(torch.float64, lay.channels) is None
    torch.testing.assert_close(cpu.tilted_kplanes(pts, M, x, lay), reference.tilted_kplanes(pts, M, x, lay),
                               **TOL[torch.float64])
    with pytest.raises(RuntimeError, match="native CPU kernels could not be built"):
        cpu.tilted_kplanes(pts, M, x, lay, native=True)
    assert cpu_native.library(torch.float64, cpu_native.MAX_CHANNELS + 1) is None  # too many channels


# ------------------------------------------------------------------------------------ plane TV
TV_LAYOUTS = dict(LAYOUTS, T2_C3_min_side=PlaneLayout(2, 3, ((2, 3, 2),)))


@pytest.mark.parametrize("impl", ["native", "aten"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lname", list(TV_LAYOUTS))
def test_plane_tv_value_and_gradient_match_the_twin(lname, dtype, impl, monkeypatch):
    """One pass per run of same-shaped kinds and the written-out gradient, against the twin's
    per-kind means and autograd (anisotropic runs, several scales, 2-texel sides): the native
    single pass (value and gradient together) and the aten passes it falls back to."""
    if impl == "aten":
        monkeypatch.setattr(cpu, "_tv_library", lambda *a: None)
    elif cpu._tv_library(torch.zeros(8, dtype=dtype), TV_LAYOUTS[lname]) is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler)")
    lay = TV_LAYOUTS[lname]
    x = torch.randn(lay.numel, dtype=dtype, generator=torch.Generator().manual_seed(3)).requires_grad_()
    got, ref = cpu.plane_tv(x, lay), reference.plane_tv(x, lay)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    (g,) = torch.autograd.grad(got * 1.7, [x])
    (r,) = torch.autograd.grad(ref * 1.7, [x])
    torch.testing.assert_close(g, r, **TOL[dtype])
    assert float(got) > 0


def test_plane_tv_gradcheck_and_double_backward():
    lay = TV_LAYOUTS["T3_C2_three_scales"]
    x = torch.randn(lay.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: cpu.plane_tv(t, lay), (x,))
    (g,) = torch.autograd.grad(cpu.plane_tv(x, lay), [x], create_graph=True)  # through the twin
    (gg,) = torch.autograd.grad(g.square().sum(), [x])
    (r,) = torch.autograd.grad(reference.plane_tv(x, lay), [x], create_graph=True)
    (rr,) = torch.autograd.grad(r.square().sum(), [x])
    torch.testing.assert_close(gg, rr, **TOL[torch.float64])


def test_plane_tv_of_constant_and_ramp_planes():
    """Hand-checked values: 0 for a constant buffer; a ramp of slope s along W in every plane
    gives s^2 per plane (every W difference is s, no H differences), averaged over the planes."""
    lay = PlaneLayout(2, 3, ((4, 4, 4),))
    assert float(cpu.plane_tv(torch.full((lay.numel,), 2.5), lay)) == 0.0
    x = torch.empty(lay.numel, dtype=torch.float64)
    for l in range(lay.n_scales):
        for k in range(3):
            v = lay.view(x, l, k)  # (T, H, W, C)
            v.copy_(0.3 * torch.arange(v.shape[2], dtype=torch.float64)[None, None, :, None].expand_as(v))
    assert float(cpu.plane_tv(x, lay)) == pytest.approx(0.09, rel=1e-12)


def test_the_door_routes_cpu_plane_tv_to_the_cpu_path_under_auto_only():
    lay = TV_LAYOUTS["T3_C8_4_345"]
    x = torch.randn(lay.numel).requires_grad_()
    dispatch.plane_tv(x, lay).backward()
    assert dispatch.counters == {"plane_tv": {"cpu": 1}, "plane_tv_bwd": {"cpu": 1}}
    dispatch.configure("torch")
    dispatch.plane_tv(x, lay)
    assert dispatch.counters["plane_tv"] == {"cpu": 1, "torch": 1}
    dispatch.configure("auto")
    assert "contiguous" in dispatch._why_not_cpu_plane_tv(torch.zeros(2 * lay.numel)[::2], lay)
    assert "bfloat16" in dispatch._why_not_cpu_plane_tv(torch.zeros(lay.numel, dtype=torch.bfloat16), lay)
