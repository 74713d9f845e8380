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


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
@pytest.mark.parametrize("script", ["probe_smem_scatter.py", "probe_smem_backward.py"])
def test_the_cuda_source_matches_its_reference_on_the_cpu(script):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--emulate"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "parity: ok" in out.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")
def test_the_knockout_probe_variants_apply_and_do_what_they_say():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_bwd_knockout.py"), "--cpu-check"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cpu check: ok" in out.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")
def test_the_fused_decoder_probe_matches_the_twin_in_fp32():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_fused_mlp.py"), "--cpu-check"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "cpu check: ok" in out.stdout
