"""Fault injection (issue 10): a reconstruction killed at random moments (SIGKILL, SIGTERM,
SIGINT; during start-up, training, checkpoint and final writes), resumed each time with the same
command, ends with the same volume and parameters, bit for bit, as an uninterrupted run
(scripts/fault_inject.py; single process, CPU)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import _env

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fault_inject.py"


@pytest.mark.slow
def test_killed_and_resumed_run_ends_with_the_uninterrupted_volume(tmp_path):
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "fi"), "--kills", "4", "--steps", "200",
                          "--seed", "0"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "fi" / "attempts.log").read_text()[-3000:]
    assert "final volume == the uninterrupted run's" in res.stdout and "parameters identical" in res.stdout
    signals = int(re.search(r"(\d+) signal\(s\)", res.stdout).group(1))
    assert signals >= 2, res.stdout
    assert "resumed" in res.stdout
