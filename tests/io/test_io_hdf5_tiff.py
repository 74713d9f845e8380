"""HDF5 (own layout, user-named paths) and TIFF stacks; tilt-series writer round trips."""

import logging

import h5py
import numpy as np
import pytest
import tifffile
from io_helpers import ANGLES5, data_cfg, make_stack, write_tlt

from fasttomo.data.io import DataFileError, OutputExistsError, write_tiltseries
from fasttomo.data.io.hdf5 import read_stack_h5
from fasttomo.data.load import load_tiltseries
from fasttomo.data.tiltseries import TiltSeries, TiltSeriesError


def _ts(**kw):
    kw.setdefault("pixel_size", 2.17)
    return TiltSeries(stack=make_stack(), angles=ANGLES5, source="test", metadata={"k": [1, 2]}, **kw)


def test_own_layout_round_trip_with_valid_and_ground_truth(tmp_path):
    valid = np.ones((5, 12, 16), bool)
    valid[1, 2, 3] = False
    gt = np.random.default_rng(1).random((6, 12, 16)).astype(np.float32)
    ts = _ts(valid=valid, ground_truth=gt)
    p = tmp_path / "ts.h5"
    write_tiltseries(p, ts, "h5")
    with pytest.raises(OutputExistsError, match="output.overwrite=true"):
        write_tiltseries(p, ts, "h5")
    with h5py.File(p) as f:
        assert f["/tiltseries"].attrs["units"] == "angstrom"
        assert f["/tiltseries/angles"].attrs["units"] == "degrees"
    back = load_tiltseries(data_cfg(source="hdf5", path=str(p)))
    np.testing.assert_array_equal(back.stack[valid], ts.stack[valid])
    np.testing.assert_array_equal(back.angles, ts.angles)
    np.testing.assert_array_equal(back.valid, valid)
    np.testing.assert_array_equal(back.ground_truth, gt)
    assert back.pixel_size == 2.17 and back.metadata["k"] == [1, 2]


def test_per_line_angles_carried_through(tmp_path):
    per_line = ANGLES5[:, None] + np.linspace(-2, 2, 12)[None, :]
    ts = TiltSeries(stack=make_stack(), angles=per_line, pixel_size=1.5)
    write_tiltseries(tmp_path / "pl.h5", ts)
    back = load_tiltseries(data_cfg(source="hdf5", path=str(tmp_path / "pl.h5"), binning=2))
    assert back.angles.shape == (5, 6)
    np.testing.assert_allclose(back.angles, per_line.reshape(5, 6, 2).mean(axis=2))
    assert back.pixel_size == 3.0
    write_tiltseries(tmp_path / "pl.mrc", ts)  # .rawtlt holds one view per line
    back = load_tiltseries(data_cfg(source="mrc", path=str(tmp_path / "pl.mrc"), angles=str(tmp_path / "pl.rawtlt")))
    np.testing.assert_array_equal(back.angles, per_line)


@pytest.mark.parametrize("fmt", ["mrc", "tiff"])
def test_mrc_and_tiff_tiltseries_round_trip(tmp_path, fmt):
    ts = _ts()
    paths = write_tiltseries(tmp_path / f"ts.{'tif' if fmt == 'tiff' else 'mrc'}", ts, fmt)
    assert paths[1].endswith("ts.rawtlt")
    back = load_tiltseries(data_cfg(source=fmt, path=paths[0], angles=paths[1]))
    np.testing.assert_array_equal(back.stack, ts.stack)
    np.testing.assert_array_equal(back.angles, ts.angles)
    assert back.pixel_size == 2.17


def test_user_named_paths_and_attributes(tmp_path):
    p = tmp_path / "user.hdf5"
    raw = (make_stack() * 10).astype(np.uint16)
    with h5py.File(p, "w") as f:
        d = f.create_dataset("entry/data/projections", data=raw)
        f["entry"].attrs["pixel_nm"] = 0.5  # on a parent group
        d.attrs["tilts"] = ANGLES5
    cfg = data_cfg(source="hdf5", path=str(p), hdf5_stack="/entry/data/projections", hdf5_angles="tilts",
                   hdf5_pixel_size="pixel_nm")
    ts = load_tiltseries(cfg)
    np.testing.assert_array_equal(ts.stack, raw.astype(np.float32))
    np.testing.assert_array_equal(ts.angles, ANGLES5)
    assert ts.pixel_size == 0.5
    assert ts.metadata["angle_source"] == f"attribute 'tilts' of /entry/data/projections in {p}"  # where they were
    with h5py.File(p, "a") as f:
        f["angles_deg"] = ANGLES5[::-1].copy()
        f["px"] = 3.0
    ts = load_tiltseries(data_cfg(source="hdf5", path=str(p), hdf5_stack="/entry/data/projections",
                                  hdf5_angles="/angles_deg", hdf5_pixel_size="/px"))
    assert ts.pixel_size == 3.0 and ts.metadata["view_numbers"] == [5, 4, 3, 2, 1]


def test_missing_dataset_path(tmp_path):
    p = tmp_path / "m.h5"
    with h5py.File(p, "w") as f:
        f["data"] = make_stack()
    with pytest.raises(DataFileError, match=r"m\.h5: no dataset '/tiltseries/stack'.*/data \(5, 12, 16\).*data\.hdf5_stack"):
        load_tiltseries(data_cfg(source="hdf5", path=str(p)))
    with pytest.raises(DataFileError, match=r"m\.h5: no tilt angles"):
        load_tiltseries(data_cfg(source="hdf5", path=str(p), hdf5_stack="/data"))
    t = write_tlt(tmp_path / "m.tlt", ANGLES5)
    assert load_tiltseries(data_cfg(source="hdf5", path=str(p), hdf5_stack="/data", angles=t)).n_tilts == 5


def test_a_stack_stored_tilts_last_is_named_so(tmp_path):
    p = tmp_path / "hwn.h5"
    with h5py.File(p, "w") as f:  # (H, W, n_tilts): 12 x 16 x 5, the angles beside it
        f["tiltseries/stack"] = np.moveaxis(make_stack(), 0, -1)
        f["tiltseries/angles"] = ANGLES5
    with pytest.raises(DataFileError, match=r"angles of shape \(5,\) for a stack of 12 sections of 16 lines.*The "
                                            r"stack's last axis has 5 entries, as many as the angles: is it stored "
                                            r"\(H, W, n_tilts\)\? Store it as \(n_tilts, H, W\) \(numpy: "
                                            r"np\.moveaxis\(stack, -1, 0\)\)\.$"):
        load_tiltseries(data_cfg(source="hdf5", path=str(p)))


def test_hdf5_angles_and_pixel_sizes_that_are_not_numbers(tmp_path, caplog):
    """A text attribute ('10 A'), angles stored as one string or as a compound dataset: no traceback;
    a pixel size that is no number (or 0, NaN, < 0) is ignored and said so (data.pixel_size
    overrides it); angles that are no numbers are an error naming where and the fix unless
    data.angles gives them."""
    p = tmp_path / "odd.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("stack", data=make_stack())
        d.attrs["pixel_size_A"] = "10 A"
        f["angles"] = ANGLES5
        d.attrs["tilts"] = " ".join(map(str, ANGLES5))
        f["table"] = np.array([(a, i) for i, a in enumerate(ANGLES5)], dtype=[("tilt", "<f8"), ("n", "<i4")])
    cfg = dict(source="hdf5", path=str(p), hdf5_stack="/stack", hdf5_angles="/angles")
    caplog.set_level(logging.INFO, logger="fasttomo.data")
    for bad, shown in (("10 A", "'10 A', not numbers (a pixel size in Angstrom)"),
                       *((v, f"{v}, not a pixel size in Angstrom") for v in (0.0, float("nan"), -3.0))):
        with h5py.File(p, "a") as f:
            f["stack"].attrs["pixel_size_A"] = bad
        caplog.clear()
        ts = load_tiltseries(data_cfg(**cfg))
        assert ts.metadata["pixel_size_assumed"] and "pixel size from" not in caplog.text
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"attribute 'pixel_size_A' of /stack holds {shown}; ignored" in w for w in warned), warned
    assert load_tiltseries(data_cfg(**dict(cfg, pixel_size=2.0))).pixel_size == 2.0
    for name, where in (("tilts", "attribute 'tilts' of /stack"), ("/table", "dataset /table")):
        with pytest.raises(DataFileError, match=rf"no tilt angles: {where} holds .*not numbers \(tilt angles in "
                                                r"degrees\).*data\.hdf5_angles=<dataset path>"):
            load_tiltseries(data_cfg(**dict(cfg, hdf5_angles=name)))
        t = write_tlt(tmp_path / "odd.tlt", ANGLES5)
        assert load_tiltseries(data_cfg(**dict(cfg, hdf5_angles=name, angles=t))).n_tilts == 5
    with pytest.raises(DataFileError, match=r"no tilt angles: No dataset '/nope'.*'/angles \(5,\)'.*"
                                            r"data\.hdf5_angles"):
        load_tiltseries(data_cfg(**dict(cfg, hdf5_angles="/nope")))


def test_tiff_pages_appended_one_by_one_are_one_stack(tmp_path):
    """tifffile.imwrite(..., append=True) per view writes a series per page: all pages are the
    views (not "a single image")."""
    raw = make_stack()
    p = tmp_path / "pages.tif"
    for view in raw:
        tifffile.imwrite(p, view, append=True)
    with tifffile.TiffFile(p) as t:
        assert len(t.series) == 5
    t = write_tlt(tmp_path / "pages.tlt", ANGLES5)
    np.testing.assert_array_equal(load_tiltseries(data_cfg(source="tiff", path=str(p), angles=t)).stack, raw)


def test_images_narrower_than_three_pixels_are_refused_by_name():
    with pytest.raises(TiltSeriesError, match=r"stack shape \(5, 2, 64\) is too small; need at least 2 tilts of "
                                              r"3 x 3 pixels"):
        TiltSeries(stack=np.ones((5, 2, 64), np.float32), angles=ANGLES5, pixel_size=1.0)


def test_hdf5_wrong_dimensionality(tmp_path):
    p = tmp_path / "w.h5"
    with h5py.File(p, "w") as f:
        f["tiltseries/stack"] = make_stack()[0]
    with pytest.raises(DataFileError, match=r"w\.h5: dataset /tiltseries/stack has shape \(12, 16\) \(2-D\)"):
        load_tiltseries(data_cfg(source="hdf5", path=str(p)))


def test_hdf5_empty_truncated_corrupt(tmp_path):
    e = tmp_path / "e.h5"
    e.write_bytes(b"")
    with pytest.raises(DataFileError, match=r"e\.h5: the file is empty"):
        read_stack_h5(e)
    p = tmp_path / "t.h5"
    write_tiltseries(p, _ts(), "h5")
    blob = p.read_bytes()
    p.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataFileError, match=rf"t\.h5: truncated HDF5 file: it should be {len(blob)} bytes but has "
                                            rf"{len(blob) // 2}"):
        read_stack_h5(p)
    c = tmp_path / "c.h5"
    c.write_bytes(b"not an hdf5 file at all" * 50)
    with pytest.raises(DataFileError, match=r"c\.h5: not a readable HDF5 file"):
        read_stack_h5(c)


def test_tiff_multipage_integer_and_errors(tmp_path, caplog):
    raw = (make_stack() * 10).astype(np.uint16)
    p = tmp_path / "s.tif"
    tifffile.imwrite(p, raw)
    t = write_tlt(tmp_path / "s.rawtlt", ANGLES5)
    ts = load_tiltseries(data_cfg(source="tiff", path=str(p), angles=t))
    np.testing.assert_array_equal(ts.stack, raw.astype(np.float32))
    assert ts.metadata["pixel_size_assumed"] and "assuming 1.0 A" in caplog.text
    one = tmp_path / "one.tif"
    tifffile.imwrite(one, raw[0])
    with pytest.raises(DataFileError, match=r"one\.tif.*2-D.*single image"):
        load_tiltseries(data_cfg(source="tiff", path=str(one), angles=t))
    bad = tmp_path / "bad.tif"
    bad.write_bytes(b"II*\x00garbage")
    with pytest.raises(DataFileError, match=r"bad\.tif: not a readable TIFF"):
        load_tiltseries(data_cfg(source="tiff", path=str(bad), angles=t))


def test_tiff_pages_of_different_sizes_are_named(tmp_path):
    """Page 6 of another size: the error says so (not "a single image")."""
    p = tmp_path / "mixed.tif"
    with tifffile.TiffWriter(p) as w:
        for i in range(8):
            w.write(make_stack(n=1, h=14 if i == 5 else 12)[0], contiguous=False)
    angles = write_tlt(tmp_path / "a.tlt", np.linspace(-60, 60, 8))
    with pytest.raises(DataFileError, match=r"mixed\.tif: its pages differ in size: page 1 is 12 x 16 pixels, "
                                            r"page 6 is 14 x 16 \(of 8 pages\)") as info:
        load_tiltseries(data_cfg(source="tiff", path=str(p), angles=angles, pixel_size=1.0))
    assert "single image" not in str(info.value)


def test_tiff_imagej_spacing_in_nm(tmp_path):
    p = tmp_path / "nm.tif"
    tifffile.imwrite(p, make_stack(), imagej=True, resolution=(1 / 0.25, 1 / 0.25), metadata={"unit": "nm"})
    t = write_tlt(tmp_path / "nm.tlt", ANGLES5)
    assert load_tiltseries(data_cfg(source="tiff", path=str(p), angles=t)).pixel_size == pytest.approx(2.5)


def test_a_tilt_series_with_non_finite_pixels_names_their_count_and_the_first():
    """The check runs view by view (no stack-sized mask) and still counts every bad pixel."""


    stack = make_stack()
    stack[2, 4, 5], stack[2, 7, 1], stack[4, 0, 0] = np.nan, np.inf, -np.inf
    with pytest.raises(TiltSeriesError, match=r"3 NaN/Inf pixels \(first at view, row, col = \[2, 4, 5\]\)"):
        TiltSeries(stack=stack, angles=ANGLES5, pixel_size=1.0)
