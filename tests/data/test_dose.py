"""The dose model: Poisson statistics on a flat field, the linear bright-field mean, the inversion,
seeds, and the config checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fasttomo.config import ConfigError, DataConfig
from fasttomo.data.dose import detect, expected_counts
from fasttomo.data.phantom import make_tiltseries


@dataclasses.dataclass
class _Det:
    dose: float | None = 50.0
    gain: float = 2.5
    offset: float = 100.0
    absorption: float = 0.3
    invert: bool | None = False
    noise: float = 0.0
    noise_relative_to: str = "std"


def test_flat_field_mean_and_variance_are_poisson():
    """Vacuum (no mass): mean = offset + gain * dose, variance = gain^2 * dose."""
    flat = np.zeros((8, 64, 64), dtype=np.float32)
    det = _Det()
    img, meta = detect(flat, det, seed=3)
    n = img.size
    mean, var = float(img.mean()), float(img.var())
    want_mean, want_var = det.offset + det.gain * det.dose, det.gain ** 2 * det.dose
    assert abs(mean - want_mean) < 4.0 * np.sqrt(want_var / n)
    # the sample variance of a Poisson variable has relative std ~ sqrt(2 / n + 1 / (dose n))
    assert abs(var / want_var - 1.0) < 4.0 * np.sqrt(2.0 / n + 1.0 / (det.dose * n))
    counts = (img - det.offset) / det.gain
    np.testing.assert_allclose(counts, np.round(counts), atol=1e-3)    # whole electrons
    assert meta["dose_e_per_px"] == 50.0 and meta["inverted"] is False


def test_read_noise_adds_its_variance_to_the_shot_noise():
    """dose + Gaussian noise (relative to the clean image's maximum): variance gain^2 dose + noise_std^2."""
    flat = np.zeros((8, 64, 64), dtype=np.float32)
    det = _Det(noise=0.1, noise_relative_to="max")
    img, meta = detect(flat, det, seed=5)
    noise_std = 0.1 * (det.offset + det.gain * det.dose)
    assert meta["noise_std"] == pytest.approx(noise_std)
    want = det.gain ** 2 * det.dose + noise_std ** 2
    assert abs(float(img.var()) / want - 1.0) < 4.0 * np.sqrt(2.0 / img.size)
    assert abs(float(img.mean()) - (det.offset + det.gain * det.dose)) < 4.0 * np.sqrt(want / img.size)


def test_mean_image_is_linear_in_the_line_integral():
    p = np.linspace(0.0, 7.0, 4096, dtype=np.float32).reshape(1, 64, 64)
    lam = expected_counts(p, 200.0, 0.3)
    np.testing.assert_allclose(lam, 200.0 * (1.0 - 0.3 * p.astype(np.float64) / 7.0), rtol=1e-12)
    det = _Det(dose=1e6, gain=1.0, offset=0.0)
    img, _ = detect(p, det, seed=0)
    slope, icpt = np.polyfit(p.ravel(), img.ravel(), 1)
    assert abs(slope / (-1e6 * 0.3 / 7.0) - 1.0) < 0.01 and abs(icpt / 1e6 - 1.0) < 1e-3


def test_default_inversion_makes_mass_bright_and_seed_reproduces():
    cfg = DataConfig(width=32, height=32, n_tilts=5, dose=2000.0)
    a, b = make_tiltseries(cfg), make_tiltseries(cfg)
    np.testing.assert_array_equal(a.stack, b.stack)
    assert a.metadata["detector"]["inverted"] is True
    clean = make_tiltseries(DataConfig(width=32, height=32, n_tilts=5)).stack
    assert np.corrcoef(a.stack.ravel(), clean.ravel())[0, 1] > 0.5           # mass is bright
    raw = make_tiltseries(DataConfig(width=32, height=32, n_tilts=5, dose=2000.0, invert=False)).stack
    assert np.corrcoef(raw.ravel(), clean.ravel())[0, 1] < -0.5               # raw bright-field counts: dark
    other = make_tiltseries(DataConfig(width=32, height=32, n_tilts=5, dose=2000.0, phantom_seed=1)).stack
    assert not np.array_equal(a.stack, other)


def test_gaussian_noise_alone_is_unchanged_by_the_dose_keys():
    """Without a dose the Gaussian noise is drawn as before (default_rng(seed), std of the clean stack)."""
    from fasttomo.data.phantom import default_phantom, project

    ts = make_tiltseries(DataConfig(width=32, height=32, n_tilts=5, noise=0.05))
    clean = project(default_phantom(32, 32, 16), np.linspace(-60, 60, 5), 32, 32)
    want = (clean + np.random.default_rng(0).normal(0.0, 0.05 * float(clean.std()), clean.shape)).astype(np.float32)
    np.testing.assert_array_equal(ts.stack, want)
    assert ts.metadata["detector"]["inverted"] is False


@pytest.mark.parametrize("key,value", [("dose", -1.0), ("dose", 0.0), ("gain", 0.0), ("absorption", 1.0),
                                       ("absorption", 0.0), ("offset", float("nan")), ("invert", "yes")])
def test_bad_detector_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"data.{key}"):
        DataConfig(**{key: value})
