"""kernels/triton/ahead.py: a GPU run compiles its fused kernels ahead, in threads, before its first
step. Real runs in fresh processes, each with an empty Triton cache of its own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

CHILD = r"""
import json, sys, threading
import triton.compiler as tc
compiled = []
orig = tc.compile
def counted(src, *a, **k):
    compiled.append((getattr(getattr(src, "fn", None), "__name__", "?"), threading.current_thread().name))
    return orig(src, *a, **k)
tc.compile = counted  # JITFunction takes the compiler from triton.compiler at its first launch
import triton.runtime.build as tb
built = []
orig_build = tb._build
def counted_build(name, *a, **k):
    built.append((name, threading.current_thread().name))
    return orig_build(name, *a, **k)
tb._build = counted_build  # compile_module_from_src calls it by name where its cache has no library
ahead = sys.argv[1] == "on"
from fasttomo.cli import reconstruct
if not ahead:
    import fasttomo.kernels.dispatch as d
    d.compile_ahead = lambda *a, **k: 0
sys.argv = ["fasttomo-reconstruct", "optim.steps=120", "logging.progress=false", "output.formats=[mrc]",
            "hydra.run.dir=" + sys.argv[2]] + sys.argv[3:]
try:
    reconstruct.main()
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps({"compiled": compiled, "launchers": [t for n, t in built if n == "__triton_launcher"]}))
"""


def _run(tmp_path, name: str, ahead: bool, *overrides: str) -> tuple[list, list, np.ndarray]:
    import os

    import mrcfile

    out_dir = tmp_path / name
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / f"cache-{name}"))
    p = subprocess.run([sys.executable, "-c", CHILD, "on" if ahead else "off", str(out_dir), *overrides],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    with mrcfile.open(out_dir / "volume.mrc", permissive=True) as m:
        return got["compiled"], got["launchers"], np.array(m.data)


def _timeline(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / name / "metrics.json").read_text())["timeline"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("overrides", [(), ("precision.dtype=fp32", "loss=tv", "pose=refine"),
                                       ("precision.planes=bf16",), ("kernels.gpu_decoder=fused",)],
                         ids=["default", "fp32-volume-tv-poses", "bf16-planes", "fused-decoder"])
def test_every_kernel_of_a_run_is_compiled_ahead_and_the_volume_agrees(tmp_path, overrides):
    on, launchers_on, vol_on = _run(tmp_path, "on", True, *overrides)
    off, launchers_off, vol_off = _run(tmp_path, "off", False, *overrides)
    # without: at first use, one by one, on the thread that launches (autograd's device thread for
    # the backward's kernels)
    assert off and not any(thread.startswith("fasttomo-compile") for _, thread in off), off
    # with: all in the pool, none left for the run's own launches (training, validation, export,
    # the views' residuals)
    assert on and all(thread.startswith("fasttomo-compile") for _, thread in on), \
        [(n, t) for n, t in on if not t.startswith("fasttomo-compile")]  # the ones compiled at first use
    # the kernels' C launchers likewise: built in the pool, none at a first launch
    assert launchers_off and not any(t.startswith("fasttomo-compile") for t in launchers_off), launchers_off
    assert launchers_on and all(t.startswith("fasttomo-compile") for t in launchers_on), launchers_on
    need, made = Counter(n for n, _ in off), Counter(n for n, _ in on)
    assert all(made[n] >= k for n, k in need.items()), (need, made)  # at least what the run compiled itself
    # the same kernels; not bit for bit on a GPU (the backward's fp32 atomics add in any order)
    assert np.corrcoef(vol_on.ravel(), vol_off.ravel())[0, 1] > 0.9999
    assert _timeline(tmp_path, "on")["compile_ahead"]["cached"] is False
    # a second run on the cache the first filled: its marker says every kernel is there, so no pool
    (tmp_path / "cache-again").symlink_to(tmp_path / "cache-on")
    again, launchers_again, _ = _run(tmp_path, "again", True, *overrides)
    assert not any(thread.startswith("fasttomo-compile") for _, thread in again), again
    assert not launchers_again, launchers_again  # every launcher from the cache
    summary = _timeline(tmp_path, "again")["compile_ahead"]
    assert summary["cached"] is True and summary["kernels"] > 0 and summary["waited_s"] == 0.0, summary
    assert list((tmp_path / "cache-on").glob("fasttomo-ahead-*.done"))


def test_the_marker_names_the_plan(monkeypatch, tmp_path):
    """The marker of a complete pool: one path per plan (the launches' kernels and specialization
    classes, the device, Triton's version) in Triton's cache folder, whatever the launches' order;
    another plan (bf16 planes) has another. Without CUDA the device's name stands in."""
    pytest.importorskip("triton")
    from fasttomo.kernels.layout import PlaneLayout
    from fasttomo.kernels.triton import ahead

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "a GPU")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    lay = PlaneLayout(2, 16, ((8, 8, 8), (16, 16, 16)))

    def marker(**kw):
        classes = []
        ahead._collect(torch.device("cpu"), ahead.plan_jobs(lay, 4096, train_out_bf16=True, need_dq=False, need_gm=False,
                                                            plane_tv=True, volume_tv=None, **kw), classes)
        assert classes
        return ahead.plan_marker(torch.device("cuda"), classes), classes

    path, classes = marker()
    assert path is not None and path.startswith(str(tmp_path)) and path.endswith(".done")
    assert ahead.plan_marker(torch.device("cuda"), list(reversed(classes))) == path
    assert marker(planes_bf16=True)[0] != path
    assert marker(decoder=(48, 32))[0] != path  # the fused decoder's pair


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where compiling for CUDA fails")
def test_a_pool_whose_compiles_fail_says_which_and_leaves_no_marker(monkeypatch, tmp_path):
    """A launch the pool could not compile is compiled at its first use instead; the run's
    timeline names it and its error, and no marker claims the plan complete. Here (no CUDA) every
    compile of the plan fails."""
    pytest.importorskip("triton")
    from fasttomo.kernels.layout import PlaneLayout
    from fasttomo.kernels.triton import ahead

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    lay = PlaneLayout(1, 8, ((8, 8, 8),))
    jobs = ahead.plan_jobs(lay, 4096, train_out_bf16=False, need_dq=False, need_gm=False, plane_tv=True,
                           volume_tv=None)
    n = ahead.start(torch.device("cuda"), jobs)
    ahead.wait()
    got = ahead.summary()
    assert n == got["kernels"] == len(got["failed"]) > 0 and got["cached"] is False, got
    assert {f.split(":")[0] for f in got["failed"]} >= {"kplanes_fwd_kernel", "plane_tv_fwd_kernel"}, got
    assert not list(tmp_path.glob("fasttomo-ahead-*.done"))


def test_every_pointer_of_a_plan_is_a_tensor():
    """Each planned launch hands its kernel a tensor for every ``*_ptr`` parameter and a number for
    the others: the plan of a bf16 run with every job (the decoder's jobs once read a name the
    rays' loop had rebound to an integer, so the pool failed to compile them, silently)."""
    pytest.importorskip("triton")
    from fasttomo.kernels.layout import PlaneLayout
    from fasttomo.kernels.triton import ahead

    lay = PlaneLayout(2, 8, ((8, 8, 8), (16, 16, 16)))
    jobs = ahead.plan_jobs(lay, 4096, train_out_bf16=True, need_dq=True, need_gm=True, plane_tv=True,
                           volume_tv=((8, 16, 16), False), planes_bf16=True, decoder=(32, 32), rays=(256, 13))
    calls = ahead._collect(torch.device("cpu"), jobs)
    names = {kernel.__name__ for kernel, *_ in calls}
    assert {"mlp_fwd_kernel", "mlp_bwd_kernel", "ray_points_kernel", "plane_tv_bwd_kernel"} <= names, names
    for kernel, _, args, _ in calls:
        params = kernel.arg_names[:len(args)]
        wrong = [(p, type(a).__name__) for p, a in zip(params, args)
                 if p.endswith("_ptr") != isinstance(a, torch.Tensor)]
        assert not wrong, (kernel.__name__, wrong)


def test_planning_a_run_imports_no_symbolic_shapes():
    """Collecting a plan runs the launchers on meta tensors; their sums of partial results must not
    reach torch's meta reductions, which import sympy and torch's symbolic shapes (3.1 s of a warm
    H200 run at f89d2a5, where torch compiles their sources), a cost the run has no other use for.
    The plan of the default run with the frames' gradient, plane TV, volume TV, the rays' samples
    and (bf16) the fused decoder, in a fresh process."""
    pytest.importorskip("triton")
    code = r"""
import json, sys
import torch
from fasttomo.kernels.layout import PlaneLayout
from fasttomo.kernels.triton import ahead
lay = PlaneLayout(2, 16, ((8, 8, 8), (16, 16, 16)))
calls = []
for bf16 in (True, False):  # bf16 features and planes, and fp32
    jobs = ahead.plan_jobs(lay, 4096, train_out_bf16=bf16, need_dq=True, need_gm=True, plane_tv=True,
                           volume_tv=((8, 16, 16), True), planes_bf16=bf16, decoder=(48, 32) if bf16 else None,
                           rays=(256, 13))
    calls += ahead._collect(torch.device("cpu"), jobs)
names = sorted({kernel.__name__ for kernel, *_ in calls if kernel.__name__.startswith("mlp")})
rays = sum(kernel.__name__ == "ray_points_kernel" for kernel, *_ in calls)
print(json.dumps({"calls": len(calls), "mlp": names, "rays": rays, "sympy": "sympy" in sys.modules,
                  "symbolic_shapes": "torch.fx.experimental.symbolic_shapes" in sys.modules}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["mlp"] == ["mlp_bwd_kernel", "mlp_fwd_kernel"], got  # the decoder's pair (bf16 plan)
    assert got["rays"] == 4, got  # 13 samples a ray: point counts of both classes, in each plan
    assert got["calls"] >= 18 and not got["sympy"] and not got["symbolic_shapes"], got


def test_a_cpu_field_compiles_nothing_ahead_and_imports_no_triton():
    code = r"""
import json, sys
from fasttomo.config import ModelConfig
from fasttomo.geometry.rays import Box
from fasttomo.kernels import dispatch
from fasttomo.models import build_field
dispatch.configure("auto")
field = build_field(ModelConfig(), Box((8, 16, 16)))
n = dispatch.compile_ahead(field, 4096, out_bf16=False, need_dq=False, plane_tv=True)
print(json.dumps({"jobs": n, "triton": "triton" in sys.modules, "summary": dispatch.compile_ahead_summary()}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"jobs": 0, "triton": False, "summary": None}
