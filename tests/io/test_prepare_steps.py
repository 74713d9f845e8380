"""Preparation steps and the bad-input errors of load_tiltseries (real files)."""

import logging

import numpy as np
import pytest
from io_helpers import ANGLES5, data_cfg, make_stack, write_raw_mrc, write_tlt

from fasttomo.config import ConfigError
from fasttomo.data.io import DataFileError
from fasttomo.data.load import load_tiltseries
from fasttomo.data.prepare import rotate_tilt_axis
from fasttomo.data.tiltseries import TiltSeriesError


def _files(tmp_path, stack=None, angles=ANGLES5, voxel=2.0, name="s"):
    stack = make_stack() if stack is None else stack
    return (write_raw_mrc(tmp_path / f"{name}.mrc", stack, voxel=voxel), write_tlt(tmp_path / f"{name}.rawtlt", angles))


def _load(tmp_path, stack=None, angles=ANGLES5, **kw):
    p, t = _files(tmp_path, stack, angles)
    return load_tiltseries(data_cfg(source="mrc", path=p, angles=t, **kw))


def test_angle_count_mismatch(tmp_path):
    with pytest.raises(DataFileError, match=r"s\.rawtlt: 4 angles .* stack .*s\.mrc has 5 sections"):
        _load(tmp_path, angles=ANGLES5[:4])


def test_duplicate_angles_then_fixed_by_exclusion(tmp_path):
    dup = np.array([-40.0, -20.0, 0.0, 0.0, 40.0])
    with pytest.raises(TiltSeriesError, match=r"s\.mrc \(angles from .*s\.rawtlt\): duplicate tilt angles "
                                              r"\(angle: 1-based views\) \{0\.0: \[3, 4\]\}.*exclude_views=\[4\]"):
        _load(tmp_path, angles=dup)
    ts = _load(tmp_path, angles=dup, exclude_views=[4])
    assert ts.n_tilts == 4 and ts.metadata["view_numbers"] == [1, 2, 3, 5]


def test_a_narrow_tilt_range_is_warned_about(tmp_path, caplog):
    """Two views 6 degrees apart reconstruct, but the log says the volume will be smeared in Z; a
    series over +-40 degrees is not warned about."""
    caplog.set_level(logging.WARNING, logger="fasttomo.data")
    _load(tmp_path, make_stack(n=2), angles=np.array([-6.0, 0.0]))
    assert "the views span only 6 degrees (-6..0); a tomogram's depth resolution comes from its tilt range" in caplog.text
    caplog.clear()
    _load(tmp_path, make_stack(), angles=ANGLES5)
    assert "span only" not in caplog.text


def test_angle_beyond_90(tmp_path):
    with pytest.raises(TiltSeriesError, match=r"s\.rawtlt.*tilt angle 95 degrees for view 5 is not within \(-90, 90\)"
                                              r".*radians"):
        _load(tmp_path, angles=[-40, -20, 0, 20, 95])


@pytest.mark.filterwarnings("ignore:Data array contains NaN")
def test_nonfinite_reject_or_mask(tmp_path):
    st = make_stack()
    st[2, 3, 4] = np.nan
    st[4, 0, 0] = np.inf
    with pytest.raises(TiltSeriesError, match=r"s\.mrc: 2 NaN/Inf pixels \(first at view 3 \(1-based\), row 3, col 4\)"
                                              r".*data\.nonfinite=mask"):
        _load(tmp_path, st)
    ts = _load(tmp_path, st, nonfinite="mask")
    assert ts.valid is not None and ts.valid.shape == st.shape and ts.valid.dtype == bool
    assert not ts.valid[2, 3, 4] and not ts.valid[4, 0, 0] and ts.valid.sum() == st.size - 2
    assert np.isfinite(ts.stack).all()
    np.testing.assert_array_equal(ts.stack[ts.valid], st[ts.valid])


def test_unknown_suffix_and_source_mismatch(tmp_path):
    p = tmp_path / "s.dat"
    p.write_bytes(b"x")
    with pytest.raises(DataFileError, match=r"s\.dat: unknown file suffix '\.dat'"):
        load_tiltseries(data_cfg(source="mrc", path=str(p), angles="a.tlt"))
    n = tmp_path / "s.npy"
    np.save(n, make_stack())
    with pytest.raises(DataFileError, match=r"s\.npy: fasttomo does not read numpy files; save the array as MRC "
                                            r"\(mrcfile\) or HDF5"):
        load_tiltseries(data_cfg(source="mrc", path=str(n), angles="a.tlt"))
    m, t = _files(tmp_path)
    with pytest.raises(DataFileError, match="data.source=hdf5 but the suffix says mrc; use data=mrc"):
        load_tiltseries(data_cfg(source="hdf5", path=m, angles=t))
    with pytest.raises(DataFileError, match=r"nothere\.mrc: file not found"):
        load_tiltseries(data_cfg(source="mrc", path=str(tmp_path / "nothere.mrc")))


def test_exclude_bin_crop(tmp_path):
    st = make_stack(h=12, w=17)
    ts = _load(tmp_path, st, exclude_views=[1, 5], binning=2, crop=[1, 5, 2, 8])
    assert ts.stack.shape == (3, 4, 6) and ts.pixel_size == 4.0
    binned = st[1:4, :12, :16].reshape(3, 6, 2, 8, 2).mean(axis=(2, 4))
    np.testing.assert_allclose(ts.stack, binned[:, 1:5, 2:8], rtol=1e-6)
    np.testing.assert_array_equal(ts.angles, ANGLES5[1:4])
    with pytest.raises(TiltSeriesError, match=r"exclude_views \[9\] are not sections of this 5-view stack"):
        _load(tmp_path, st, exclude_views=[9])
    for every in ([1, 2, 3, 4, 5], [1, 2, 3, 5]):  # all views, or all but one: no reconstruction (a crash before)
        with pytest.raises(TiltSeriesError, match=r"leaves [01] of the 5 views; .* exclude fewer views"):
            _load(tmp_path, st, exclude_views=every)
    with pytest.raises(TiltSeriesError, match=r"data\.crop=\[0, 20, 0, 4\] is not a window .* 6 x 8 image"):
        _load(tmp_path, st, binning=2, crop=[0, 20, 0, 4])
    with pytest.raises(ConfigError, match="data.exclude_views"):
        data_cfg(source="mrc", path="x.mrc", exclude_views=[0])


def test_sorting_keeps_permutation(tmp_path):
    order = [0.0, 3.0, -3.0, 6.0, -6.0]
    st = make_stack()
    ts = _load(tmp_path, st, angles=order)
    np.testing.assert_array_equal(ts.angles, [-6, -3, 0, 3, 6])
    perm = ts.metadata["sort_permutation"]
    assert perm == [4, 2, 0, 1, 3]
    np.testing.assert_array_equal(ts.stack, st[perm])


def test_quantile_normalization_and_inversion(tmp_path):
    st = make_stack()
    ts = _load(tmp_path, st, normalize="quantile")
    flat = ts.stack.ravel()
    assert np.quantile(flat, 0.01) == pytest.approx(0, abs=1e-5) and np.quantile(flat, 0.999) == pytest.approx(1, abs=1e-5)
    inv = _load(tmp_path, st, invert=True)
    np.testing.assert_allclose(inv.stack, st.max() - st)
    invq = _load(tmp_path, st, invert=True, normalize="quantile")
    assert np.corrcoef(invq.stack.ravel(), st.ravel())[0, 1] == pytest.approx(-1, abs=1e-6)


def test_dark_and_blank_views(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="fasttomo.data")
    st = make_stack()
    st[1] *= 0.02  # shutter closed
    st[3] = 42.0  # blank
    with pytest.raises(TiltSeriesError, match=r"view 4 \(1-based\) is blank \(constant: no signal.*view 4: blank "
                                              r"\(std 0 .*data\.exclude_views=\[4\] \(or data\.drop_dark_views=true\)"):
        _load(tmp_path, st)  # a blank view is refused ...
    ts = _load(tmp_path, st, exclude_views=[4])  # ... a dark one is kept, with a warning
    assert ts.n_tilts == 4 and "view 2: dark" in caplog.text
    ts = _load(tmp_path, st, drop_dark_views=True)
    assert ts.metadata["view_numbers"] == [1, 3, 5]
    np.testing.assert_array_equal(ts.angles, ANGLES5[[0, 2, 4]])


def test_hot_pixels_do_not_make_normal_views_dark(tmp_path, caplog):
    """A few 1e6-count pixels (hot pixels, X-ray spikes) in most views lifted the median view mean
    and made normal views look dark; the means now clip each view at its 99th percentile, and a
    really dark view is still found."""
    caplog.set_level(logging.INFO, logger="fasttomo.data")
    st = make_stack(n=5, h=32, w=32)
    st[[0, 2, 3, 4], 5, 7] = 1e6
    ts = _load(tmp_path, st)
    assert ts.n_tilts == 5 and "dark" not in caplog.text
    st[1] *= 0.02  # and a shutter closed in view 2
    _load(tmp_path, st)
    assert "view 2: dark" in caplog.text and "view 1: dark" not in caplog.text


def test_tilt_axis_rotation_is_a_rotation(tmp_path):
    st = make_stack(h=12, w=12)
    # raw images whose tilt axis lies at +90 degrees (counter-clockwise from +Y): the content rotated
    rotated = np.ascontiguousarray(np.rot90(st, k=-1, axes=(1, 2)))
    back, valid = rotate_tilt_axis(rotated, None, 90.0)
    np.testing.assert_allclose(back, st, atol=1e-4)
    assert valid is None
    # non-square: H and W swap when the axis is closer to X
    r2, _ = rotate_tilt_axis(make_stack(h=8, w=14), None, -90.0)
    assert r2.shape == (5, 14, 8)
    np.testing.assert_allclose(r2, np.rot90(make_stack(h=8, w=14), k=-1, axes=(1, 2)), atol=1e-4)
    # small angles: corners without data are masked, the centre is kept
    ts = _load(tmp_path, st, tilt_axis_angle=10.0)
    assert ts.valid is not None and not ts.valid[:, 0, 0].any() and ts.valid[:, 6, 6].all()
    # a feature on the axis stays on it, one off the axis moves the right way
    img = np.zeros((1, 21, 21), np.float32)
    img[0, 10, 15] = 1.0  # x = +5, y = 0 (col 15, row 10)
    out, _ = rotate_tilt_axis(np.repeat(img, 2, 0), None, 90.0)
    # axis at +90 deg (along -X) is rotated by -90 to +Y: the point at +X goes to -Y ... i.e. row 5
    assert np.unravel_index(np.argmax(out[0]), out[0].shape) == (5, 10)


@pytest.mark.parametrize("value", [0.0, 7.5])
def test_a_constant_stack_is_refused(tmp_path, value):
    """An all-zero (or all-constant) stack carries no signal: one line naming the file and the fix."""
    with pytest.raises(TiltSeriesError, match=rf"s\.mrc: every pixel of the stack holds the value {value:g}; a "
                                              r"constant stack carries no signal\. Check data\.path"):
        _load(tmp_path, np.full((5, 12, 16), value, dtype=np.float32))


def test_a_constant_stack_with_masked_nonfinite_pixels_is_refused(tmp_path):
    st = np.zeros((5, 12, 16), dtype=np.float32)
    st[2, 3, 4] = np.nan
    with pytest.raises(TiltSeriesError, match="constant stack carries no signal"):
        _load(tmp_path, st, nonfinite="mask")


@pytest.mark.parametrize("angle", [0.0, 30.0])
def test_a_single_view_is_refused_as_such_not_as_radians(tmp_path, angle):
    with pytest.raises(TiltSeriesError, match=rf"the stack has one view at {angle:g} degrees; a tomogram needs views "
                                              r"at several tilt angles") as info:
        _load(tmp_path, make_stack()[:1], angles=np.array([angle]))
    assert "radians" not in str(info.value)


def _specimen_views(n=5, h=64, w=64, dose=20.0, seed=1):
    """Counts of a low-dose series: smooth mass, a gold bead (radius 3, far brighter than the
    rest) and Poisson noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:h, :w]
    mass = 1.0 + 0.5 * np.exp(-((y - 30) ** 2 + (x - 20) ** 2) / 80.0) + 0.3 * np.sin(x / 5.0) ** 2
    mass[(y - 45) ** 2 + (x - 45) ** 2 <= 9] += 6.0  # the bead: 7 pixels across
    return rng.poisson(dose * np.broadcast_to(mass, (n, h, w))).astype(np.float32)


def test_hot_pixels_are_masked_and_a_gold_bead_is_not(tmp_path, caplog):
    """A defect or X-ray hit (one pixel far above its neighbours) trained as mass: the review's run
    with 20 pixels of 1e6 counts reached Pearson 0.74. Such pixels are now masked; real structure,
    which the microscope spreads over several pixels, is not, even a bead 7x the background."""
    caplog.set_level(logging.INFO, logger="fasttomo.data")
    st = _specimen_views()
    planted = [(0, 5, 7), (2, 30, 20), (2, 31, 20), (3, 0, 63), (4, 45, 45)]  # a pair, a corner, on the bead
    for v, r, c in planted:
        st[v, r, c] = 1e6
    ts = _load(tmp_path, st)
    assert ts.valid is not None
    assert sorted(map(tuple, np.argwhere(~ts.valid))) == sorted(planted)
    assert "5 hot pixels" in caplog.text and "in 4 views (1, 3, 4, 5" in caplog.text
    assert ts.stack.max() < 1000  # filled, not 1e6
    assert _load(tmp_path, st, hot_pixels="keep").valid is None


def _dot_series(axis_deg=0.0, n=21, size=96, seed=0):
    """Counts of a sparse specimen: 4 small bright particles (Gaussian, sigma 0.8 px, 10x the
    background) projected at 21 tilts over +-60 degrees about a tilt axis at ``axis_deg`` (counter-
    clockwise from +Y, as data.tilt_axis_angle), with Poisson noise. Each particle is far brighter
    than its 24 neighbours' 6th-brightest, so only the views beside tell it from an X-ray hit."""
    rng = np.random.default_rng(seed)
    angles = np.linspace(-60.0, 60.0, n)
    pts = rng.uniform(-30, 30, (4, 3))  # x, y, z in pixels from the centre
    yy, xx = np.mgrid[:size, :size] - (size - 1) / 2
    c, s = np.cos(np.deg2rad(axis_deg)), np.sin(np.deg2rad(axis_deg))
    stack = np.empty((n, size, size), np.float32)
    for i, a in enumerate(np.deg2rad(angles)):
        img = np.full((size, size), 20.0)
        for x, y, z in pts:
            u = x * np.cos(a) + z * np.sin(a)  # across the axis
            img += 200 * np.exp(-((xx - (u * c - y * s)) ** 2 + (yy - (u * s + y * c)) ** 2) / (2 * 0.8 ** 2))
        stack[i] = rng.poisson(img)
    return stack, angles


X_RAY_HITS = [(3, 10, 70, [(0, 0), (0, 1), (1, 0)]), (8, 60, 12, [(0, 0), (0, 1), (1, 0), (1, 1)]),
              (15, 80, 80, [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)])]


def test_x_ray_clusters_of_one_view_are_masked_and_small_particles_are_not(tmp_path, caplog):
    """Clusters of 3 to 6 pixels far above their surroundings in one view only (X-ray hits) are
    masked; small bright particles, as compact but in every view (moving across the tilt axis), are
    not."""
    caplog.set_level(logging.WARNING, logger="fasttomo.data")
    stack, angles = _dot_series()
    assert _load(tmp_path, stack, angles).valid is None  # every particle pixel kept
    assert "hot pixels" not in caplog.text
    planted = []
    for view, r0, c0, shape in X_RAY_HITS:
        for dr, dc in shape:
            stack[view, r0 + dr, c0 + dc] = 5000.0
            planted.append((view, r0 + dr, c0 + dc))
    ts = _load(tmp_path, stack, angles)
    assert ts.valid is not None
    assert sorted(map(tuple, np.argwhere(~ts.valid))) == sorted(planted)
    assert "0 hot pixels" in caplog.text and "13 pixels in 3 bright clusters (up to 6 pixels) in 3 views (4, 9, 16" in caplog.text


@pytest.mark.parametrize("axis, masked", [(30.0, False), (-30.0, True)])
def test_the_views_beside_are_searched_across_the_tilt_axis(tmp_path, caplog, axis, masked):
    """Particles move across the tilt axis data.tilt_axis_angle gives (here 30 degrees from +Y):
    searched there, none is taken for an X-ray hit; searched across an axis of the wrong sign, some
    are."""
    caplog.set_level(logging.WARNING, logger="fasttomo.data")
    stack, angles = _dot_series(axis_deg=30.0)
    _load(tmp_path, stack, angles, tilt_axis_angle=axis)
    assert ("bright clusters" in caplog.text) == masked


def test_a_detector_defect_is_masked_in_every_view(tmp_path):
    """A hot pixel at one place in every view is in the views beside too, like structure, but in a
    quarter of the views or more it is a defect of the camera: masked wherever it is hot."""
    stack, angles = _dot_series()
    stack[:, 40, 50] = 5000.0
    ts = _load(tmp_path, stack, angles)
    assert ts.valid is not None
    assert sorted(map(tuple, np.argwhere(~ts.valid))) == [(v, 40, 50) for v in range(len(stack))]


def test_a_noisy_series_without_defects_keeps_every_pixel(tmp_path):
    assert _load(tmp_path, _specimen_views(dose=5.0)).valid is None
    assert _load(tmp_path, make_stack(n=5, h=32, w=32)).valid is None
