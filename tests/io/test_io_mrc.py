"""MRC stacks: modes, extended headers, permissive quirks, damaged files (real files via mrcfile)."""

import logging
import re
import struct

import mrcfile
import numpy as np
import pytest
from io_helpers import ANGLES5, data_cfg, make_stack, write_raw_mrc, write_tlt
from mrcfile.dtypes import get_ext_header_dtype

from fasttomo.data.io import DataFileError
from fasttomo.data.io.mrc import read_mrc
from fasttomo.data.load import load_tiltseries


def _load(tmp_path, data, angles=ANGLES5, **kw):
    p = write_raw_mrc(tmp_path / "s.mrc", data, voxel=kw.pop("voxel", 3.5))
    t = write_tlt(tmp_path / "s.rawtlt", angles)
    return load_tiltseries(data_cfg(source="mrc", path=p, angles=t, **kw))


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.float32, np.uint16, np.float16])
def test_modes_read_exactly(tmp_path, dtype, caplog):
    caplog.set_level(logging.INFO, logger="fasttomo.data")
    raw = (make_stack() - 50).clip(-100, 100).astype(dtype) if dtype != np.uint16 else make_stack().astype(dtype)
    ts = _load(tmp_path, raw)
    assert ts.stack.dtype == np.float32
    np.testing.assert_array_equal(ts.stack, raw.astype(np.float32))
    assert ts.pixel_size == pytest.approx(3.5)
    if np.issubdtype(dtype, np.integer):
        assert "min" in caplog.text and "median" in caplog.text and "max" in caplog.text


def test_integer_offset_is_explicit(tmp_path):
    raw = make_stack().astype(np.uint16)
    ts = _load(tmp_path, raw, intensity_offset=10.0)
    np.testing.assert_array_equal(ts.stack, raw.astype(np.float32) - 10)


def test_mode0_unsigned_when_imod_says_so(tmp_path):
    raw = np.arange(5 * 4 * 4, dtype=np.uint8).reshape(5, 4, 4) * 2  # values up to 158 > 127
    p = write_raw_mrc(tmp_path / "b.mrc", raw.view(np.int8), voxel=1.5,
                      patch={152: struct.pack("<ii", 1146047817, 0)})
    m = read_mrc(p)
    assert m.data.dtype == np.uint8
    np.testing.assert_array_equal(m.data, raw)
    p2 = write_raw_mrc(tmp_path / "c.mrc", raw.view(np.int8), voxel=1.5,
                       patch={152: struct.pack("<ii", 1146047817, 1)})
    assert read_mrc(p2).data.dtype == np.int8  # signed flag set: MRC2014 signed bytes


def test_unsigned_bytes_without_a_stamp_are_read_signed_with_a_warning(tmp_path):
    """A mode-0 file without IMOD's stamp is MRC2014 signed bytes and is read so (never guessed);
    when its values jump between 127 and -128 from pixel to pixel, as a 0..255 image read signed
    does, the notes say so and how to fix the file. A signed image around 0 gets no such note."""
    y, x = np.mgrid[:32, :48]
    image = 128 + 60 * np.sin(x / 5.0) * np.cos(y / 7.0) + np.random.default_rng(0).normal(0, 6, (32, 48))
    unsigned = np.stack([image] * 5).clip(0, 255).astype(np.uint8)
    m = read_mrc(write_raw_mrc(tmp_path / "u.mrc", unsigned.view(np.int8), voxel=1.5))
    assert m.data.dtype == np.int8
    assert any("jump between 127 and -128" in n and "convert the stack to 16-bit or float MRC" in n for n in m.notes)
    signed = (unsigned.astype(np.int16) - 128).astype(np.int8)
    m = read_mrc(write_raw_mrc(tmp_path / "s.mrc", signed, voxel=1.5))
    assert not any("127 and -128" in n for n in m.notes)


def _fei(n, kind, angles, pix_m, axis):
    ext = np.zeros(n, dtype=get_ext_header_dtype(kind))
    ext["Metadata size"] = ext.dtype.itemsize
    ext["Metadata version"] = 0 if kind == b"FEI1" else 2
    ext["Alpha tilt"] = angles
    ext["Pixel size X"] = pix_m
    ext["Pixel size Y"] = pix_m
    ext["Tilt axis angle"] = axis
    return ext


@pytest.mark.parametrize("kind", [b"FEI1", b"FEI2"])
def test_fei_extended_header(tmp_path, kind, caplog):
    angles = np.array([-30.0, -15.0, 0.0, 15.0, 30.0])
    p = write_raw_mrc(tmp_path / "f.mrc", make_stack(), voxel=None, exttyp=kind,
                      ext=_fei(5, kind, angles, 2.5e-10, 84.0))
    m = read_mrc(p)
    assert m.ext_type == kind.decode()
    np.testing.assert_allclose(m.ext_angles, angles)
    assert m.ext_pixel_size == pytest.approx(2.5)
    assert m.ext_tilt_axis == pytest.approx(84.0)
    ts = load_tiltseries(data_cfg(source="mrc", path=p))
    np.testing.assert_allclose(ts.angles, angles)
    assert ts.pixel_size == pytest.approx(2.5)
    assert ts.metadata["file_tilt_axis_angle"] == pytest.approx(84.0)
    assert "tilt-axis angle of 84.00" in caplog.text  # warned: not applied automatically


def test_legacy_fei_extended_header(tmp_path):
    angles = np.array([-50.0, -25.0, 0.0, 25.0, 50.0], dtype=np.float32)
    recs = np.zeros((1024, 32), dtype="<f4")
    recs[:5, 0] = angles
    recs[:5, 10] = -3.0
    recs[:5, 11] = 4.2e-10
    p = write_raw_mrc(tmp_path / "l.mrc", make_stack(), ext=np.frombuffer(recs.tobytes(), dtype="V1"),
                      patch={128: struct.pack("<hh", 0, 32)})
    m = read_mrc(p)
    assert m.ext_type == "FEI (legacy)"
    np.testing.assert_allclose(m.ext_angles, angles)
    assert m.ext_pixel_size == pytest.approx(4.2, rel=1e-6)
    assert m.ext_tilt_axis == pytest.approx(-3.0)


def test_serialem_seri_extended_header(tmp_path):
    angles = np.array([0.0, 3.0, -3.0, 6.0, -6.0])  # dose-symmetric order
    nint, flags = 8, 1 | 8  # tilt angle (2 bytes) + magnification (2 bytes), padded to 8
    recs = np.zeros((5, nint), dtype=np.uint8)
    recs[:, :2] = np.round(angles * 100).astype("<i2").view(np.uint8).reshape(5, 2)
    p = write_raw_mrc(tmp_path / "se.st", make_stack(), voxel=2.0, exttyp=b"SERI",
                      ext=np.frombuffer(recs.tobytes(), dtype="V1"), patch={128: struct.pack("<hh", nint, flags)})
    m = read_mrc(p)
    assert m.ext_type == "SERI"
    np.testing.assert_allclose(m.ext_angles, angles)
    ts = load_tiltseries(data_cfg(source="mrc", path=p))
    np.testing.assert_allclose(ts.angles, np.sort(angles))
    assert ts.metadata["view_numbers"] == [5, 3, 1, 2, 4]


def test_an_angle_file_that_contradicts_the_header_is_warned_and_used(tmp_path, caplog):
    angles = np.array([0.0, 3.0, -3.0, 6.0, -6.0])  # dose-symmetric order, in a SERI header
    nint, flags = 8, 1 | 8
    recs = np.zeros((5, nint), dtype=np.uint8)
    recs[:, :2] = np.round(angles * 100).astype("<i2").view(np.uint8).reshape(5, 2)
    p = write_raw_mrc(tmp_path / "se.st", make_stack(), voxel=2.0, exttyp=b"SERI",
                      ext=np.frombuffer(recs.tobytes(), dtype="V1"), patch={128: struct.pack("<hh", nint, flags)})
    said = "give the sections different tilt angles"
    for given, how in ((angles + 0.5, None),  # refined angles: no word
                       (np.sort(angles), "the same angles in another order"),
                       (angles + 20, "they differ by up to 20 degrees (section 1: 20 against 0)")):
        t = write_tlt(tmp_path / "given.rawtlt", given)
        caplog.clear()
        ts = load_tiltseries(data_cfg(source="mrc", path=p, angles=t))
        np.testing.assert_allclose(ts.angles, np.sort(given))  # data.angles is used either way
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and said in r.getMessage()]
        if how is None:
            assert not warned, warned
        else:
            assert warned == [f"{t} and the SERI extended header of {p} {said}: {how}. {t} is used; if the stack's "
                              "own angles are the right ones, leave data.angles out."], warned


def test_permissive_header_quirk_then_shape_check(tmp_path, caplog):
    raw = make_stack()
    p = write_raw_mrc(tmp_path / "q.mrc", raw, voxel=2.0, patch={208: b"XXXX"})  # map ID destroyed
    with pytest.raises(ValueError):
        mrcfile.open(p, permissive=False).close()
    m = read_mrc(p)
    np.testing.assert_array_equal(m.data, raw)
    assert any("permissive" in n for n in m.notes)


def test_a_header_nz_short_of_the_sections_is_said_once_as_sections(tmp_path):
    raw = make_stack()  # 5 sections; the header is made to say 4 (an nz not updated)
    p = write_raw_mrc(tmp_path / "nz.mrc", raw, voxel=2.0, patch={8: struct.pack("<i", 4)})
    m = read_mrc(p)
    np.testing.assert_array_equal(m.data, raw[:4])
    about = [n for n in m.notes if "section" in n or "larger than expected" in n]
    assert about == [f"the header says 4 sections (nz), but 1 more whole section(s) follow them in the file "
                     f"({raw[0].nbytes} bytes); only the first 4 are read. If the stack has 5 views, fix nz in the "
                     "header (IMOD: alterheader -size) and give an angle for each"], m.notes
    with open(p, "ab") as f:  # and bytes that are no whole section: mrcfile's own words, once
        f.write(b"\0" * 7)
    notes = read_mrc(p).notes
    assert sum("larger than expected" in n for n in notes) == 1, notes


def test_pixel_sizes_far_out_are_warned_and_ones_no_header_holds_refused(tmp_path, caplog):
    ts = _load(tmp_path, make_stack(), voxel=1e30)  # a header's nonsense: used, with a warning
    assert ts.pixel_size == pytest.approx(1e30, rel=1e-6)
    assert "pixel size 1e+30 A (from the file header) is outside 0.01..1e+06 A" in caplog.text
    caplog.clear()
    assert _load(tmp_path, make_stack(), voxel=3.5).pixel_size == pytest.approx(3.5)
    assert "is outside" not in caplog.text
    for bad in (1e300, 1e-50):  # 0 and inf as float32: an MRC cell cannot say them
        with pytest.raises(DataFileError, match=rf"pixel size {re.escape(f'{bad:.6g}')} A \(from data\.pixel_size\) does not fit a "
                                                r"volume header"):
            _load(tmp_path, make_stack(), pixel_size=bad)


def test_empty_truncated_corrupt(tmp_path):
    empty = tmp_path / "e.mrc"
    empty.write_bytes(b"")
    with pytest.raises(DataFileError, match=r"e\.mrc: the file is empty"):
        read_mrc(empty)
    p = write_raw_mrc(tmp_path / "t.mrc", make_stack(), voxel=1.0)
    blob = open(p, "rb").read()
    open(p, "wb").write(blob[:-100])
    with pytest.raises(DataFileError, match=r"t\.mrc: truncated MRC file.*= 4864 bytes, but the file has 4764 bytes"):
        read_mrc(p)
    short = tmp_path / "s.mrc"
    short.write_bytes(blob[:500])
    with pytest.raises(DataFileError, match="500 bytes, less than the 1024-byte header"):
        read_mrc(short)
    junk = tmp_path / "j.mrc"
    junk.write_bytes(np.random.default_rng(0).integers(0, 255, 3000, dtype=np.uint8).tobytes())
    with pytest.raises(DataFileError, match=r"j\.mrc"):
        read_mrc(junk)


@pytest.mark.parametrize("content, looks", [(b"1.0 2.0 3.0\nangles of a tilt series\n" * 60, "a text file"),
                                            (b"\x89PNG\r\n\x1a\n" + bytes(2000), "a PNG image")])
def test_a_file_of_another_type_is_named_not_an_mrc_file(tmp_path, content, looks):
    """A text file (or a picture) renamed .mrc is "not an MRC file", not a mode to convert."""
    p = tmp_path / "renamed.mrc"
    p.write_bytes(content)
    with pytest.raises(DataFileError, match=rf"renamed\.mrc: not an MRC file \(it looks like {looks};") as info:
        read_mrc(p)
    assert "newstack" not in str(info.value)


def test_complex_mode_rejected(tmp_path):
    p = write_raw_mrc(tmp_path / "c.mrc", make_stack().astype(np.complex64))
    with pytest.raises(DataFileError, match="mode 4.*modes \\[0, 1, 2, 6, 12\\]"):
        read_mrc(p)


def test_wrong_dimensionality(tmp_path):
    p = write_raw_mrc(tmp_path / "one.mrc", make_stack()[0])
    t = write_tlt(tmp_path / "one.rawtlt", [0.0])
    with pytest.raises(DataFileError, match=r"one\.mrc.*2-D.*single image is not a tilt series"):
        load_tiltseries(data_cfg(source="mrc", path=p, angles=t))
    p4 = write_raw_mrc(tmp_path / "four.mrc", np.zeros((2, 3, 4, 5), np.float32))
    with pytest.raises(DataFileError, match=r"four\.mrc.*4-D"):
        load_tiltseries(data_cfg(source="mrc", path=p4, angles=t))


def test_anisotropic_pixel_size(tmp_path):
    p = write_raw_mrc(tmp_path / "a.mrc", make_stack(), voxel=(2.0, 3.0, 2.0))
    t = write_tlt(tmp_path / "a.rawtlt", ANGLES5)
    with pytest.raises(DataFileError, match=r"a\.mrc: anisotropic pixel size x = 2 A, y = 3 A"):
        load_tiltseries(data_cfg(source="mrc", path=p, angles=t))
    ts = load_tiltseries(data_cfg(source="mrc", path=p, angles=t, pixel_size=2.0))  # explicit override
    assert ts.pixel_size == 2.0


def test_missing_pixel_size_warns_and_says_what_was_assumed(tmp_path, caplog):
    p = write_raw_mrc(tmp_path / "m.mrc", make_stack())  # cell size 0
    t = write_tlt(tmp_path / "m.rawtlt", ANGLES5)
    ts = load_tiltseries(data_cfg(source="mrc", path=p, angles=t))
    assert ts.pixel_size == 1.0 and ts.metadata["pixel_size_assumed"]
    assert "no pixel size" in caplog.text and "assuming 1.0 A" in caplog.text


@pytest.mark.parametrize("grid, cell, shown", [((0, 12, 5), 32.0, "inf, 2"), ((0, 0, 0), 0.0, "nan, inf")],
                         ids=["mx_0", "all_0"])
def test_a_broken_grid_in_the_header_is_no_pixel_size(tmp_path, caplog, grid, cell, shown):
    """mx = 0 (or mx = my = mz = 0 and no cell) makes mrcfile's voxel size inf or NaN: that is an
    unset pixel size (warned, 1.0 assumed, data.pixel_size named), not an anisotropic one."""
    import struct

    p = write_raw_mrc(tmp_path / "g.mrc", make_stack(), voxel=2.0,
                      patch={28: struct.pack("<3i", *grid), 40: struct.pack("<3f", cell, 24.0, 10.0)})
    t = write_tlt(tmp_path / "g.rawtlt", ANGLES5)
    ts = load_tiltseries(data_cfg(source="mrc", path=p, angles=t))
    assert ts.pixel_size == 1.0 and ts.metadata["pixel_size_assumed"]
    assert f"pixel size ({shown}) A is not finite and positive" in caplog.text and "data.pixel_size" in caplog.text
    assert load_tiltseries(data_cfg(source="mrc", path=p, angles=t, pixel_size=2.0)).pixel_size == 2.0


def test_no_angles_anywhere_suggests_sibling(tmp_path):
    p = write_raw_mrc(tmp_path / "n.st", make_stack(), voxel=1.0)
    with pytest.raises(DataFileError, match="no tilt angles.*data.angles="):
        load_tiltseries(data_cfg(source="mrc", path=p))
    write_tlt(tmp_path / "n.rawtlt", ANGLES5)
    with pytest.raises(DataFileError, match=r"Found .*n\.rawtlt next to it: set data\.angles="):
        load_tiltseries(data_cfg(source="mrc", path=p))


def test_reading_a_float32_stack_holds_it_in_memory_once(tmp_path):
    """The data block is memory-mapped and copied out once (issue 26): a 16 MB stack costs
    about 16 MB of numpy allocations, not twice that (a full read, then its copy)."""
    import tracemalloc

    from fasttomo.data.io.mrc import read_mrc, write_mrc

    stack = np.random.default_rng(0).random((16, 512, 512), dtype=np.float32)
    path = write_mrc(tmp_path / "s.mrc", stack, 2.0, image_stack=True)
    tracemalloc.start()
    try:
        data = read_mrc(path).data
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(data, stack)
    assert peak < 1.25 * stack.nbytes, peak / stack.nbytes
