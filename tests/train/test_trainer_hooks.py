"""The Trainer takes its hooks when it is made: a stop object polled after every step and a probe
scoring the field every evaluation.curve_every steps, its time left out of the fit time."""

from __future__ import annotations

import time

import pytest

from cli_helpers import TINY

from fasttomo.cli.reconstruct import compose_config
from fasttomo.data.load import load_tiltseries
from fasttomo.run.build import build, make_trainer


class StopAt:
    def __init__(self, step: int):
        self.step, self.polled = step, []

    def should_stop(self, step: int) -> bool:
        self.polled.append(step)
        return step >= self.step


def test_stop_and_probe_given_at_construction_drive_the_loop(tmp_path):
    cfg = compose_config([*TINY, "optim.steps=20", "evaluation.curve_every=2", f"output.dir={tmp_path}"])
    stop = StopAt(5)
    seen = []

    def probe(trainer) -> dict:
        seen.append(trainer.step)
        time.sleep(0.2)  # probe time is not fit time
        return {"score": float(trainer.step)}

    trainer = make_trainer(build(cfg, load_tiltseries(cfg.data)), None, stop=stop, probe=probe)
    assert trainer.stop is stop and trainer.probe is probe
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    assert trainer.step == 5 and stop.polled == [1, 2, 3, 4, 5]
    assert seen == [2, 4] and [r["score"] for r in trainer.curve] == [2.0, 4.0]
    assert wall - trainer.train_seconds >= 0.4  # the probe's two 0.2 s pauses are not fit time


def test_the_trainer_applies_the_plane_tv_schedule_step_by_step():
    """loss.plane_tv_hold / plane_tv_ramp reach the step: the weighted plane TV the step reports is
    the schedule's weight times the planes' TV as they were at that step."""
    from fasttomo.models.regularizers import PLANE_TV

    cfg = compose_config([*TINY, "optim.steps=10", "loss.plane_tv=1", "loss.plane_tv_hold=0.3",
                          "loss.plane_tv_ramp=0.4", "output.dir=/tmp/unused"])
    c = build(cfg, load_tiltseries(cfg.data))
    trainer = make_trainer(c, None)
    field = c.projector.field
    weights = []
    for step in range(10):
        trainer._set_lr(step)
        raw = float(field.plane_tv().detach())
        _, parts = trainer.train_step(c.sampler.next_batch())
        weights.append(float(parts["plane_tv"]) / raw)
    expected = [PLANE_TV] * 3 + [PLANE_TV + (1 - PLANE_TV) * k / 4 for k in range(4)] + [1.0] * 3
    assert weights == pytest.approx(expected, rel=1e-4)
    # without a hold or ramp the trainer keeps no factor at all (the step is as it was)
    plain = make_trainer(build(compose_config([*TINY, "loss.plane_tv=1", "output.dir=/tmp/unused"]),
                               load_tiltseries(cfg.data)), None)
    assert plain._plane_tv_scale is None
