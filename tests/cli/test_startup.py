"""Start-up: --help and a mistyped command line are answered without importing torch or triton
(importing torch alone takes seconds on a loaded CPU), --help without Hydra too. Each command runs as a real process under
``python -X importtime``, which names every module the process imported."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cli_helpers import _env

HEAVY = ("torch", "triton")


def _imported(module: str, args: list[str], cwd) -> tuple[subprocess.CompletedProcess, set[str]]:
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *args], cwd=cwd, env=_env(),
                         capture_output=True, text=True, timeout=120)
    names = set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", res.stderr, flags=re.M))
    assert "fasttomo.cli" in names, res.stderr[-2000:]  # the parse found the import lines
    return res, names


@pytest.mark.parametrize("command, mistyped", [
    ("reconstruct", "optim.stpes=10"),
    ("simulate", "formt=h5"),
    ("evaluate", "held_out_vews=[5]"),
    ("trace", "treshold=0.3"),
])
def test_help_and_a_mistyped_key_do_not_import_torch(tmp_path, command, mistyped):
    module = f"fasttomo.cli.{command}"
    res, names = _imported(module, ["--help"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"fasttomo-{command}: "), res.stdout[:300]
    assert not names & {*HEAVY, "hydra"}, f"--help imported {sorted(names & {*HEAVY, 'hydra'})}"
    res, names = _imported(module, [mistyped], tmp_path)
    assert res.returncode == 2 and "no such key" in res.stderr, res.stderr[-2000:]
    assert not names & set(HEAVY), f"a mistyped key imported {sorted(names & set(HEAVY))}"
    assert not list(tmp_path.iterdir())


def test_a_value_the_schema_refuses_does_not_import_torch(tmp_path):
    res, names = _imported("fasttomo.cli.reconstruct", ["optim.steps=-1", f"hydra.run.dir={tmp_path / 'run'}"],
                           tmp_path)
    assert res.returncode == 2 and "optim.steps: must be an integer >= 1" in res.stderr, res.stderr[-2000:]
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
    assert not (tmp_path / "run").exists()
