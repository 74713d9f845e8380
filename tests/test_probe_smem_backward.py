"""scripts/probe_smem_backward.py: its CUDA source, compiled for the CPU (one thread a block), gives
the torch twin's plane and frame-matrix gradients, so a GPU session spends its time on timing it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler")
def test_the_cuda_source_matches_the_twin_on_the_cpu():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_smem_backward.py"), "--emulate"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "parity: ok" in out.stdout
