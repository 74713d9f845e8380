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
