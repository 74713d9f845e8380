"""The mean FSC to Nyquist (FSCCurve.mean_to_nyquist, ``fsc_mean`` in every FSC summary)."""

from __future__ import annotations

import numpy as np
import pytest

from fasttomo.quality.metrics import FSCCurve, fsc


def _curve(values) -> FSCCurve:
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    return FSCCurve(freq_inv_A=np.arange(1, n + 1) / (2.0 * n), fsc=v, n_voxels=np.ones(n, dtype=np.int64),
                    power_a=np.ones(n), power_b=np.ones(n), voxel_size_A=1.0)


def test_mean_counts_each_shell_once_and_skips_empty_ones():
    c = _curve([1.0, 0.8, np.nan, 0.2, 0.0])
    assert c.mean_to_nyquist == pytest.approx(0.5)
    assert c.summary(curves=False)["fsc_mean"] == pytest.approx(0.5)
    assert _curve([np.nan, np.nan]).mean_to_nyquist is None


def test_mean_is_one_for_identical_volumes_and_near_zero_for_independent_noise():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 24, 24, 24))
    assert fsc(a, a.copy(), 2.0).summary()["fsc_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(fsc(a, b, 2.0).mean_to_nyquist) < 0.05


def test_mean_moves_where_a_crossing_does_not():
    """Two curves with the same 0.5 and 0.143 crossings but different tails beyond them."""
    lo, hi = _curve([1.0, 0.9, 0.1, 0.0, 0.0]), _curve([1.0, 0.9, 0.1, 0.12, 0.13])
    assert lo.crossing(0.5) == hi.crossing(0.5) and lo.crossing(0.143) == hi.crossing(0.143)
    assert hi.mean_to_nyquist > lo.mean_to_nyquist
