"""Running fasttomo-reconstruct as a real process in tests (exit codes, signals, locks, kills)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

# The tiny run, declared once (tests/conftest.py runs it as the ``tiny_run`` fixture): a run of a
# few seconds on one CPU thread; add optim.steps=..., hydra.run.dir=... TINY_RUN holds the run's
# settings (any data source), TINY_PHANTOM the small phantom's size (data=phantom only: the file
# sources refuse the phantom's keys), TINY both.
TINY_RUN = ["experiment=quick", "model.resolutions=[8,16]", "sampler.batch_size=128", "projector.samples_per_ray=24",
            "logging=quiet", "runtime=cpu", "runtime.threads=1"]
TINY_PHANTOM = ["data.width=24", "data.height=20", "data.n_tilts=15"]
TINY = [*TINY_RUN, *TINY_PHANTOM]
# the end-to-end run of tests/conftest.py: 40 steps with TensorBoard and frequent logs
TINY_LOGGED = ["optim.steps=40", "logging.tensorboard=true", "logging.log_every=10", "logging.val_every=20",
               "logging.image_every=20"]


def _env() -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fasttomo.cli.reconstruct", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def start(args: list[str], cwd: Path, out: Path) -> subprocess.Popen:
    """Start a run in the background, its output going to ``out``."""
    fh = open(out, "w")
    return subprocess.Popen([sys.executable, "-m", "fasttomo.cli.reconstruct", *args], cwd=cwd, env=_env(),
                            stdout=fh, stderr=subprocess.STDOUT, text=True)


def wait_for_text(path: Path, text: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Wait until ``path`` holds ``text`` (fails early when ``proc`` ended first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {path} showed {text!r}")
        time.sleep(0.05)
    raise AssertionError(f"{path} did not show {text!r} within {timeout} s")


def strict_json(path: Path):
    """Parse as strict JSON: NaN/Infinity are not JSON."""
    def bad(token):
        raise ValueError(f"{path}: {token} is not valid JSON")
    return json.loads(path.read_text(), parse_constant=bad)


def run_interpreted(script: Path, omp_threads: int | None = None, timeout: int = 900) -> dict:
    """Run a Triton interpreter test file as a script (TRITON_INTERPRET=1 must be set before triton
    is imported, so it cannot run inside the pytest process) on this checkout's sources and return
    the JSON of its last ``RESULTS {...}`` line; skip when triton is not installed."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH", "")) if p)
    if omp_threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(omp_threads))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])
