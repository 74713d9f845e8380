"""scripts/gpu_batch.sh: the device session's job. Its suite step runs the GPU-marked tests (here,
on a CPU, every one of them skips) and writes their record; start returns at once and poll waits
for the batch's end and copies its folder to $OUT; a tree without .git needs FASTTOMO_COMMIT."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from cli_helpers import _env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_batch.sh"


def _batch(args: list[str], batch_dir: Path, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    e = {**_env(), "GPU_BATCH_DIR": str(batch_dir), **env}
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e["PATH"]  # python3 is this interpreter
    return subprocess.run(["bash", str(SCRIPT), *args], env=e, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_suite_step_records_the_gpu_tests(tmp_path):
    res = _batch(["run", "suite"], tmp_path / "b", FASTTOMO_COMMIT="abc1234")
    assert res.returncode == 0, res.stderr
    log = (tmp_path / "b" / "batch.log").read_text().splitlines()
    assert log[0].startswith("BEGIN") and "commit=abc1234 steps=suite" in log[0]
    assert log[1].startswith("STEP suite rc=0 ") and log[-1] == "DONE"
    record = json.loads((tmp_path / "b" / "gpu_tests-all-gpu-marked-cpu-abc1234.json").read_text())
    row = record["results"][0]
    assert record["commit"] == "abc1234" and row["pytest_rc"] == 0
    assert row["variant"] == "all -m gpu (abc1234)"
    assert row["passed"] == 0 and row["failed"] == 0 and row["skipped"] >= 60  # no GPU here: all skip
    # a named subset writes its own record
    res = _batch(["run", "kernelgpu"], tmp_path / "b", FASTTOMO_COMMIT="abc1234")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "b" / "batch.log").read_text().splitlines()[-2].startswith("STEP kernelgpu rc=0 ")
    record = json.loads((tmp_path / "b" / "gpu_tests-kernels-cpu-abc1234.json").read_text())
    assert record["results"][0]["variant"] == "tests/kernels/test_kernels_gpu.py -m gpu (abc1234)"
    assert record["command"].endswith("tests/kernels/test_kernels_gpu.py") and record["results"][0]["skipped"] > 10


def test_start_returns_and_poll_copies_the_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for _ in range(2):  # a second start puts the first batch's log aside, so poll waits for its own
        assert _batch(["start", "nosuchstep"], tmp_path / "b").returncode == 0
        res = _batch(["poll", "60"], tmp_path / "b", OUT=str(out))
        assert res.returncode == 0 and res.stdout.splitlines()[-1] == "DONE"
        # the message names every step the script's loop knows
        arms = re.findall(r"^    ([a-z0-9]+)\)", SCRIPT.read_text().split('for s in "${steps[@]}"')[1], re.M)
        named = re.search(r"^STEP nosuchstep unknown \((.*); base-STEP\)$", res.stdout, re.M)
        assert named and sorted(named.group(1).split(", ")) == sorted(arms) and len(arms) > 20
    assert (out / "batch.log").read_text().count("BEGIN") == 1
    assert len(list((tmp_path / "b").glob("batch-*.log"))) == 1


def test_poll_sends_more_than_eight_files_as_one_archive(tmp_path):
    """A lent machine sends back 8 files at most: beyond that, poll copies the log and packs the
    records (in sub-folders too) into records.tgz, the other files into logs.tgz."""
    b, out = tmp_path / "b", tmp_path / "out"
    (b / "base").mkdir(parents=True)
    out.mkdir()
    (b / "batch.log").write_text("BEGIN\nDONE\n")
    for i in range(8):
        (b / f"r{i}.json").write_text(str(i))
    (b / "base" / "r8.json").write_text("8")
    (b / "step.log").write_text("a step's log")
    res = _batch(["poll", "10"], b, OUT=str(out))
    assert res.returncode == 0 and sorted(p.name for p in out.iterdir()) == ["batch.log", "logs.tgz", "records.tgz"]
    with tarfile.open(out / "records.tgz") as t:
        names = sorted(os.path.normpath(n) for n in t.getnames())
    assert names == sorted([f"r{i}.json" for i in range(8)] + ["base/r8.json"])
    with tarfile.open(out / "logs.tgz") as t:
        assert [os.path.normpath(n) for n in t.getnames()] == ["step.log"]


def test_a_base_step_runs_in_the_other_tree(tmp_path):
    """base-STEP runs STEP with the script of GPU_BATCH_BASE's tree, its log and records under base/
    marked with GPU_BATCH_BASE_COMMIT; its line lands in the batch's log. Without a base tree the
    log says what it needs."""
    tree = tmp_path / "other"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "gpu_batch.sh").write_text(SCRIPT.read_text().replace("; base-STEP)", ", OTHER; base-STEP)"))
    res = _batch(["run", "base-nosuchstep"], tmp_path / "b", FASTTOMO_COMMIT="abc1234", GPU_BATCH_BASE=str(tree),
                 GPU_BATCH_BASE_COMMIT="def5678")
    assert res.returncode == 0, res.stderr
    log = (tmp_path / "b" / "batch.log").read_text().splitlines()
    assert "commit=abc1234 steps=base-nosuchstep" in log[0] and log[-1] == "DONE"
    assert log[1].startswith("STEP base-nosuchstep unknown (") and "OTHER" in log[1]
    assert "commit=def5678 steps=nosuchstep" in (tmp_path / "b" / "base" / "batch.log").read_text()
    # a second base step relays its own lines only; a base run that writes none says so
    (tree / "scripts" / "gpu_batch.sh").write_text("#!/usr/bin/env bash\nexit 7\n")
    _batch(["run", "base-other"], tmp_path / "b", FASTTOMO_COMMIT="abc1234", GPU_BATCH_BASE=str(tree),
           GPU_BATCH_BASE_COMMIT="def5678")
    log = (tmp_path / "b" / "batch.log").read_text().splitlines()
    assert "STEP base-other rc=7 (no step line: see base/batch.log)" in log and sum(x.startswith("STEP base-") for x in log) == 2
    res = _batch(["run", "base-camerastep"], tmp_path / "c", FASTTOMO_COMMIT="abc1234")
    assert "STEP base-camerastep needs GPU_BATCH_BASE" in (tmp_path / "c" / "batch.log").read_text()


def test_refuses_an_unknown_mode_and_a_tree_without_a_commit(tmp_path):
    res = _batch(["bench"], tmp_path / "b")
    assert res.returncode == 2 and "unknown mode 'bench' (start, poll or run)" in res.stderr
    tree = tmp_path / "copy"  # a copy without .git, as on a lent machine
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "scripts")
    e = {**_env(), "GPU_BATCH_DIR": str(tmp_path / "c"), "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    e.pop("FASTTOMO_COMMIT", None)
    res = subprocess.run(["bash", str(tree / "scripts" / "gpu_batch.sh"), "run", "suite"], env=e,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "no .git here; set FASTTOMO_COMMIT" in (tmp_path / "c" / "batch.log").read_text()
