"""The CUDA probes (scripts/probe_smem_scatter.py, scripts/probe_smem_backward.py): their CUDA
sources, compiled for the CPU (scripts/cuda_probe.py: one thread a block), give their
references (a float64 index_add_; the torch twin's plane and frame-matrix gradients), so a GPU
session spends its time on timing them."""

from __future__ import annotations

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
