"""scripts/bench_step.py's profile on the CPU: a real eager step of the embedded default under
torch.profiler, its ops listed by their own CPU time with their input shapes (on a GPU the same
table is by GPU time, beside the kernels; `scripts/gpu_batch.sh camerastep`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profile_lists_the_step_ops_with_their_shapes():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_step.py"), "--case", "default",
                          "--variants", "torch-fp32-eager", "--steps", "1", "--warmup", "0", "--phase-steps", "0",
                          "--profile", "1", "--no-write"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "torch-fp32-eager: the ops of an eager step by their own CPU time:" in out.stdout
    ops = re.findall(r"^\s+([\d.]+) ms\s+([\d.]+)x\s+(\S+::\S+) (\[.*)$", out.stdout, re.M)
    assert len(ops) == 25, out.stdout[-3000:]
    times = [float(t) for t, _, _, _ in ops]
    assert times == sorted(times, reverse=True) and times[0] > 0
    # the twin's interpolation samples the planes with grid_sample, one call a plane and scale a step
    assert any(name == "aten::grid_sampler_2d" for _, _, name, _ in ops), ops


def test_the_kernel_sum_leaves_out_annotated_ranges():
    """On a GPU the profile's device-side events include the optimizer's record_function range
    beside the fused Adam kernels it spans (0.75 ms a camera2k step on an H100); the kernel sum
    counts the kernels only. The events are stand-ins: this machine has no CUDA profiler."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("bench_step", ROOT / "scripts" / "bench_step.py")
    bench_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_step)
    range_ = types.SimpleNamespace(name="Optimizer.step#Adam.step", is_user_annotation=True)
    old_torch = types.SimpleNamespace(name="Optimizer.step#Adam.step")  # a profiler without the flag
    kernel = types.SimpleNamespace(name="kplanes_bwd_runs_kernel", is_user_annotation=False)
    assert bench_step._annotation(range_) and bench_step._annotation(old_torch)
    assert not bench_step._annotation(kernel)
