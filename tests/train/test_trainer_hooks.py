"""The Trainer takes its hooks when it is made: a stop object polled after every step and a probe
scoring the field every evaluation.curve_every steps, its time left out of the fit time."""

from __future__ import annotations

import time

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
