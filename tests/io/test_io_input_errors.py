"""Bad input files as users give them (a missing alignment file, an HDF5 file a notebook holds open,
an LZW TIFF, an angle file from a German-locale spreadsheet or a PDF, a folder for a file, values
out of float32's range): one error naming the setting, the problem and the fix. Real files only."""

import os
import shutil
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
from align_helpers import rot, write_xf
from io_helpers import ANGLES5, data_cfg, make_stack, write_raw_mrc, write_tlt

from fasttomo.data.io import DataFileError, write_tiltseries
from fasttomo.data.load import load_tiltseries
from fasttomo.data.tiltseries import TiltSeries, TiltSeriesError


@pytest.fixture
def stack(tmp_path):
    """A 5-view MRC stack of 12 x 16 pixels and its angle file."""
    return write_raw_mrc(tmp_path / "s.mrc", make_stack(), voxel=2.0), write_tlt(tmp_path / "s.rawtlt", ANGLES5)


def _load(stack, **kw):
    s, t = stack
    kw.setdefault("angles", t)
    return load_tiltseries(data_cfg(source="mrc", path=s, **kw))


# ------------------------------------------------------------------- 1. the key that gave the file
@pytest.mark.parametrize("key", ["xf", "aln", "xtilt"])
def test_a_missing_alignment_file_names_its_own_key(stack, tmp_path, key):
    kw = {key: str(tmp_path / f"nope.{key}")}
    if key == "xtilt":  # an .xtilt goes with an .xf
        kw["xf"] = write_xf(tmp_path / "s.xf", [rot(0.0)] * 5, [(0.0, 0.0)] * 5)
    with pytest.raises(DataFileError, match=rf"nope\.{key}: cannot open the .* \(No such file or directory\); "
                                            rf"check data\.{key}\.$"):
        _load(stack, **kw)


@pytest.mark.parametrize("suffix", [".mrc", ".h5"])
def test_a_missing_truth_names_evaluation_truth(stack, tmp_path, suffix):
    from fasttomo.quality.scoring import attach_truth

    ts = _load(stack)
    with pytest.raises(DataFileError, match=r"nope\.(mrc|h5): cannot open the (MRC|HDF5) file .*; check "
                                            r"evaluation\.truth\.$"):
        attach_truth(ts, str(tmp_path / f"nope{suffix}"), None)


# ------------------------------------------------------------------ 2. an HDF5 file held for writing
def test_an_hdf5_file_open_for_writing_elsewhere_is_named_locked(tmp_path, monkeypatch):
    p = tmp_path / "ts.h5"
    write_tiltseries(p, TiltSeries(stack=make_stack(), angles=ANGLES5, pixel_size=2.0, source="test"), "h5")
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)  # HDF5's default: a writer locks the file
    env = {k: v for k, v in os.environ.items() if k != "HDF5_USE_FILE_LOCKING"}
    holder = subprocess.Popen(  # as a Jupyter kernel holds it: open in mode 'a' until told to close
        [sys.executable, "-c", f"import h5py, sys\nf = h5py.File({str(p)!r}, 'a')\nprint('open', flush=True)\n"
                               "sys.stdin.read()\nf.close()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "open"
        try:
            h5py.File(p, "r").close()
            pytest.skip("this filesystem does not enforce HDF5's file locks")
        except OSError:
            pass
        with pytest.raises(DataFileError, match=r"ts\.h5: the HDF5 file is open \(locked\) by another program.*close "
                                                r"it there.*HDF5_USE_FILE_LOCKING=FALSE"):
            load_tiltseries(data_cfg(source="hdf5", path=str(p)))
    finally:
        holder.communicate("", timeout=30)
    assert len(load_tiltseries(data_cfg(source="hdf5", path=str(p))).angles) == 5  # closed: it reads


# ---------------------------------------------------------------------------- 3. an LZW-compressed TIFF
def test_an_lzw_tiff_without_imagecodecs_says_how_to_read_it(tmp_path):
    from importlib.util import find_spec

    if find_spec("imagecodecs") is not None:
        pytest.skip("imagecodecs is installed: tifffile reads LZW itself")
    Image = pytest.importorskip("PIL.Image")
    p = tmp_path / "lzw.tif"
    pages = [Image.fromarray((view * 100).astype(np.uint16)) for view in make_stack()]
    pages[0].save(p, save_all=True, append_images=pages[1:], compression="tiff_lzw")  # as Fiji/SerialEM may save
    with pytest.raises(DataFileError, match=r"lzw\.tif: its images are LZW-compressed, and reading that compression "
                                            r"needs the imagecodecs package: pip install imagecodecs.*or re-export "
                                            r"the stack uncompressed"):
        load_tiltseries(data_cfg(source="tiff", path=str(p), angles=write_tlt(tmp_path / "a.rawtlt", ANGLES5)))


# ------------------------------------------------------------------------------------- 4. angle files
@pytest.mark.parametrize("lines", [
    [f"{a:.2f}".replace(".", ",") for a in ANGLES5],  # a German-locale export: '-40,00'
    [f"  {a:7.2f}  {3.0 * i:7.2f}" for i, a in enumerate(ANGLES5)],  # AreTomo's TLT file: angle, dose
])
def test_two_numbers_on_every_line_are_named(stack, tmp_path, lines):
    t = tmp_path / "two.tlt"
    t.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFileError, match=r"two\.tlt: every line holds 2 numbers \(line 1 reads as -40\.0, 0\.0\).*"
                                            r"decimal commas \('-60,00'\), or an extra column \(e\.g\. AreTomo's "
                                            r"dose\)\? Write one angle per line with a '\.' decimal point"):
        _load(stack, angles=str(t))


def test_a_unicode_minus_is_named_with_its_code_point(stack, tmp_path):
    t = tmp_path / "pdf.rawtlt"
    t.write_text("\n".join(f"{a:.1f}".replace("-", "\u2212") for a in ANGLES5) + "\n", encoding="utf-8")
    with pytest.raises(DataFileError, match=r"pdf\.rawtlt, line 1: '\u221240\.0' is not a list of numbers; it holds "
                                            r"'\u2212' \(U\+2212 MINUS SIGN\); use the ASCII '-'\.$"):
        _load(stack, angles=str(t))


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_a_utf16_angle_file_is_named_utf16(stack, tmp_path, encoding):
    t = tmp_path / "u16.rawtlt"
    t.write_bytes("\ufeff".encode(encoding) + "\n".join(map(str, ANGLES5)).encode(encoding))  # BOM FF FE / FE FF
    with pytest.raises(DataFileError, match=r"u16\.rawtlt: the tilt-angle file is UTF-16 text .*save it as UTF-8 or "
                                            r"ASCII and give it again as data\.angles"):
        _load(stack, angles=str(t))


def test_a_stack_given_as_the_angle_file_is_named_not_text(stack, tmp_path):
    t = tmp_path / "binary.rawtlt"  # the MRC stack itself, copied where its angle file belongs
    shutil.copyfile(stack[0], t)
    with pytest.raises(DataFileError, match=r"binary\.rawtlt: the tilt-angle file is not text \(it holds NUL bytes: "
                                            r"an MRC file\?\); give the tilt-angle text file as data\.angles\.$"):
        _load(stack, angles=str(t))


def test_a_long_bad_line_is_quoted_cut_short(stack, tmp_path):
    t = tmp_path / "long.rawtlt"
    t.write_text("-40\n" + "x" * 500 + "\n")
    with pytest.raises(DataFileError, match=r"long\.rawtlt, line 2: 'x{80}' \(\.\.\. 500 characters\) is not a list "
                                            r"of numbers") as err:
        _load(stack, angles=str(t))
    assert len(str(err.value).replace(str(t), "")) < 300


# ------------------------------------------------------------------- 5. a folder, an unreadable file
@pytest.mark.parametrize("name", ["tilts", "tilts.mrc"])
def test_a_directory_as_data_path_is_named_a_directory(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    with pytest.raises(DataFileError, match=rf"{name}: is a directory; give the tilt-series file in it as data\.path"):
        load_tiltseries(data_cfg(source="mrc", path=str(d), angles=write_tlt(tmp_path / "a.rawtlt", ANGLES5)))


def test_a_directory_as_a_volume_is_named_a_directory(tmp_path):
    from fasttomo.data.io.volume import read_volume

    (tmp_path / "truth.mrc").mkdir()
    with pytest.raises(DataFileError, match=r"truth\.mrc: is a directory; set evaluation\.truth to the MRC file in it"):
        read_volume(tmp_path / "truth.mrc", key="evaluation.truth")


def test_an_unreadable_stack_says_permission_denied(stack):
    s, t = stack
    os.chmod(s, 0)
    cmd = [sys.executable, "-c", "from fasttomo.data.load import load_tiltseries\nfrom io_helpers import data_cfg\n"
           f"load_tiltseries(data_cfg(source='mrc', path={s!r}, angles={t!r}))"]
    if os.geteuid() == 0:  # root reads a chmod 000 file: run it without the capabilities that allow that
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: a chmod 000 file stays readable")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if proc.stderr.startswith("setpriv:"):  # a container that may not drop capabilities
        pytest.skip(f"setpriv cannot drop root's file capabilities here: {proc.stderr.strip()}")
    assert proc.stderr.rstrip().endswith(
        "s.mrc: the MRC file cannot be read (permission denied); fix its permissions (e.g. chmod a+r) or give a "
        "readable copy as data.path."), proc.stderr


# ------------------------------------------------------------------------ 6. values out of float32's range
@pytest.mark.parametrize("scale, flow", [(1e30, "overflow to inf"), (1e-30, "underflow to 0")])
@pytest.mark.filterwarnings("ignore:overflow encountered")  # mrcfile's header statistics, as it writes the file
def test_values_beyond_float32_statistics_are_named_not_blank(tmp_path, scale, flow):
    s = write_raw_mrc(tmp_path / "x.mrc", make_stack() * np.float32(scale), voxel=2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warnings on the way
        with pytest.raises(TiltSeriesError, match=rf"x\.mrc: the stack's largest \|value\| is .*e[+-]\d+, outside the "
                                                  rf"range float32 statistics can handle .*would {flow}.*Rescale the "
                                                  r"stack, e\.g\. with IMOD newstack -scale 0,1000, or multiply it by "
                                                  r"about"):
            load_tiltseries(data_cfg(source="mrc", path=s, angles=write_tlt(tmp_path / "x.rawtlt", ANGLES5)))


def test_a_tilt_series_given_as_a_volume_is_named_a_tilt_series(tmp_path):
    """fasttomo's HDF5 tilt series (its stack the file's only 3-D dataset) given where a volume
    goes is refused as a tilt series, naming the setting; it was read as the volume."""
    from fasttomo.data.io.volume import read_volume

    p = tmp_path / "ts.h5"
    write_tiltseries(p, TiltSeries(stack=make_stack(), angles=ANGLES5, pixel_size=2.0, source="test"), "h5")
    with pytest.raises(DataFileError, match=r"ts\.h5: holds a tilt series \(/tiltseries/stack, 5 views with their "
                                            r"angles\), not a volume; give a volume .* as volume\.$"):
        read_volume(p, key="volume")
