"""bench_quality --jobs: cases run at once in their own processes give the rows a one-process run
gives (CPU runs are deterministic), in case order, in one record that says its times are
contended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import _env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_quality.py"
TINY = ["--cases", "default64", "noise5_64", "--size", "16", "--methods", "field-default", "--overrides",
        "optim.steps=10 runtime.threads=1", "--no-warmup"]


def _sweep(tmp_path: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / name
    res = subprocess.run([sys.executable, str(SCRIPT), *TINY, *extra, "--out-dir", str(out), "--work", str(tmp_path / f"w_{name}")],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    records = sorted(out.glob("bench_quality-*.json"))
    return res, (json.loads(records[0].read_text()) if records else None)


@pytest.mark.slow
def test_parallel_cases_give_the_sequential_rows(tmp_path):
    res_1, one = _sweep(tmp_path, "one")
    res_2, two = _sweep(tmp_path, "two", "--jobs", "2")
    assert res_1.returncode == 0 and res_2.returncode == 0, res_1.stdout[-2000:] + res_2.stdout[-2000:]
    assert [(r["case"], r["method"]) for r in two["results"]] == [("default64", "field-default"),
                                                                 ("noise5_64", "field-default")]
    for a, b in zip(one["results"], two["results"]):
        assert b["pearson"] == pytest.approx(a["pearson"], abs=1e-6) and b["fsc_mean"] == pytest.approx(a["fsc_mean"], abs=1e-6)
    assert two["parallel_jobs"] == 2 and "contended" in two["note"] and "parallel_jobs" not in one
    assert "default64: done" in res_2.stdout and "noise5_64: done" in res_2.stdout
