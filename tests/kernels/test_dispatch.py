"""The kernel door on the CPU: routing, kill switch, env override, errors, spy, log-once, twins.

These need no GPU and no triton; the fast path itself is tested in test_kernels_interpret.py
(Triton interpreter) and test_kernels_gpu.py (device).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttomo.kernels import dispatch, reference
from fasttomo.kernels.layout import PlaneLayout

LAYOUT = PlaneLayout(2, 4, ((5, 4, 3), (9, 7, 6)))


def _inputs(n=17, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    pts = (torch.rand(n, 3, generator=g, dtype=dtype) * 2.4 - 1.2).requires_grad_()
    M = torch.linalg.qr(torch.randn(2, 3, 3, generator=g, dtype=dtype))[0]
    x = torch.randn(LAYOUT.numel, generator=g, dtype=dtype).requires_grad_()
    return pts, M, x


def test_import_does_not_import_triton():
    src = Path(__file__).resolve().parents[2] / "src"
    code = ("import sys; sys.path.insert(0, %r); import fasttomo.kernels.dispatch; "
            "assert 'triton' not in sys.modules, 'dispatch imported triton at import'" % str(src))
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("backend, kp_path", [("auto", "cpu"), ("torch", "torch")])
def test_cpu_tensors_take_the_twin_or_the_cpu_path(backend, kp_path):
    """On the CPU, tilted_kplanes takes its CPU path (kernels/cpu.py) under backend auto and the
    twin under backend torch, with the twin's values either way (the CPU path's native C kernels
    round differently: within fp32 rounding); plane TV takes its CPU path under auto too (same
    value to rounding), volume TV its twin."""
    dispatch.configure(backend)
    pts, M, x = _inputs()
    out = dispatch.tilted_kplanes(pts, M, x, LAYOUT)
    tol = dict(rtol=0, atol=0) if kp_path == "torch" else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out, reference.tilted_kplanes(pts, M, x, LAYOUT), **tol)
    torch.testing.assert_close(dispatch.plane_tv(x, LAYOUT), reference.plane_tv(x, LAYOUT), **tol)
    dispatch.volume_tv(torch.randn(3, 4, 5), "l1")
    assert dispatch.counters == {"tilted_kplanes": {kp_path: 1}, "plane_tv": {kp_path: 1},
                                 "volume_tv": {"torch": 1}}


def test_backend_triton_refuses_cpu_input_with_a_clear_error():
    try:
        dispatch.configure("triton")
    except dispatch.KernelUnavailableError as e:  # no triton here: refused at configure
        assert "triton" in str(e)
        return
    pts, M, x = _inputs()
    with pytest.raises(dispatch.KernelUnavailableError, match="CUDA"):
        dispatch.tilted_kplanes(pts, M, x, LAYOUT)
    with pytest.raises(dispatch.KernelUnavailableError, match="CUDA"):
        dispatch.volume_tv(torch.randn(3, 4, 5))


def test_the_config_is_the_only_source(monkeypatch):
    """The old FASTTOMO_KERNELS variable is not read: the backend is the one the run's config
    names (checked at build time and recorded with the run)."""
    monkeypatch.setenv("FASTTOMO_KERNELS", "torch")
    assert dispatch.configure("auto") == "auto" and dispatch.backend() == "auto"
    monkeypatch.setenv("FASTTOMO_KERNELS", "bogus")
    assert dispatch.configure("torch") == "torch"


def test_triton_unavailable_error_names_a_real_install_route(monkeypatch):
    monkeypatch.setattr(dispatch, "_ops_module", None)
    monkeypatch.setattr(dispatch, "_ops_error", "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(dispatch.KernelUnavailableError) as e:
        dispatch.configure("triton")
    msg = str(e.value)
    assert "pip install triton" in msg and "kernels.backend=auto" in msg
    assert "fasttomo[" not in msg  # no such extra in pyproject.toml


def test_the_door_has_no_import_cycle():
    """triton/ops.py counts through kernels/counters.py, not through the door; the counters the
    door shows are that module's table."""
    from fasttomo.kernels import counters

    ops_src = (Path(__file__).resolve().parents[2] / "src/fasttomo/kernels/triton/ops.py").read_text()
    assert "dispatch" not in ops_src.split('"""', 2)[2]  # code, not the docstring
    assert dispatch.counters is counters.counters
    counters.count("x", "torch")
    assert dispatch.counters == {"x": {"torch": 1}}
    dispatch.reset_counters()
    assert counters.counters == {}


def test_invalid_backend_and_kind():
    with pytest.raises(ValueError, match="kernels.backend"):
        dispatch.configure("cuda")
    with pytest.raises(ValueError, match="kind"):
        dispatch.volume_tv(torch.randn(3, 3, 3), "l2")


@pytest.mark.parametrize("backend, path", [("auto", "cpu"), ("torch", "torch")])
def test_choice_logged_once(caplog, backend, path):
    dispatch.configure(backend)
    pts, M, x = _inputs()
    with caplog.at_level(logging.INFO, logger="fasttomo.kernels"):
        for _ in range(3):
            dispatch.tilted_kplanes(pts, M, x, LAYOUT)
    lines = [r.getMessage() for r in caplog.records if "tilted_kplanes ->" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"kernels: tilted_kplanes -> {path}"), lines
    assert dispatch.counters["tilted_kplanes"] == {path: 3}


def test_twins_small_cases():
    # plane_tv of a constant buffer is 0; of a ramp along W it is known in closed form
    lay = PlaneLayout(1, 1, ((3, 2, 2),))
    assert float(reference.plane_tv(torch.ones(lay.numel), lay)) == 0.0
    v = torch.zeros(4, 5, 6)
    v[..., :] = torch.arange(6.0)
    torch.testing.assert_close(reference.volume_tv(v, "squared"), torch.tensor(1.0))
    torch.testing.assert_close(reference.volume_tv(v * 2, "l1"), torch.tensor(2.0))


def test_reference_coordinates_stay_fp32_under_bf16_autocast():
    """Under bf16 autocast the sample coordinates must not be rounded to bf16 (~0.004 steps,
    about one texel at resolution 512): the features equal the fp32 ones."""
    import torch

    from fasttomo.kernels import reference
    from fasttomo.kernels.layout import PlaneLayout

    g = torch.Generator().manual_seed(0)
    lay = PlaneLayout(2, 3, ((512, 512, 512),))
    planes = torch.rand(lay.numel, generator=g)
    pts = torch.rand(200, 3, generator=g) * 2 - 1
    mats = torch.linalg.qr(torch.randn(2, 3, 3, generator=g))[0] / 3**0.5
    ref = reference.tilted_kplanes(pts, mats, planes, lay)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = reference.tilted_kplanes(pts, mats, planes, lay)
    torch.testing.assert_close(got.float(), ref, rtol=1e-6, atol=1e-6)


def test_the_gpu_decoder_choice_is_checked_and_leaves_the_cpu_decoder_as_it_was():
    """kernels.gpu_decoder takes cublas or fused (a wrong value is refused naming the choices);
    fused concerns CUDA bf16 training alone: a CPU decoder gives the same bits either way and never
    takes the fused path. The door's width limits are the fused kernels' own; wider features take
    them after cuBLAS's first product where the hidden width is theirs."""
    from fasttomo.models.decoder import Decoder

    with pytest.raises(ValueError, match=r"kernels.gpu_decoder must be one of \['cublas', 'fused'\], got 'fast'"):
        dispatch.configure("auto", gpu_decoder="fast")
    dec = Decoder(48, "hybrid", 32, generator=torch.Generator().manual_seed(0))
    x = torch.randn(300, 48, generator=torch.Generator().manual_seed(1))
    outs = []
    for choice in ("cublas", "fused"):
        dispatch.configure("auto", gpu_decoder=choice)
        dispatch.reset_counters()
        outs.append(dec(x))
        assert "triton" not in dispatch.counters["decoder_mlp"], dispatch.counters
    assert torch.equal(outs[0], outs[1])
    pytest.importorskip("triton")
    from fasttomo.kernels.triton import mlp

    assert (dispatch._FUSED_MLP_FEATURES, dispatch._FUSED_MLP_HIDDEN) == (mlp.MAX_FEATURES, mlp.HIDDEN)
    assert dispatch.fused_mlp_fits(64, 32) and not dispatch.fused_mlp_fits(65, 32) and not dispatch.fused_mlp_fits(48, 128)
    assert dispatch.fused_mlp_widths(64, 32) == (64, 32) and dispatch.fused_mlp_widths(1152, 64) == (64, 64)
    assert dispatch.fused_mlp_widths(1152, 128) is None and dispatch.fused_mlp_widths(48, 128) is None


def test_ray_samples_on_the_cpu_are_the_geometry_twins():
    """The door's rays' samples on the CPU: the twin (``segment_samples``), counted as torch."""
    from fasttomo.geometry.rays import Box, ray_samples, ray_segments
    from fasttomo.geometry.so3 import rot_y

    box = Box((6, 10, 12))
    R = rot_y(torch.deg2rad(torch.tensor([-50.0, 0.0, 20.0])))
    row, col, shift = torch.tensor([1, 5, 9]), torch.tensor([0, 6, 11]), torch.zeros(3, 2)
    got = dispatch.ray_samples(ray_segments(row, col, R, shift, (10, 12), box, 9), box, 9)
    ref = ray_samples(row, col, R, shift, (10, 12), box, 9)
    assert torch.equal(got.points, ref.points) and torch.equal(got.inside, ref.inside) and torch.equal(got.dt, ref.dt)
    assert dispatch.counters["ray_points"] == {"torch": 1}


def test_the_step_fusions_are_off_unless_configured():
    """kernels.step_fusion (a run's default on, the door's off until a run configures it): the
    run's config reaches the door, and with it off the features and plane TV are the two ops
    (counted as such), on every device."""
    from fasttomo.config import KernelsConfig
    from fasttomo.kernels.layout import PlaneLayout

    assert KernelsConfig().step_fusion is True
    lay = PlaneLayout(1, 2, ((3, 3, 3),))
    x = torch.randn(lay.numel, requires_grad=True)
    f, tv = dispatch.tilted_kplanes_tv(torch.rand(5, 3) * 2 - 1, torch.eye(3)[None], x, lay)
    assert f.shape == (5, lay.n_features) and tv.dim() == 0
    assert set(dispatch.counters) == {"tilted_kplanes", "plane_tv"}
    assert dispatch.configure("auto", step_fusion=True) == "auto" and dispatch._state["step_fusion"] is True
    dispatch.configure("auto")
    assert dispatch._state["step_fusion"] is False
