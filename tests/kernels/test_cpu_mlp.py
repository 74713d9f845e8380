"""The native CPU decoder (kernels/cpu_mlp.py) against its oracle, the twin
(``reference.decoder_mlp``, the calls of the ``nn.Sequential`` it stands for): values and every
gradient in float64 (tight) and float32, on widths that fill whole vectors and widths that leave
padding, point counts that leave tails (odd counts, partial blocks); thread counts; gradcheck and
double backward; the door's routing and spy; the Decoder module on it; no compiler."""

from __future__ import annotations

import itertools

import pytest
import torch

from fasttomo.kernels import cpu_mlp, dispatch, reference
from fasttomo.models.decoder import Decoder
from twin_checks import assert_double_backward_is_the_twins

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}
# (features, hidden): the default's whole vectors; padding of both; one unit; odd hidden rows
WIDTHS = [(32, 32), (12, 20), (1, 1), (40, 9)]


def _inputs(f: int, h: int, n: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g, dtype=dtype)
    ps = [torch.randn(h, f, generator=g, dtype=dtype) / f ** 0.5, torch.randn(h, generator=g, dtype=dtype) * 0.3,
          torch.randn(h, h, generator=g, dtype=dtype) / h ** 0.5, torch.randn(h, generator=g, dtype=dtype) * 0.3,
          torch.randn(1, h, generator=g, dtype=dtype), torch.randn(1, generator=g, dtype=dtype)]
    pre = x @ ps[0].T  # a first-layer bias near the median: about half the units cut by the ReLU
    ps[1] = ps[1] * (pre.std(dim=0) if n > 1 else 1.0) - pre.median(dim=0).values
    return x, ps


def _native_or_skip(dtype=torch.float64, f=2, h=2):
    if cpu_mlp.library(dtype, f, h) is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler)")


def _run(fn, x, ps, need_x, need_p, gout):
    leaves = [x.detach().clone().requires_grad_(need_x)] + [p.detach().clone().requires_grad_(need_p) for p in ps]
    out = fn(*leaves)
    wrt = [t for t in leaves if t.requires_grad]
    return out.detach(), (torch.autograd.grad(out, wrt, gout) if wrt else [])


@pytest.mark.parametrize("n", [1, 3, 130])  # 130: two blocks of 64 and a tail of 2
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("width", WIDTHS, ids=[f"F{f}_H{h}" for f, h in WIDTHS])
def test_values_and_gradients_match_the_twin(width, dtype, n):
    _native_or_skip(dtype, *width)
    x, ps = _inputs(*width, n, dtype)
    h1 = torch.relu(x @ ps[0].T + ps[1])
    assert n < 3 or ((h1 > 0).any() and (h1 == 0).any())  # both sides of the ReLU
    gout = torch.randn(n, dtype=dtype, generator=torch.Generator().manual_seed(1))
    native = lambda *t: cpu_mlp.decoder_mlp(*t, native=True)  # noqa: E731
    for need_x, need_p in itertools.product((False, True), repeat=2):
        ref, gref = _run(reference.decoder_mlp, x, ps, need_x, need_p, gout)
        got, ggot = _run(native, x, ps, need_x, need_p, gout)
        assert got.shape == ref.shape == (n,) and got.dtype == dtype
        torch.testing.assert_close(got, ref, **TOL[dtype])
        assert len(ggot) == len(gref) == need_x + 6 * need_p
        for a, b in zip(ggot, gref):
            assert a.shape == b.shape and a.dtype == dtype
            torch.testing.assert_close(a, b, **TOL[dtype])


def test_without_a_gradient_the_forward_is_the_same_bits():
    """No grad mode, or nothing requiring grad: the forward alone (nothing kept), same values."""
    _native_or_skip(torch.float32, 32, 32)
    x, ps = _inputs(32, 32, 301, torch.float32, seed=2)
    with_graph = cpu_mlp.decoder_mlp(x.requires_grad_(), *ps, native=True)
    assert with_graph.grad_fn is not None
    with torch.no_grad():
        assert torch.equal(cpu_mlp.decoder_mlp(x, *ps, native=True), with_graph.detach())
    assert torch.equal(cpu_mlp.decoder_mlp(x.detach(), *ps, native=True), with_graph.detach())


def test_thread_counts_agree():
    """The points are split among the workers: the output is the same bits, the weight gradients
    (per-worker sums added in a fixed order) agree to rounding."""
    _native_or_skip(torch.float64, 12, 20)
    x, ps = _inputs(12, 20, 517, torch.float64, seed=3)
    gout = torch.randn(517, dtype=torch.float64)
    before = torch.get_num_threads()
    res = []
    try:
        for nt in (1, 3):
            torch.set_num_threads(nt)
            res.append(_run(lambda *t: cpu_mlp.decoder_mlp(*t, native=True), x, ps, True, True, gout))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(res[0][0], res[1][0])
    assert torch.equal(res[0][1][0], res[1][1][0])  # dL/dx: per point, no cross-thread sum
    for a, b in zip(res[0][1][1:], res[1][1][1:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_and_double_backward_match_the_twin():
    """Finite differences in float64; a create_graph backward runs the twin's formula with a graph
    (spy: 'torch'), so second derivatives are the twin's."""
    _native_or_skip(torch.float64, 5, 7)
    x, ps = _inputs(5, 7, 9, torch.float64, seed=4)
    leaves = [t.clone().requires_grad_() for t in (x, *ps)]
    assert torch.autograd.gradcheck(lambda *t: cpu_mlp.decoder_mlp(*t, native=True), leaves, eps=1e-7, atol=1e-6)
    assert_double_backward_is_the_twins(lambda *t: cpu_mlp.decoder_mlp(*t, native=True), reference.decoder_mlp,
                                        (x, *ps), "decoder_mlp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_door_routes_cpu_inputs_to_the_native_path(dtype):
    _native_or_skip(dtype, 12, 20)
    x, ps = _inputs(12, 20, 40, dtype, seed=5)
    ps = [p.requires_grad_() for p in ps]
    dispatch.decoder_mlp(x, *ps).sum().backward()
    assert dispatch.counters == {"decoder_mlp": {"cpu": 1}, "decoder_mlp_bwd": {"cpu": 1}}
    gref = torch.autograd.grad(reference.decoder_mlp(x, *ps).sum(), ps)
    for p, g in zip(ps, gref):
        torch.testing.assert_close(p.grad, g, **TOL[dtype])


def test_backend_torch_autocast_and_other_dtypes_take_the_twin():
    x, ps = _inputs(12, 20, 40, torch.float32, seed=6)
    dispatch.configure("torch")
    assert torch.equal(dispatch.decoder_mlp(x, *ps), reference.decoder_mlp(x, *ps))
    dispatch.configure("auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dispatch.decoder_mlp(x, *ps).dtype == torch.bfloat16  # autocast's, as nn.Linear's
        assert "autocast" in dispatch._why_not_cpu_mlp(x, ps)
    dispatch.decoder_mlp(x.bfloat16(), *(p.bfloat16() for p in ps))
    assert dispatch.counters == {"decoder_mlp": {"torch": 3}}
    assert "differ" in dispatch._why_not_cpu_mlp(x.double(), ps)
    assert "cuda" in dispatch._why_not_native_mlp(torch.device("cuda"), torch.float32)  # no device needed to ask
    assert "dtype" in dispatch._why_not_cpu_mlp(x.bfloat16(), [p.bfloat16() for p in ps])


def test_the_decoder_module_runs_on_the_door():
    """Decoder(kind=hybrid) calls the door with its nn.Linear parameters: the same values as its
    nn.Sequential, gradients into the same parameters, the same state_dict keys."""
    _native_or_skip(torch.float32, 24, 16)
    dec = Decoder(24, "hybrid", 16, generator=torch.Generator().manual_seed(7))
    x = torch.randn(300, 24, requires_grad=True)
    out = dec(x)
    assert dispatch.counters["decoder_mlp"] == {"cpu": 1}
    ref = dec.net(x).squeeze(-1)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in dec.named_parameters()}
    dec.zero_grad()
    ref.square().sum().backward()
    for n, p in dec.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, **TOL[torch.float32])
    assert list(dec.state_dict()) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias", "net.4.weight",
                                      "net.4.bias"]
    assert dec.evaluates_natively() and not Decoder(24, "linear").evaluates_natively()
    dispatch.configure("torch")
    assert not dec.evaluates_natively()  # the rendering passes then count its hidden layers
    dispatch.configure("auto")
    lin = Decoder(24, "linear")
    torch.testing.assert_close(lin(x), lin.net(x).squeeze(-1), rtol=0, atol=0)
    assert dispatch.counters["decoder_mlp"] == {"cpu": 1}  # the linear head is one nn.Linear


def test_no_compiler_or_too_wide_keeps_the_twin(monkeypatch, tmp_path):
    x, ps = _inputs(6, 4, 20, torch.float64, seed=8)
    monkeypatch.setattr(cpu_mlp, "_libs", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_mlp.library(torch.float64, 6, 4) is None
    assert "could not be built" in dispatch._why_not_cpu_mlp(x, ps)
    torch.testing.assert_close(dispatch.decoder_mlp(x, *ps), reference.decoder_mlp(x, *ps), rtol=0, atol=0)
    assert dispatch.counters == {"decoder_mlp": {"torch": 1}}
    with pytest.raises(RuntimeError, match="native CPU kernels could not be built"):
        cpu_mlp.decoder_mlp(x, *ps, native=True)
    assert cpu_mlp.library(torch.float32, cpu_mlp.MAX_FEATURES + 1, 4) is None
    assert cpu_mlp.library(torch.float32, 4, cpu_mlp.MAX_HIDDEN + 1) is None
    wide = dispatch._why_not_native_mlp(torch.device("cpu"), torch.float32, cpu_mlp.MAX_FEATURES + 1, 4)
    assert "wider than the native kernels take" in wide and "see the log" not in wide


@pytest.mark.parametrize("width", [(32, 32), (12, 20)], ids=["whole_vectors", "padded"])
def test_nan_and_inf_propagate_as_in_the_twin(width):
    """torch.relu keeps NaN and its gradient passes where the result is not <= 0: a NaN feature or
    weight must reach the output and the gradients as in the twin (a masked NaN would hide a
    diverged model from the guard), and an infinite feature must not leak NaN through the padded
    hidden units (0 * inf)."""
    f, h = width
    _native_or_skip(torch.float32, f, h)
    x, ps = _inputs(f, h, 12, torch.float32, seed=9)
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), -float("inf")
    gout = torch.ones(12)
    native = lambda *t: cpu_mlp.decoder_mlp(*t, native=True)  # noqa: E731
    ref, gref = _run(reference.decoder_mlp, x, ps, True, True, gout)
    got, ggot = _run(native, x, ps, True, True, gout)
    assert ref[1].isnan() and ref[[0, 4]].isfinite().all()
    torch.testing.assert_close(got, ref, equal_nan=True, **TOL[torch.float32])
    for a, b in zip(ggot, gref):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-4, atol=1e-4)
    x, ps = _inputs(f, h, 5, torch.float32, seed=10)
    ps[2][0, 0] = float("nan")  # one NaN weight of the second layer
    ref, gref = _run(reference.decoder_mlp, x, ps, True, True, torch.ones(5))
    got, ggot = _run(native, x, ps, True, True, torch.ones(5))
    assert ref.isnan().all() and got.isnan().all()
    assert [int(g.isnan().sum()) for g in ggot] == [int(g.isnan().sum()) for g in gref]


def test_weights_of_other_shapes_take_the_twin():
    """The C code reads the weights by the widths of x and w1: any other shape takes the twin, which
    raises (or computes) as the nn.Linear calls do, instead of reading past a buffer."""
    _native_or_skip(torch.float32, 8, 16)
    x, ps = _inputs(8, 16, 5, torch.float32, seed=11)
    bad = {0: torch.randn(16, 4), 1: torch.randn(4), 2: torch.randn(16, 8), 4: torch.randn(16)}
    for i, w in bad.items():
        qs = list(ps)
        qs[i] = w
        assert "not the hybrid decoder's" in dispatch._why_not_cpu_mlp(x, qs)
        with pytest.raises(RuntimeError):
            dispatch.decoder_mlp(x, *qs)
        with pytest.raises(RuntimeError, match="cannot take this call"):
            cpu_mlp.decoder_mlp(x, *qs, native=True)
    qs = list(ps)
    qs[4] = torch.randn(2, 16)  # two outputs: the twin's (N, 2), not the first row's
    assert dispatch.decoder_mlp(x, *qs).shape == reference.decoder_mlp(x, *qs).shape == (5, 2)
    assert dispatch.counters == {"decoder_mlp": {"torch": 5}}
    qs = [p.double() for p in ps]
    assert "differ" in cpu_mlp.unsupported(x, qs)
    torch.testing.assert_close(cpu_mlp.decoder_mlp(x.double(), *qs), reference.decoder_mlp(x.double(), *qs))
