"""The blind signal-to-noise estimate (data/noise.py) and the plane-TV weight chosen from it:
known noise on known images, Poisson counts, invariance to the intensity scale, bounded cost at
camera size, and the run's choice on a dose-limited specimen against a clean phantom."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cli_helpers import cli

from fasttomo.config import DataConfig, LossConfig
import fasttomo.data.noise as noise_mod
from fasttomo.data.noise import SNR_CROP, SNR_TILE, SNR_TILES, SNR_VIEWS, estimate_snr
from fasttomo.data.phantom import make_tiltseries
from fasttomo.models.regularizers import (DOSE_STEPS_FACTOR, HIGH_SNR, LOW_SNR, PLANE_TV, PLANE_TV_LOW_SNR, plane_tv_for,
                                          regularization, steps_factor_for)


def _smooth_views(n=6, h=96, w=112, seed=0):
    """Views of a few broad Gaussian blobs: smooth content whose own std is known exactly."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    out = np.zeros((n, h, w))
    for v in range(n):
        for _ in range(5):
            cy, cx, s, a = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(10, 20), rng.uniform(0.5, 2.0)
            out[v] += a * np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * s * s))
    return out


def test_gaussian_noise_on_a_flat_field_is_measured():
    rng = np.random.default_rng(1)
    stack = 10.0 + 0.7 * rng.standard_normal((5, 128, 128))
    est = estimate_snr(stack)
    assert est.noise_std == pytest.approx(0.7, rel=0.04)
    assert est.signal_std < 0.1 and est.snr < 0.15  # nothing but noise


def test_poisson_counts_give_the_square_root_of_the_dose():
    rng = np.random.default_rng(2)
    dose = 20.0
    stack = rng.poisson(dose, size=(4, 160, 160)).astype(np.float32)
    # the MAD of a discrete count distribution is coarse: within 10 % of sqrt(dose)
    assert estimate_snr(stack).noise_std == pytest.approx(math.sqrt(dose), rel=0.10)


def test_signal_and_noise_of_smooth_images_with_noise():
    clean = _smooth_views()
    signal = float(np.median(clean.reshape(len(clean), -1).std(axis=1)))
    noisy = clean + 0.05 * np.random.default_rng(3).standard_normal(clean.shape)
    est = estimate_snr(noisy)
    assert est.noise_std == pytest.approx(0.05, rel=0.08)
    assert est.signal_std == pytest.approx(signal, rel=0.05)
    assert est.snr == pytest.approx(signal / 0.05, rel=0.1)
    assert estimate_snr(clean).snr > 50 * est.snr  # noise-free smooth images: the residual is tiny


def test_the_ratio_ignores_gain_offset_and_inversion():
    noisy = _smooth_views() + 0.2 * np.random.default_rng(4).standard_normal((6, 96, 112))
    a = estimate_snr(noisy).snr
    assert estimate_snr(3.5 * noisy + 100.0).snr == pytest.approx(a, rel=1e-9)
    assert estimate_snr(noisy.max() - noisy).snr == pytest.approx(a, rel=1e-9)


def test_the_cost_is_bounded_at_camera_size():
    """More views than SNR_VIEWS and images wider than SNR_CROP: only SNR_VIEWS views and, of
    each, SNR_TILES x SNR_TILES tiles of SNR_TILE pixels spread from edge to edge are read (noise
    outside the tiles never shows)."""
    n, side = SNR_VIEWS + 2, 2 * SNR_CROP
    stack = np.random.default_rng(5).standard_normal((n, side, side)).astype(np.float32)
    seg = noise_mod._segments(side)
    assert len(seg) == SNR_TILES and seg[0].start == 0 and seg[-1].stop == side
    assert all(s.stop - s.start == SNR_TILE for s in seg) and noise_mod._segments(SNR_CROP) == [slice(0, SNR_CROP)]
    for ys in seg:
        for xs in seg:
            stack[:, ys, xs] = 1.0  # the tiles: flat, noiseless
    est = estimate_snr(stack)
    assert est.views == SNR_VIEWS and est.noise_std == 0.0 and est.signal_std == 0.0
    assert estimate_snr(np.zeros((3, 8, 8)) + np.arange(8)).views == 3


def test_contrast_away_from_the_centre_of_a_large_view_counts():
    """A 2048^2 view whose only structure is a band along one edge (outside the central 1024^2):
    the tiles reach it, so its signal is seen (std of a quarter-covering band: sqrt(3/16))."""
    side = 2 * SNR_CROP
    img = np.random.default_rng(6).normal(0.0, 0.05, (1, side, side))
    img[:, : side // 4] += 1.0
    est = estimate_snr(img)
    assert est.noise_std == pytest.approx(0.05, rel=0.05)
    assert est.signal_std == pytest.approx(math.sqrt(3 / 16), rel=0.05)


def test_too_small_images_are_refused():
    with pytest.raises(ValueError, match="too small"):
        estimate_snr(np.zeros((4, 2, 50)))


def test_the_rule_and_its_table():
    assert plane_tv_for(math.inf) == (PLANE_TV, f"at least {HIGH_SNR:g}")
    assert plane_tv_for(3.4)[0] == plane_tv_for(HIGH_SNR)[0] == plane_tv_for(1.33)[0] == PLANE_TV == 3e-2
    assert plane_tv_for(0.25)[0] == plane_tv_for(LOW_SNR)[0] == plane_tv_for(0.59)[0] == PLANE_TV_LOW_SNR == 1.0
    between = [plane_tv_for(s)[0] for s in np.linspace(LOW_SNR, HIGH_SNR, 40)[1:-1]]
    assert all(PLANE_TV <= w <= PLANE_TV_LOW_SNR for w in between)
    assert between == sorted(between, reverse=True)  # the weight falls as the estimate rises
    steps = np.diff(np.log(between))  # no jump: adjacent estimates 1/40 of the span apart stay within 15 %
    assert np.all(np.abs(steps) < np.log(1.15)), steps
    assert plane_tv_for(math.sqrt(LOW_SNR * HIGH_SNR))[0] == pytest.approx(math.sqrt(PLANE_TV * PLANE_TV_LOW_SNR), rel=0.03)


def test_the_steps_rule_doubles_a_dose_limited_fit_and_leaves_clean_data_alone():
    assert steps_factor_for(math.inf) == (1.0, f"at least {HIGH_SNR:g}")
    assert steps_factor_for(3.4)[0] == steps_factor_for(HIGH_SNR)[0] == 1.0
    assert steps_factor_for(0.25)[0] == steps_factor_for(LOW_SNR)[0] == DOSE_STEPS_FACTOR == 2.0
    between = [steps_factor_for(s)[0] for s in np.linspace(LOW_SNR, HIGH_SNR, 40)[1:-1]]
    assert between == sorted(between, reverse=True) and all(1.0 <= f <= 2.0 for f in between)
    assert np.all(np.abs(np.diff(between)) <= 0.11)  # no jump between adjacent estimates


def test_the_suite_falls_on_the_measured_sides():
    """The H200 suite's split, at a small size: Gaussian noise on ellipsoids -> 3e-2, Poisson counts
    of the cell specimen at 20 e/px -> 1."""
    kw = dict(width=64, height=64, thickness=32, n_tilts=21, tilt_min=-60.0, tilt_max=60.0, phantom_seed=0)
    ell = make_tiltseries(DataConfig(phantom="ellipsoids", noise=0.05, noise_relative_to="max", **kw))
    cell = make_tiltseries(DataConfig(phantom="cell", dose=20.0, pixel_size=20.0, **kw))
    assert plane_tv_for(estimate_snr(ell.stack).snr)[0] == PLANE_TV
    assert plane_tv_for(estimate_snr(cell.stack).snr)[0] == PLANE_TV_LOW_SNR
    assert steps_factor_for(estimate_snr(ell.stack).snr)[0] == 1.0  # the ellipsoids keep their step counts
    assert steps_factor_for(estimate_snr(cell.stack).snr)[0] == DOSE_STEPS_FACTOR


def test_regularization_refuses_an_unresolved_weight():
    from fasttomo.models import KPlanesTILTED

    m = KPlanesTILTED(n_rotations=1, channels=2, resolutions=[8])
    with pytest.raises(ValueError, match="loss.plane_tv is null"):
        regularization(m, LossConfig())


@pytest.mark.parametrize("extra,weight,why,steps", [
    ([], "0.03", "at least 1.3", "1500 steps (from the images' size 48 x 48;"),
    (["data.phantom=cell", "data.dose=20", "data.pixel_size=20"], "1", "at most 0.6: a dose-limited series",
     "3000 steps (1500 from the images' size 48 x 48, x2: estimated signal-to-noise"),
])
def test_the_run_says_what_it_chose(tmp_path, extra, weight, why, steps):
    res = cli(["dry_run=true", "runtime=cpu", "data.width=48", "data.height=48", "data.thickness=24",
               "data.n_tilts=15", *extra, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text
    assert f"loss: plane TV {weight} (estimated signal-to-noise" in text and why in text
    assert f"loss.plane_tv = {weight} (automatic: estimated signal-to-noise" in text
    assert f"optim: {steps}" in text
    assert f"optim.steps = {steps.split()[0]} (automatic: " in text  # the dry run's table agrees
    res = cli(["dry_run=true", "runtime=cpu", "data.width=48", "data.height=48", "data.n_tilts=15",
               "data.phantom=cell", "data.dose=20", "data.pixel_size=20",
               "loss.plane_tv=0.005", "optim.steps=700", f"hydra.run.dir={tmp_path / 'run2'}"], tmp_path)
    text = res.stdout + res.stderr
    assert "loss.plane_tv = 0.005 (set)" in text and "loss: plane TV" not in text
    assert "optim.steps = 700 (set)" in text and "optim: " not in text
    assert "held at" not in text


def test_the_run_says_what_the_plane_tv_hold_does(tmp_path):
    base = ["dry_run=true", "runtime=cpu", "data.width=48", "data.height=48", "data.n_tilts=15", "optim.steps=1000",
            "loss.plane_tv_hold=0.25", "loss.plane_tv_ramp=0.5"]
    res = cli([*base, "loss.plane_tv=1", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "plane TV held at 0.03 for 250 steps, then raised to 1 by step 750" in res.stdout + res.stderr
    res = cli([*base, "loss.plane_tv=0.01", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "change nothing: plane TV 0.01 is not above 0.03" in res.stdout + res.stderr


def test_metrics_record_the_weight_the_run_used(tmp_path):
    import json

    from fasttomo.cli.reconstruct import compose_config, run

    run(compose_config(["logging=quiet", "runtime=cpu", "data.width=16", "data.height=16", "data.n_tilts=9",
                        "data.phantom=cell", "data.dose=20", "data.pixel_size=40", "sampler.batch_size=64",
                        "projector.samples_per_ray=8", "optim.steps=2", f"output.dir={tmp_path / 'r'}"]))
    assert json.loads((tmp_path / "r" / "metrics.json").read_text())["plane_tv"] == PLANE_TV_LOW_SNR
