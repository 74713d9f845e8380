"""Per-view work on threads (fasttomo.data.views): the same values as a plain loop, errors raised."""

from __future__ import annotations

import numpy as np
import pytest

import fasttomo.data.views as views
from fasttomo.data import noise, prepare
from fasttomo.data.tiltseries import TiltSeries, TiltSeriesError

RNG = np.random.default_rng(5)
STACK = (RNG.normal(size=(13, 40, 36)) * 2 + RNG.uniform(1, 9, size=(13, 1, 1))).astype(np.float32)


def _threaded(monkeypatch):
    monkeypatch.setattr(views, "SERIAL_BELOW", 1)
    monkeypatch.setattr(views.os, "sched_getaffinity", lambda pid: set(range(4)))


def test_view_statistics_on_threads_are_the_loop_s(monkeypatch):
    serial = (prepare._view_stats(STACK, None), prepare._view_stats(STACK, STACK > 5), noise.estimate_snr(STACK))
    _threaded(monkeypatch)
    assert views.view_threads(len(STACK), STACK.size) == 4
    threaded = (prepare._view_stats(STACK, None), prepare._view_stats(STACK, STACK > 5), noise.estimate_snr(STACK))
    for (m0, s0), (m1, s1) in zip(serial[:2], threaded[:2]):
        np.testing.assert_array_equal(m0, m1)
        np.testing.assert_array_equal(s0, s1)
    assert serial[2] == threaded[2]


def test_a_small_series_stays_in_one_thread():
    assert views.view_threads(121, 64 * 64 * 121) == 1
    assert views.view_threads(1, 1 << 30) == 1


def test_checks_on_threads_find_what_the_loop_finds(monkeypatch):
    _threaded(monkeypatch)
    bad = STACK.copy()
    bad[7, 3, 4] = np.nan
    with pytest.raises(TiltSeriesError, match=r"1 NaN/Inf pixels \(first at view, row, col = \[7, 3, 4\]\)"):
        TiltSeries(stack=bad, angles=np.linspace(-60, 60, 13), pixel_size=1.0, source="t")
    with pytest.raises(Exception, match="NaN/Inf pixels"):
        prepare.handle_nonfinite(bad, None, "reject", "t")
    flat = np.full_like(STACK, 2.5)
    with pytest.raises(TiltSeriesError, match="every pixel of the stack holds the value 2.5"):
        prepare.refuse_constant(flat, None, "t")
    prepare.refuse_constant(STACK, None, "t")


def test_an_error_in_a_view_is_raised(monkeypatch):
    _threaded(monkeypatch)

    def fn(i):
        if i == 5:
            raise ValueError("view 5")
        return i

    with pytest.raises(ValueError, match="view 5"):
        views.map_views(fn, 9, 1 << 30)
    assert views.map_views(lambda i: i * i, 9, 1 << 30) == [i * i for i in range(9)]


def test_permute_views_puts_every_view_where_the_order_says_and_back():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 8, 121):
        for _ in range(5):
            a = rng.random((n, 3, 4)).astype(np.float32)
            before, order = a.copy(), rng.permutation(n)
            views.permute_views(a, order)
            np.testing.assert_array_equal(a, before[order])
            views.permute_views(a, np.argsort(order))
            np.testing.assert_array_equal(a, before)
    with pytest.raises(ValueError, match="permutation"):
        views.permute_views(np.zeros((3, 2)), [0, 0, 1])
