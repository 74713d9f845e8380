"""IMOD tilt files (one or many per line, per-line tables) and SerialEM .mdoc."""

import numpy as np
import pytest
from io_helpers import ANGLES5, data_cfg, make_stack, write_raw_mrc, write_tlt

from fasttomo.data.io import DataFileError
from fasttomo.data.io.imod import angles_for_stack, read_mdoc, read_tilt_file, write_tilt_file
from fasttomo.data.load import load_tiltseries

MDOC = """PixelSpacing = 2.68
Voltage = 300
ImageFile = ts.mrc
ImageSize = 16 12
DataMode = 1

[T = SerialEM: Digitized on EMBL Krios   19-Mar-24  10:11:12    ]

[T =     Tilt axis angle = 85.3, binning = 2  spot = 8  camera = 0]

[ZValue = 1]
TiltAngle = 3.00
PixelSpacing = 2.68

[ZValue = 0]
TiltAngle = -0.0012
PixelSpacing = 2.68
{rest}"""


def test_one_or_many_per_line(tmp_path):
    p = tmp_path / "a.tlt"
    p.write_text("-40 -20\n\n0 # comment\n20, 40\n")
    rows = read_tilt_file(p)
    np.testing.assert_array_equal(angles_for_stack(rows, 5, 12, str(p), "s.mrc"), ANGLES5)


def test_per_line_table(tmp_path):
    per_line = ANGLES5[:, None] + np.linspace(-1, 1, 12)[None, :]
    p = write_tilt_file(tmp_path / "pl.tlt", per_line)
    out = angles_for_stack(read_tilt_file(p), 5, 12, p, "s.mrc")
    assert out.shape == (5, 12)
    np.testing.assert_array_equal(out, per_line)  # repr() text round trip is exact


def test_count_mismatch_names_both_files(tmp_path):
    p = write_tlt(tmp_path / "x.rawtlt", [-10, 0, 10])
    with pytest.raises(DataFileError, match=r"x\.rawtlt: 3 angles in 3 lines, but the stack s\.mrc has 5 sections"):
        angles_for_stack(read_tilt_file(p), 5, 12, p, "s.mrc")


def test_bad_line_and_empty_file(tmp_path):
    p = tmp_path / "b.tlt"
    p.write_text("1\n2\nthree\n")
    with pytest.raises(DataFileError, match=r"b\.tlt, line 3: 'three' is not a list of numbers"):
        read_tilt_file(p)
    e = tmp_path / "e.tlt"
    e.write_text("\n")
    with pytest.raises(DataFileError, match="holds no angles"):
        read_tilt_file(e)


def test_mdoc(tmp_path):
    rest = "".join(f"\n[ZValue = {z}]\nTiltAngle = {a}\nPixelSpacing = 2.68\n" for z, a in
                   [(2, -3.0), (3, 6.0), (4, -6.0)])
    p = tmp_path / "ts.mrc.mdoc"
    p.write_text(MDOC.format(rest=rest))
    info = read_mdoc(p)
    np.testing.assert_allclose(info.angles, [-0.0012, 3.0, -3.0, 6.0, -6.0])  # ZValue order
    assert info.pixel_size == pytest.approx(2.68)
    assert info.tilt_axis_angle == pytest.approx(85.3)
    s = write_raw_mrc(tmp_path / "ts.mrc", make_stack().astype(np.int16))  # no pixel size in the header
    ts = load_tiltseries(data_cfg(source="mrc", path=s, angles=str(p)))
    assert ts.pixel_size == pytest.approx(2.68)
    assert ts.metadata["pixel_size_source"] == "the .mdoc PixelSpacing"
    np.testing.assert_allclose(ts.angles, [-6.0, -3.0, -0.0012, 3.0, 6.0])
    assert ts.metadata["view_numbers"] == [5, 3, 1, 2, 4]
    assert ts.metadata["file_tilt_axis_angle"] == pytest.approx(85.3)


def test_mdoc_without_sections(tmp_path):
    p = tmp_path / "bad.mdoc"
    p.write_text("PixelSpacing = 1\n")
    with pytest.raises(DataFileError, match=r"bad\.mdoc: no \[ZValue = n\] sections"):
        read_mdoc(p)


def test_unknown_angle_suffix(tmp_path):
    s = write_raw_mrc(tmp_path / "u.mrc", make_stack(), voxel=1.0)
    a = tmp_path / "u.angles"
    a.write_text("0\n")
    with pytest.raises(DataFileError, match=r"u\.angles: unknown angle-file suffix"):
        load_tiltseries(data_cfg(source="mrc", path=s, angles=str(a)))


def test_a_byte_order_mark_is_not_part_of_the_first_angle(tmp_path):
    """Notepad and Excel save UTF-8 with a BOM; the first angle must still read as a number."""
    t = tmp_path / "bom.rawtlt"
    t.write_bytes(b"\xef\xbb\xbf" + "\n".join(repr(float(a)) for a in ANGLES5).encode() + b"\n")
    p = write_raw_mrc(tmp_path / "b.mrc", make_stack(), voxel=1.0)
    np.testing.assert_array_equal(load_tiltseries(data_cfg(source="mrc", path=p, angles=str(t))).angles, ANGLES5)
