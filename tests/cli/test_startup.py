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


def test_cfg_job_prints_the_composed_config_as_a_run_writes_it(tmp_path):
    """Hydra's own --cfg job printed '???' for every key the YAML files leave to the schema."""
    import yaml

    res, names = _imported("fasttomo.cli.reconstruct", ["--cfg", "job", "optim.steps=5", "experiment=flagship"],
                           tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    printed = yaml.safe_load(res.stdout)
    assert "???" not in res.stdout and printed["optim"]["steps"] == 5 and printed["data"]["width"] == 200
    assert printed["kernels"]["gpu_decoder"] == "fused" and printed["model"]["kind"] == "kplanes_tilted"
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
    assert not list(tmp_path.iterdir())  # no run folder
    res, _ = _imported("fasttomo.cli.reconstruct", ["--cfg=job", "optim.steps=6", f"hydra.run.dir={tmp_path}/r"],
                       tmp_path)
    assert res.returncode == 0 and yaml.safe_load(res.stdout)["optim"]["steps"] == 6, res.stderr[-2000:]
    res, _ = _imported("fasttomo.cli.reconstruct", ["--cfg", "job", "data.binning=2"], tmp_path)
    assert res.returncode == 2 and "data.binning: data.source=phantom does not read this key" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_run_composes_its_config_once(tmp_path, monkeypatch):
    """Hydra (1.3) composes a run's config twice, the first time only to read hydra.mode; the
    entry point answers that question itself unless a sweep is asked for. A real dry run in
    this process, Hydra's compositions counted (each one still composes)."""
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    from fasttomo.cli.reconstruct import main, sweep_requested

    calls = []
    compose = Hydra.compose_config

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("run_mode"))
        return compose(self, *args, **kwargs)

    monkeypatch.setattr(Hydra, "compose_config", counted)
    get_mode = Hydra.get_mode
    monkeypatch.setattr(sys, "argv", ["fasttomo-reconstruct", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"])
    monkeypatch.chdir(tmp_path)
    main()
    assert calls == [RunMode.RUN], calls  # the run's own composition, not get_mode's (MULTIRUN)
    assert Hydra.get_mode is get_mode  # Hydra's own again after the run
    assert sweep_requested(["-m", "optim.steps=3,4"]) and sweep_requested(["--multirun"])
    assert sweep_requested(["hydra.mode=MULTIRUN"]) and not sweep_requested(["optim.steps=3", "hydra.run.dir=x"])


@pytest.mark.parametrize("experiment", [None, "flagship", "quality", "quick"])
def test_no_config_sets_hydra_mode(experiment):
    """What the entry point's single composition assumes: Hydra's own first composition finds
    hydra.mode unset for the default config and every experiment."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fasttomo.cli.reconstruct import config_dir, register_schema

    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        overrides = [f"experiment={experiment}"] if experiment else []
        assert hydra.compose_config("reconstruct", overrides, run_mode=None).hydra.mode is None
