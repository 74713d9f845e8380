"""Learning-rate schedules as pure functions of the step.

A schedule never mutates its own parameters when used: ``factor(step)`` is a pure function of the
frozen schedule and the step. The plateau schedule's adaptive part lives in a separate, explicit
``PlateauState`` (saved in checkpoints) that only ``PlateauState.update`` changes. The trainer sets
each parameter group's ``lr = base_lr * factor`` where ``base_lr`` is read from the config and never
written back.
"""

from __future__ import annotations

import dataclasses
import math

from fasttomo.config import ScheduleConfig


@dataclasses.dataclass(frozen=True)
class Schedule:
    kind: str
    total_steps: int
    warmup_steps: int = 0
    min_factor: float = 0.05

    def factor(self, step: int, plateau: "PlateauState | None" = None) -> float:
        """Multiplier of the base learning rate at ``step`` (0-based)."""
        warm = 1.0
        if self.warmup_steps > 0 and step < self.warmup_steps:
            warm = (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        frac = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        if self.kind == "constant":
            f = 1.0
        elif self.kind == "cosine":
            f = self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * frac))
        elif self.kind == "exponential":
            f = self.min_factor ** frac
        elif self.kind == "plateau":
            f = plateau.factor if plateau is not None else 1.0
        else:  # validated by ScheduleConfig
            raise ValueError(f"unknown schedule kind {self.kind!r}")
        return warm * f


@dataclasses.dataclass
class PlateauState:
    """Adaptive state of the plateau schedule: cut the rate by ``cut`` after ``patience`` checks
    without a relative improvement of ``threshold``."""

    patience: int
    cut: float
    threshold: float = 1e-4
    best: float = math.inf
    bad: int = 0
    factor: float = 1.0

    def update(self, metric: float) -> None:
        if metric < self.best * (1.0 - self.threshold):
            self.best, self.bad = metric, 0
        else:
            self.bad += 1
            if self.bad > self.patience:
                self.factor *= self.cut
                self.bad = 0

    def state_dict(self) -> dict:
        return {"best": float(self.best), "bad": int(self.bad), "factor": float(self.factor)}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.bad, self.factor = float(state["best"]), int(state["bad"]), float(state["factor"])


def build_schedule(cfg: ScheduleConfig, total_steps: int) -> tuple[Schedule, PlateauState | None]:
    sched = Schedule(cfg.kind, total_steps, cfg.warmup_steps, getattr(cfg, "min_factor", 1.0))
    plateau = PlateauState(cfg.plateau_patience, cfg.plateau_factor) if cfg.kind == "plateau" else None
    return sched, plateau
