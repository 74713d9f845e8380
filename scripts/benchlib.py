"""Shared plumbing of the benchmark scripts (scripts/bench_*.py): timing and the result record.

It lives beside them, not in the package: it writes into the source checkout's benchmarks/results/
and reads its git commit, which an installed fasttomo does not have.

Every record is one JSON object in benchmarks/results/ with the schema of CONTRIBUTING.md
("Benchmark records"): benchmark, case, commit, device, command, date, results (rows of a
``variant`` plus numbers whose keys carry units), and free extra context.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def timed_process(cmd: list[str], env: dict, cwd: Path, log: Path) -> tuple[float, int, int]:
    """Run ``cmd`` with its output in ``log``; returns (wall seconds, peak resident bytes of the
    child (os.wait4's ru_maxrss: on Linux at least this process's own peak when the child
    started, so prefer the child's own VmHWM where it reports one), exit code)."""
    import os
    import time

    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)  # KiB on Linux


def commit() -> str:
    """Short hash of HEAD, with '-dirty' when tracked files differ from it ('nocommit' outside git).
    FASTTOMO_COMMIT, when set, names it instead (a copy of the tree without .git, e.g. on a lent GPU
    machine)."""
    import os

    if os.environ.get("FASTTOMO_COMMIT"):
        return os.environ["FASTTOMO_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return "nocommit"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "nocommit"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cuda_times_ms(fn: Callable[[], object], n: int, warmup: int, device: torch.device) -> list[float]:
    """Per-call times (ms) of ``fn``: CUDA events on the GPU (after warm-up), wall time on the CPU."""
    import time

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in ev]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def write_result(benchmark: str, case: str, device: str, results: list[dict], *, argv: list[str] | None = None,
                 out_dir: Path | None = None, command: str | None = None, **extra) -> Path:
    """Write one result record; returns its path (<benchmark>-<case>-<device>-<commit>.json).
    ``command`` defaults to ``python scripts/<benchmark>.py`` plus ``argv`` (the script's own)."""
    c = commit()
    record = {
        "benchmark": benchmark,
        "case": case,
        "commit": c,
        "device": device,
        "command": command or " ".join([f"python scripts/{benchmark}.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "host": platform.machine(),
        **extra,
        "results": results,
    }
    out = Path(out_dir) if out_dir is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    safe_dev = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in device)
    path = out / f"{benchmark}-{case}-{safe_dev}-{c}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
