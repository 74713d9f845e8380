"""Shared fixtures. The tiny-run override lists live in tests/cli_helpers.py (declared once, also
used by the tests that start real processes); ``tiny_run`` runs the end-to-end tiny
reconstruction once per session and hands its folder, config and metrics to every test that reads
its outputs."""

from __future__ import annotations

import pytest

from cli_helpers import TINY, TINY_LOGGED


@pytest.fixture(scope="session")
def tiny_overrides() -> list[str]:
    """The end-to-end tiny run's overrides (add output.dir=... or hydra.run.dir=...)."""
    return [*TINY, *TINY_LOGGED]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_overrides):
    """(run folder, Config, metrics) of one real 40-step reconstruction of the small phantom on the
    CPU, with TensorBoard and frequent logs."""
    from fasttomo.cli.reconstruct import compose_config, run

    out = tmp_path_factory.mktemp("run") / "r1"
    cfg = compose_config([*tiny_overrides, f"output.dir={out}"])
    metrics = run(cfg)
    return out, cfg, metrics
