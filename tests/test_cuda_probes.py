"""The kernel probes, checked on the CPU so that a GPU session spends its time on timing them.

The CUDA probes (scripts/probe_smem_scatter.py, scripts/probe_smem_backward.py): their CUDA
sources, compiled for the CPU (scripts/cuda_probe.py: one thread a block), give their references
(a float64 index_add_; the torch twin's plane and frame-matrix gradients). The knockout probe
(scripts/probe_bwd_knockout.py): every variant's change still applies to the shipped kernel's
source, its candidates give the shipped kernel's gradients and its knockouts other ones (Triton's
interpreter). The fused-decoder probe (scripts/probe_fused_mlp.py): its fp32 kernels give the
twin's output and every gradient (the interpreter; a wrong derivative fails it)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(script: str, flag: str, ok: str) -> None:
    """Run ``script`` with its CPU check ``flag``; it must exit 0 and print ``ok``."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), flag],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert ok in out.stdout


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("script", ["probe_smem_scatter.py", "probe_smem_backward.py"])
def test_the_cuda_source_matches_its_reference_on_the_cpu(script):
    _check(script, "--emulate", "parity: ok")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")
@pytest.mark.parametrize("script", [
    "probe_bwd_knockout.py",  # every variant applies; candidates give the shipped gradients, knockouts not
    "probe_fused_mlp.py",  # the fused decoder's fp32 kernels give the twin's output and gradients
])
def test_the_triton_probes_check_out_in_the_interpreter(script):
    _check(script, "--cpu-check", "cpu check: ok")
