"""Learning-rate schedules: shapes of the curves, and schedules never mutate their parameters."""

from __future__ import annotations

import copy
import math

import pytest

from fasttomo.config import ScheduleConfig
from fasttomo.train.schedules import PlateauState, Schedule, build_schedule


@pytest.mark.parametrize("kind", ["constant", "cosine", "exponential", "plateau"])
def test_schedule_is_pure(kind):
    sched, plateau = build_schedule(ScheduleConfig(kind=kind, warmup_steps=5), 100)
    before = copy.deepcopy(sched)
    first = [sched.factor(s, plateau) for s in range(100)]
    second = [sched.factor(s, plateau) for s in range(100)]
    assert first == second
    assert sched == before  # frozen dataclass, unchanged by use


def test_cosine_and_exponential_endpoints():
    cos = Schedule("cosine", 101, 0, 0.1)
    assert cos.factor(0) == pytest.approx(1.0)
    assert cos.factor(50) == pytest.approx(0.55)
    assert cos.factor(100) == pytest.approx(0.1)
    exp = Schedule("exponential", 11, 0, 0.01)
    assert exp.factor(10) == pytest.approx(0.01)
    assert exp.factor(5) == pytest.approx(0.1)


def test_warmup_is_linear():
    s = Schedule("constant", 100, warmup_steps=10)
    assert [s.factor(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert s.factor(10) == 1.0


def test_plateau_cuts_only_on_plateau():
    st = PlateauState(patience=2, cut=0.5)
    for v in (1.0, 0.9, 0.8):
        st.update(v)
    assert st.factor == 1.0
    for _ in range(3):
        st.update(0.8)
    assert st.factor == 0.5
    restored = PlateauState(2, 0.5)
    restored.load_state_dict(st.state_dict())
    assert restored.factor == 0.5 and restored.best == pytest.approx(0.8)
    assert math.isfinite(restored.best)
