"""Quality metrics on hand-checked cases: FSC (identity, noise, a known shift, anisotropic boxes,
crossing interpolation), the missing-wedge convention, PSNR and per-view projection metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fasttomo.quality.metrics import (FSC_THRESHOLDS, crossing, fsc, measured_region, mse, projection_metrics, psnr,
                              sector_fsc, volume_metrics)


def _full_grid_shells(shape, voxel):
    """Independent shell assignment on the FULL Fourier grid (no real-FFT halving): |k| in 1/A of
    every voxel and its shell index round(|k| / w), w = 1 / (max(N) * voxel)."""
    kz, ky, kx = np.meshgrid(*(np.fft.fftfreq(n, d=voxel) for n in shape), indexing="ij")
    w = 1.0 / (max(shape) * voxel)
    return np.rint(np.sqrt(kx ** 2 + ky ** 2 + kz ** 2) / w).astype(int), (kz, ky, kx)


def _flat_spectrum(shape, seed=0):
    """A real volume whose Fourier coefficients all have magnitude 1 (random phases)."""
    a = np.random.default_rng(seed).standard_normal(shape)
    f = np.fft.rfftn(a)
    return np.fft.irfftn(f / np.abs(f), s=shape, axes=(0, 1, 2))


# --------------------------------------------------------------------------------------- FSC
def test_identical_volumes_fsc_is_one_everywhere():
    a = np.random.default_rng(1).standard_normal((16, 16, 16))
    c = fsc(a, a.copy(), voxel_size_A=3.0)
    np.testing.assert_allclose(c.fsc, 1.0, atol=1e-6)
    assert c.freq_inv_A[-1] == pytest.approx(0.5 / 3.0)          # last shell at Nyquist, in 1/A
    assert c.freq_inv_A[0] == pytest.approx(1 / (16 * 3.0))       # shells one Fourier voxel apart
    s = c.summary()
    assert s["fsc05_status"] == s["fsc0143_status"] == "never" and s["fsc05_A"] is None
    assert s["nyquist_A"] == pytest.approx(6.0)


def test_independent_noise_fsc_is_near_zero_within_shell_bound():
    """For independent white noise A and B, Re(A B*) over the n voxels of a shell (n/2 independent
    conjugate pairs, each counted twice) has variance n sigma^4 while sqrt(sum|A|^2 sum|B|^2) is
    about n sigma^2: FSC ~ N(0, 1/n). So |FSC| < 5 / sqrt(n) in every shell (a 5-sigma bound, about
    6e-7 per shell), and the z-scores FSC * sqrt(n) have a standard deviation near 1."""
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((2, 24, 24, 24))
    c = fsc(a, b, voxel_size_A=1.0)
    assert np.all(np.abs(c.fsc) < 5.0 / np.sqrt(c.n_voxels))
    z = c.fsc * np.sqrt(c.n_voxels)
    assert 0.6 < z.std() < 1.5
    assert c.crossing(0.5).status == "below_at_start"
    offset = fsc(a + 1e5, b - 3e4, voxel_size_A=1.0)            # a constant offset changes no shell
    np.testing.assert_allclose(offset.fsc, c.fsc, atol=1e-5)


def test_voxel_counts_match_the_full_grid():
    """The real-FFT half grid with Hermitian weights counts exactly the full grid's voxels per
    shell (odd and even sizes, anisotropic)."""
    shape, voxel = (7, 10, 13), 2.0
    shells, _ = _full_grid_shells(shape, voxel)
    c = fsc(np.ones(shape), np.ones(shape), voxel)
    expect = np.bincount(shells.ravel(), minlength=len(c.n_voxels) + 1)[1:len(c.n_voxels) + 1]
    np.testing.assert_array_equal(c.n_voxels, expect)


def test_one_voxel_roll_gives_the_shell_average_of_the_phase_ramp():
    """b = a rolled by one voxel along X (periodic) has B(k) = A(k) exp(-2 pi i kx), kx in cycles
    per voxel. FSC = sum cos(2 pi kx) |A|^2 / sum |A|^2 per shell: NOT 1 -- a shift is a phase ramp,
    which FSC sees. With |A| = 1 everywhere this is exactly the mean of cos(2 pi kx) over the
    shell's voxels; on a sphere of radius k that mean is sin(2 pi k) / (2 pi k), which reaches 0.5
    at k = 0.3017 cycles/voxel, i.e. a "resolution" of 3.31 voxels. Rolling both volumes alike
    changes nothing."""
    shape, voxel = (16, 20, 24), 1.0
    a = _flat_spectrum(shape)
    b = np.roll(a, 1, axis=2)
    c = fsc(a, b, voxel)
    shells, (_, _, kx) = _full_grid_shells(shape, voxel)
    ramp = np.cos(2 * np.pi * kx)
    expect = [ramp[shells == s].mean() for s in range(1, len(c.fsc) + 1)]
    np.testing.assert_allclose(c.fsc, expect, atol=1e-5)
    both = fsc(np.roll(a, (3, -2, 5), axis=(0, 1, 2)), np.roll(b, (3, -2, 5), axis=(0, 1, 2)), voxel)
    np.testing.assert_allclose(both.fsc, c.fsc, atol=1e-5)
    cube = _flat_spectrum((32, 32, 32), seed=3)
    c32 = fsc(cube, np.roll(cube, 1, axis=2), voxel_size_A=2.0)
    k = c32.freq_inv_A * 2.0                                         # cycles per voxel
    far = k > 0.1                                                    # shells with many voxels
    np.testing.assert_allclose(c32.fsc[far], np.sinc(2 * k[far]), atol=0.03)
    assert c32.crossing(0.5).resolution_A == pytest.approx(2.0 * 3.31, rel=0.03)


def test_crossing_interpolation_on_a_constructed_curve():
    f = [0.1, 0.2, 0.3, 0.4]
    v = [0.9, 0.7, 0.3, 0.1]
    c05 = crossing(f, v, 0.5)            # between (0.2, 0.7) and (0.3, 0.3): 0.2 + 0.2/0.4 * 0.1
    assert c05.status == "crossed"
    assert c05.freq_inv_A == pytest.approx(0.25) and c05.resolution_A == pytest.approx(4.0)
    c0143 = crossing(f, v, 0.143)        # between (0.3, 0.3) and (0.4, 0.1): 0.3 + 0.157/0.2 * 0.1
    assert c0143.freq_inv_A == pytest.approx(0.3785)
    assert c0143.resolution_A == pytest.approx(1 / 0.3785)
    # the first crossing counts; NaN shells are skipped
    c = crossing([0.1, 0.2, 0.3, 0.4, 0.5], [0.9, np.nan, 0.4, 0.8, 0.1], 0.5)
    assert c.freq_inv_A == pytest.approx(0.1 + 0.4 / 0.5 * 0.2)
    assert crossing(f, [0.9, 0.8, 0.7, 0.6], 0.5).status == "never"
    assert crossing(f, [0.4, 0.3, 0.2, 0.1], 0.5).status == "below_at_start"
    assert crossing(f, [np.nan] * 4, 0.5).status == "no_data"
    assert FSC_THRESHOLDS == (0.5, 0.143)


def test_anisotropic_box_uses_physical_frequencies():
    """In a (8, 16, 32) box a wave of period 4 voxels along z, y or x has the same physical
    frequency, 1 / (4 voxel): it must land in the same shell whatever its axis (with per-axis
    index frequencies the z wave would land in shell 2, not 8)."""
    shape, voxel = (8, 16, 32), 2.0
    rng = np.random.default_rng(4)
    z, y, x = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    same = fsc(rng.standard_normal(shape), rng.standard_normal(shape), voxel)
    assert len(same.fsc) == 16 and same.freq_inv_A[-1] == pytest.approx(0.25)
    for coord in (z, y, x):
        wave = np.cos(2 * np.pi * coord / 4.0)
        c = fsc(wave + 0.5 * rng.standard_normal(shape), wave + 0.5 * rng.standard_normal(shape), voxel)
        assert c.freq_inv_A[np.argmax(c.fsc)] == pytest.approx(1 / (4 * voxel))
        assert np.max(c.fsc) > 0.9
    ident = rng.standard_normal(shape)
    np.testing.assert_allclose(fsc(ident, ident, voxel).fsc, 1.0, atol=1e-6)


def test_soft_mask_and_input_checks():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((12, 12, 12))
    mask = np.zeros_like(a)
    mask[3:9, 3:9, 3:9] = 1.0
    b = a.copy()
    b[0] += 100.0                                  # differences only outside the mask
    np.testing.assert_allclose(fsc(a, b, 1.0, mask=mask).fsc, 1.0, atol=1e-6)
    assert np.min(fsc(a, b, 1.0).fsc) < 0.5
    with pytest.raises(ValueError, match=r"\(12, 12, 12\) vs \(12, 12, 11\)"):
        fsc(a, a[:, :, :11], 1.0)
    with pytest.raises(ValueError, match="voxel_size_A"):
        fsc(a, a, 0.0)
    with pytest.raises(ValueError, match="mask"):
        fsc(a, a, 1.0, mask=-mask)


# --------------------------------------------------------------------------------------- missing wedge
def _plate(normal_angle_deg):
    """A thin plate (2 voxels thick, 24 x 28 wide) whose normal lies in the (x, z) plane at
    ``normal_angle_deg`` from +x toward +z: body axis 0 = (cos a, 0, sin a)."""
    from fasttomo.data.phantom import Ellipsoid

    a = math.radians(normal_angle_deg)
    rot = np.array([[math.cos(a), 0.0, -math.sin(a)], [0.0, 1.0, 0.0], [math.sin(a), 0.0, math.cos(a)]])
    return Ellipsoid((0.0, 0.0, 0.0), (1.0, 12.0, 14.0), rot)


def test_wedge_convention_follows_the_projection_geometry():
    """Projection-slice argument, checked with fasttomo's own analytic projector: a plate whose
    normal points at +30 degrees in (x, z) is seen edge-on at tilt +30 (the ray direction
    (-sin 30, 0, cos 30) lies in the plate), so that view has the long chords; by the
    projection-slice theorem its power lies along (kx, kz) ~ (cos 30, sin 30). It must therefore be
    in the measured region of a 0..+45 degree series and in the missing wedge of -45..0. (Not all
    of it: the plate's finite size spreads some power over other angles, and the ky axis and the
    kz = 0 plane, angle 0, belong to both ranges.)"""
    from fasttomo.data.phantom import Phantom, project, voxelize

    ph = Phantom((32, 32, 32), [_plate(30.0)])
    views = project(ph, np.array([30.0, -30.0]))
    assert views[0].max() > 4 * views[1].max()                 # edge-on at +30, not at -30
    vol = voxelize(ph)
    vol -= vol.mean()
    share = {}
    for rng_deg in ((0.0, 45.0), (-45.0, 0.0)):
        s = sector_fsc(vol, vol, 1.0, rng_deg)
        share[rng_deg] = s["measured"].power_a.sum() / (s["measured"].power_a.sum() + s["wedge"].power_a.sum())
    assert share[(0.0, 45.0)] > 0.9 and share[(-45.0, 0.0)] < 0.15, share
    # an exact case: a single plane wave with (kx, kz) = (7/32, 4/32), at atan(4/7) = 29.7 degrees
    z, _, x = np.meshgrid(*(np.arange(32) for _ in range(3)), indexing="ij")
    wave = np.cos(2 * np.pi * (7 * x + 4 * z) / 32.0)
    for rng_deg, region in (([0.0, 45.0], "measured"), ([-45.0, 0.0], "wedge"), ([29.0, 30.0], "measured"),
                            ([30.0, 31.0], "wedge"), ([-60.0, 60.0], "measured")):
        s = sector_fsc(wave, wave, 1.0, rng_deg)
        other = "wedge" if region == "measured" else "measured"
        assert s[other].power_a.sum() < 1e-6 * s[region].power_a.sum(), (rng_deg, region)


def test_measured_region_map():
    m = measured_region((16, 4, 16), [-60.0, 60.0])
    kz = np.fft.fftfreq(16)[:, None]
    kx = np.fft.rfftfreq(16)[None, :]
    assert m[0, 0]                                 # the ky axis is measured
    assert np.all(m[0, 1:])                        # kz = 0: angle 0, inside any range holding 0
    assert not np.any(m[1:, 0])                    # kx = 0, kz != 0: angle 90, the wedge of +-60
    ang = np.degrees(np.arctan2(np.abs(kz), kx))
    np.testing.assert_array_equal(m[1:, 1:], (ang <= 60 + 1e-9)[1:, 1:])
    assert np.all(measured_region((8, 4, 8), [-90.0, 90.0]))
    with pytest.raises(ValueError, match="min < max"):
        measured_region((8, 8, 8), [10.0, -10.0])


def test_sector_fsc_separates_measured_and_wedge():
    """a = plate(+30) + plate(-30), b = plate(+30) - plate(-30): in the measured region of a
    0..45 series (where plate(+30) lives) the two agree (FSC near +1), in its wedge (plate(-30))
    they are opposite (near -1); the curves per region partition the whole."""
    from fasttomo.data.phantom import Phantom, voxelize

    p = voxelize(Phantom((32, 32, 32), [_plate(30.0)]))
    q = voxelize(Phantom((32, 32, 32), [_plate(-30.0)]))
    s = sector_fsc(p + q, p - q, 1.0, [0.0, 45.0])

    def weighted(curve):
        w = np.sqrt(curve.power_a * curve.power_b)
        ok = np.isfinite(curve.fsc)
        return float((curve.fsc[ok] * w[ok]).sum() / w[ok].sum())

    assert weighted(s["measured"]) > 0.8
    assert weighted(s["wedge"]) < -0.8
    np.testing.assert_array_equal(s["measured"].n_voxels + s["wedge"].n_voxels, s["all"].n_voxels)
    np.testing.assert_allclose(s["measured"].power_a + s["wedge"].power_a, s["all"].power_a, rtol=1e-9)
    flipped = sector_fsc(p + q, p - q, 1.0, [-45.0, 0.0])
    assert weighted(flipped["measured"]) < -0.8 and weighted(flipped["wedge"]) > 0.8


# --------------------------------------------------------------------------------------- PSNR
def test_psnr_and_mse_hand_computed():
    truth = np.zeros((2, 2, 2))
    recon = np.full((2, 2, 2), 0.1)
    assert mse(recon, truth) == pytest.approx(0.01)
    assert psnr(recon, truth, data_range=1.0) == pytest.approx(20.0)            # 10 log10(1 / 0.01)
    assert psnr(recon, truth, data_range=2.0) == pytest.approx(20.0 + 20 * math.log10(2.0))
    assert psnr(truth, truth, data_range=1.0) == math.inf
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="data_range"):
            psnr(recon, truth, data_range=bad)
    with pytest.raises(TypeError):
        psnr(recon, truth)  # no silent default  # type: ignore[call-arg]


def test_volume_metrics_unchanged():
    t = np.zeros((4, 4, 4))
    t[1:3, 1:3, 1:3] = 1.0
    m = volume_metrics(t, t)
    assert m["pearson_global"] == pytest.approx(1.0) and m["foreground_fraction"] == pytest.approx(8 / 64)


# --------------------------------------------------------------------------------------- projections
def _stack():
    pattern = np.arange(20, dtype=float).reshape(4, 5)          # values 0..19
    measured = np.stack([pattern] * 3)
    predicted = np.stack([pattern, 2 * pattern + 1, -pattern])
    return measured, predicted


def test_per_view_metrics_hand_computed():
    measured, predicted = _stack()
    pm = projection_metrics(measured, predicted)
    np.testing.assert_allclose(pm.pearson, [1.0, 1.0, -1.0])
    # residuals: 0; pattern - (2 pattern + 1) = -(k + 1), k = 0..19; pattern + pattern = 2k
    rms1 = math.sqrt(sum((k + 1) ** 2 for k in range(20)) / 20)            # sqrt(143.5)
    rms2 = 2 * math.sqrt(sum(k * k for k in range(20)) / 20)               # 2 sqrt(123.5)
    np.testing.assert_allclose(pm.rms, [0.0, rms1, rms2])
    np.testing.assert_allclose(pm.rel_rms, pm.rms / np.arange(20).std())
    np.testing.assert_array_equal(pm.n_pixels, [20, 20, 20])
    s = pm.summary()
    assert s["pearson_min"] == pytest.approx(-1.0) and s["pearson_worst_index"] == 2
    assert s["rms_max"] == pytest.approx(rms2) and s["rms_worst_index"] == 2
    assert s["pearson_mean"] == pytest.approx(1 / 3)
    held = pm.summary([0, 1])
    assert held["n_views"] == 2 and held["pearson_min"] == pytest.approx(1.0) and held["rms_worst_index"] == 1


def test_per_view_metrics_mask_and_fits():
    measured, predicted = _stack()
    valid = np.ones(measured.shape, dtype=bool)
    valid[1] = False                               # view 1 has no valid pixel
    valid[0, 0, 0] = False
    pm = projection_metrics(measured, predicted, valid)
    assert np.isnan(pm.pearson[1]) and np.isnan(pm.rms[1]) and pm.n_pixels.tolist() == [19, 0, 20]
    assert pm.summary()["pearson_mean"] == pytest.approx(0.0)                 # views 0 and 2 only
    per = projection_metrics(measured, predicted, fit="per_view")
    np.testing.assert_allclose(per.rms, 0.0, atol=1e-9)                       # every view is affine
    np.testing.assert_allclose(per.pearson, 1.0)                              # |r| under a per-view fit
    np.testing.assert_allclose(per.scale, [1.0, 0.5, -1.0])
    # one global scale and offset: predicted = (measured - 3) / 2 for every view
    glob = projection_metrics(measured, (measured - 3.0) / 2.0, fit="global")
    np.testing.assert_allclose(glob.rms, 0.0, atol=1e-9)
    np.testing.assert_allclose(glob.scale, 2.0)
    np.testing.assert_allclose(glob.offset, 3.0)
    # a global fit keeps a per-view intensity error visible (a per-view fit hides it): view 3 of 6
    six = np.stack([measured[0]] * 6)
    pred = six.copy()
    pred[3] *= 2.0
    glob2 = projection_metrics(six, pred, fit="global")
    assert glob2.summary()["rms_worst_index"] == 3 and glob2.rms[3] > 2 * np.delete(glob2.rms, 3).max()
    np.testing.assert_allclose(projection_metrics(six, pred, fit="per_view").rms, 0.0, atol=1e-9)
    with pytest.raises(ValueError, match="fit"):
        projection_metrics(measured, predicted, fit="affine")
    with pytest.raises(ValueError, match="same shape"):
        projection_metrics(measured, predicted[:2])


# ----------------------------------------------------------------------------------- chunked FSC (issue 26)
def _smooth_pair(shape=(48, 96, 96), noise=0.15, seed=0):
    """A smooth periodic random volume (Gaussian low-pass, sigma 1.5 voxels) and it plus white
    noise: an FSC that falls through 0.5 and 0.143 well inside Nyquist."""
    rng = np.random.default_rng(seed)
    k = np.meshgrid(*(np.fft.fftfreq(n) for n in shape), indexing="ij")
    gain = np.exp(-2 * (np.pi * 1.5) ** 2 * sum(x * x for x in k))
    truth = np.real(np.fft.ifftn(np.fft.fftn(rng.normal(size=shape)) * gain)).astype(np.float32)
    truth /= truth.std()
    return (truth + noise * rng.normal(size=shape)).astype(np.float32), truth


def test_chunked_fsc_with_a_crop_covering_the_volume_is_the_one_shot_fsc():
    from fasttomo.quality.metrics import chunked_fsc, sector_fsc

    rec, truth = _smooth_pair()
    one = sector_fsc(rec, truth, 2.0, (-60, 60))
    chunked = chunked_fsc(rec, truth, 2.0, (-60, 60), crop=96)
    for region in one:
        np.testing.assert_array_equal(chunked[region].fsc, one[region].fsc)
        np.testing.assert_array_equal(chunked[region].n_voxels, one[region].n_voxels)


def test_chunked_fsc_from_smaller_crops_agrees_within_the_stated_tolerance(tmp_path):
    """Crops of 48 (9 of them over 48 x 96 x 96, from a memory map): the 0.5 and 0.143 crossings
    within 5 % of the one-shot FSC's, the curve within 0.1 at the crops' shells."""
    from fasttomo.quality.metrics import chunked_fsc, fsc

    rec, truth = _smooth_pair()
    mapped = np.memmap(tmp_path / "rec.f32", dtype=np.float32, mode="w+", shape=rec.shape)
    mapped[:] = rec
    one = fsc(rec, truth, 2.0)
    chunked = chunked_fsc(mapped, truth, 2.0, crop=48)["all"]
    for t in (0.5, 0.143):
        assert chunked.crossing(t).resolution_A == pytest.approx(one.crossing(t).resolution_A, rel=0.05)
    at_crop_shells = np.interp(chunked.freq_inv_A, one.freq_inv_A, one.fsc)
    assert np.nanmax(np.abs(at_crop_shells - chunked.fsc)) < 0.1


def test_crop_positions_overlap_by_half_then_sample_evenly():
    from fasttomo.quality.metrics import crop_starts

    assert crop_starts(96, 96, 64) == [0] and crop_starts(80, 96, 64) == [0]
    assert crop_starts(96, 48, 64) == [0, 24, 48]
    assert crop_starts(1024, 256, 64) == [0, 128, 256, 384, 512, 640, 768]
    assert crop_starts(4096, 256, 4) == [0, 1280, 2560, 3840]
    assert crop_starts(1000, 256, 1) == [372]  # the central crop


def test_streamed_volume_metrics_equal_the_whole_volume_ones():
    from fasttomo.quality.metrics import mse, streamed_volume_metrics, volume_metrics

    rec, truth = _smooth_pair((20, 16, 16))
    truth += 3.0
    whole = {**volume_metrics(rec, truth), "mse": mse(rec, truth)}
    streamed = streamed_volume_metrics(rec, truth, planes=3)
    for key, value in whole.items():
        assert streamed[key] == pytest.approx(value, rel=1e-9), key
    assert (streamed["truth_min"], streamed["truth_max"]) == (float(truth.min()), float(truth.max()))
    assert streamed_volume_metrics(rec, truth) == pytest.approx(streamed, rel=1e-12)  # one slab: the same sums
