"""A non-editable install (what `pip install .` puts in site-packages) finds its configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_non_editable_install_ships_configs(tmp_path):
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(REPO)], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    assert (target / "fasttomo" / "configs" / "reconstruct.yaml").is_file()
    # every package of the source tree is installed (pyproject lists them explicitly)
    src = REPO / "src"
    for init in src.rglob("__init__.py"):
        assert (target / init.relative_to(src)).is_file(), f"{init.parent.relative_to(src)} not installed"
    assert (target / "fasttomo" / "configs" / "hydra" / "job_logging" / "fasttomo.yaml").is_file()
    code = ("import fasttomo.cli.reconstruct as r; c = r.compose_config(['experiment=flagship']); "
            "print(r.config_dir()); print(c.model.channels)")
    env = {**os.environ, "PYTHONPATH": str(target)}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    where, channels = res.stdout.split()
    assert Path(where) == target / "fasttomo" / "configs"
    assert channels == "48"
