"""The robust vacuum estimate: unbiased under noise where a low quantile is not."""

from __future__ import annotations

import numpy as np
import pytest

from fasttomo.config import DataConfig
from fasttomo.data.background import default_block, estimate_background
from fasttomo.data.phantom import make_tiltseries


@pytest.fixture(scope="module")
def clean():
    """The built-in phantom's exact projections (vacuum reads exactly 0)."""
    return make_tiltseries(DataConfig(width=64, height=64, n_tilts=31)).stack


def test_clean_projections_give_exactly_zero(clean):
    est = estimate_background(clean)
    assert est.value == 0.0 and est.spread == 0.0
    assert np.all(est.per_view == 0.0)


@pytest.mark.parametrize("offset", [0.0, 100.0, -3.5])
@pytest.mark.parametrize("rel_noise", [0.05, 0.10])
def test_offset_recovered_under_noise_where_the_quantile_is_biased(clean, offset, rel_noise):
    sigma = rel_noise * float(clean.max())
    rng = np.random.default_rng(7)
    noisy = clean + offset + rng.normal(0.0, sigma, clean.shape)
    est = estimate_background(noisy)
    # 31 views x 16 x 16 tiles, the darkest 5 % = 248 tiles, each B half = 8 pixels: the median of
    # the tile means has a standard error ~ 1.25 sigma / sqrt(8 * 248) = 0.028 sigma; 0.15 sigma
    # leaves room for tiles that touch the specimen's faint edges.
    assert abs(est.value - offset) < 0.15 * sigma, (est.value, offset, sigma)
    # the old default's anchor: the 1 % quantile sits about 2.3 sigma below the vacuum
    q01 = float(np.quantile(noisy, 0.01))
    assert q01 < offset - 1.5 * sigma
    # per-view values: 13 tiles per view, standard error ~ 0.1 sigma
    assert np.median(np.abs(est.per_view - offset)) < 0.3 * sigma
    assert est.spread == pytest.approx(sigma / np.sqrt(8), rel=0.35)  # tile means of 8 pixels


def test_per_view_offsets_follow_a_drifting_vacuum(clean):
    drift = np.linspace(-2.0, 2.0, clean.shape[0])
    noisy = clean + drift[:, None, None] + np.random.default_rng(1).normal(0, 0.2, clean.shape)
    est = estimate_background(noisy)
    assert np.max(np.abs(est.per_view - drift)) < 0.2


def test_invalid_pixels_are_ignored(clean):
    data = clean.copy() + 5.0
    valid = np.ones(data.shape, dtype=bool)
    data[:, :, :8] = -1000.0  # a dead strip: far darker than the vacuum
    valid[:, :, :8] = False
    assert estimate_background(data, valid).value == pytest.approx(5.0)
    assert estimate_background(data).value < 0  # without the mask the strip is taken as vacuum


def test_block_size_and_input_checks():
    assert default_block(64, 64) == 4 and default_block(2048, 1024) == 64
    with pytest.raises(ValueError, match=r"\(n, H, W\)"):
        estimate_background(np.zeros((4, 4)))


def test_views_read_in_chunks_on_threads_give_the_same_estimate(clean, monkeypatch):
    """A camera-sized stack is read a few views at a time on several threads; each view's tile
    means are its own, so the estimate is the one-chunk estimate bit for bit (with and without a
    valid mask, for a tile side that does not divide the image)."""
    import fasttomo.data.background as background

    rng = np.random.default_rng(3)
    noisy = (clean + 2.0 + rng.normal(0.0, 0.1 * float(clean.max()), clean.shape)).astype(np.float32)
    valid = rng.random(noisy.shape) > 0.2
    whole = [estimate_background(noisy), estimate_background(noisy, valid, block=7)]
    monkeypatch.setattr(background, "TILE_CHUNK_PIXELS", 2 * 64 * 64)  # 16 chunks of 2 views
    parts = [estimate_background(noisy), estimate_background(noisy, valid, block=7)]
    for w, p in zip(whole, parts):
        assert p.value == w.value and p.spread == w.spread and p.n_tiles == w.n_tiles
        np.testing.assert_array_equal(p.per_view, w.per_view)
    assert abs(whole[0].value - 2.0) < 0.05


@pytest.mark.parametrize("block", [4, 6])
def test_unmasked_even_tiles_take_strided_sums_equal_to_the_masked_means(clean, block):
    """Without a validity mask and with an even tile side, the A and B halves of each tile are
    summed from strided views (no float64 copy of the stack); their means are those of the masked
    path (every pixel valid) to float64 rounding, and the estimate is the same."""
    from fasttomo.data.background import _tile_means

    rng = np.random.default_rng(5)
    noisy = (clean + 1.0 + rng.normal(0.0, 0.2, clean.shape)).astype(np.float32)[:, 1:, 3:]  # 63 x 61: a centred crop
    fast = _tile_means(noisy, None, block)
    masked = _tile_means(noisy, np.ones(noisy.shape, dtype=bool), block)
    for f, m in zip(fast, masked):
        assert f.shape == m.shape == (noisy.shape[0], 63 // block, 61 // block)
        np.testing.assert_allclose(f, m, rtol=1e-13, atol=0)
    a = estimate_background(noisy, block=block)
    b = estimate_background(noisy, np.ones(noisy.shape, dtype=bool), block=block)
    assert abs(a.value - b.value) <= 1e-12 * abs(b.value) and a.n_tiles == b.n_tiles


@pytest.mark.parametrize("kw", [dict(phantom="cell", dose=200.0, pixel_size=10.0),
                                dict(phantom="catalyst", dose=200.0, pixel_size=2.5),
                                dict(noise=0.05)], ids=["cell_dose200", "catalyst_dose200", "default_noise5"])
def test_mass_dark_images_are_told_from_mass_bright_ones(kw, caplog):
    """Raw bright-field counts (the dose phantoms with data.invert=false; the default phantom
    inverted) have their vacuum as the brightest, flat level: flagged, with data.invert named;
    the same series mass-bright are not."""
    import logging

    from fasttomo.data.background import warn_if_mass_dark

    log = logging.getLogger("fasttomo.test")
    mass_dark_invert = "dose" not in kw  # dose counts are mass-dark as simulated, the plain phantom inverted
    for invert, dark in ((mass_dark_invert, True), (not mass_dark_invert, False)):
        ts = make_tiltseries(DataConfig(width=64, height=64, n_tilts=21, invert=invert, **kw))
        est = estimate_background(ts.stack, ts.valid)
        assert est.mass_dark() is dark, (invert, est.spread, est.bright_spread)
        caplog.clear()
        warn_if_mass_dark(est, log, "s.mrc")
        assert ("look mass-dark" in caplog.text and "data.invert=true" in caplog.text) is dark
    assert est.describe()["bright_spread"] == est.bright_spread
