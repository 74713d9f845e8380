"""Alignment files that do not fit the stack are refused with one line naming the file, the
problem and the fix; those that fit load as the views' initial poses, following exclusion and
sorting; fasttomo's poses written back list every section of the stack file."""

from __future__ import annotations

import numpy as np
import pytest
from align_helpers import rot, write_aln, write_xf
from io_helpers import data_cfg, make_stack, write_raw_mrc, write_tlt

from fasttomo.config import ConfigError
from fasttomo.data.io import DataFileError
from fasttomo.data.io.alignment import view_poses, write_alignment_files, xf_to_poses
from fasttomo.data.io.aretomo import read_aln
from fasttomo.data.io.imod import read_tilt_file, read_xf
from fasttomo.data.load import load_tiltseries

ANGLES = np.array([-40.0, -20.0, 0.0, 20.0, 40.0])
N, H, W = 5, 12, 16


@pytest.fixture
def stack(tmp_path):
    write_raw_mrc(tmp_path / "s.mrc", make_stack(N, H, W), voxel=2.0)
    write_tlt(tmp_path / "s.tlt", ANGLES)
    return tmp_path


def _load(d, **kw):
    kw.setdefault("angles", str(d / "s.tlt"))
    return load_tiltseries(data_cfg(source="mrc", path=str(d / "s.mrc"), **kw))


def _xf(d, mats=None, shifts=None, n=N, name="s.xf"):
    mats = [rot(3.0 * i) for i in range(n)] if mats is None else mats
    shifts = [(0.5 * i, -0.25 * i) for i in range(n)] if shifts is None else shifts
    return write_xf(d / name, mats, shifts)


def test_xf_loads_as_initial_poses(stack):
    ts = _load(stack, xf=_xf(stack))
    p = view_poses(ts.metadata)
    # raw r = R(z3) q + s with A = R(3 i): z3 = -3 i, s = -A^-1 d
    np.testing.assert_allclose(p["z3_deg"], [-3.0 * i for i in range(N)], atol=1e-5)
    want = [-np.linalg.solve(rot(3.0 * i), (0.5 * i, -0.25 * i)) for i in range(N)]
    np.testing.assert_allclose(np.stack((p["shift_u_px"], p["shift_v_px"]), -1), want, atol=2e-3)


@pytest.mark.parametrize("what, fix", [
    ("count", "4 transforms, but the stack has 5 sections"),
    ("magnification", "magnification or stretch of 1.0200..1.0200"),
    ("mirror", "a mirror"),
    ("units", "belongs to a stack of another size"),
    ("text", "is not 6 numbers"),
])
def test_bad_xf_is_refused_in_one_line(stack, what, fix):
    if what == "count":
        path = _xf(stack, n=4)
    elif what == "magnification":
        path = _xf(stack, mats=[1.02 * rot(0.0)] * N)
    elif what == "mirror":
        path = _xf(stack, mats=[np.diag([1.0, -1.0])] * N)
    elif what == "units":
        path = _xf(stack, shifts=[(0.0, 0.0)] * 4 + [(400.0, 0.0)])
    else:
        (stack / "s.xf").write_text("1 0 0 1 0\n" * N)
        path = str(stack / "s.xf")
    with pytest.raises(DataFileError) as err:
        _load(stack, xf=path)
    msg = str(err.value)
    assert fix in msg and path in msg and "\n" not in msg


def test_a_tiny_magnification_is_taken_as_a_rotation(stack):
    ts = _load(stack, xf=_xf(stack, mats=[1.004 * rot(10.0)] * N))  # 0.4 %: within the 0.5 % tolerance
    np.testing.assert_allclose(view_poses(ts.metadata)["z3_deg"], -10.0, atol=1e-6)


def test_aln_size_and_dark_frames(stack):
    rows = dict(rot_deg=[5.0] * 4, tx_ty=[(1.0, 2.0)] * 4, tilts=np.delete(ANGLES, 1))
    bad = write_aln(stack / "big.aln", raw_size=(2 * W, 2 * H, N), darks=[(1, -20.0)], **rows)
    with pytest.raises(DataFileError, match=r"raw stack of 5 sections of 32 x 24 pixels \(# RawSize\)"):
        _load(stack, aln=bad, angles=None)
    aln = write_aln(stack / "s.aln", raw_size=(W, H, N), darks=[(1, -20.0)], **rows)
    assert read_aln(aln).dark_sections == [1]
    with pytest.raises(DataFileError, match=r"no alignment for view\(s\) \[2\].*data.exclude_views=\[2\]"):
        _load(stack, aln=aln, angles=None)
    ts = _load(stack, aln=aln, angles=None, exclude_views=[2])
    assert ts.n_tilts == 4 and ts.angles.tolist() == [-40.0, 0.0, 20.0, 40.0]
    np.testing.assert_allclose(view_poses(ts.metadata)["z3_deg"], -5.0, atol=1e-5)
    np.testing.assert_allclose(view_poses(ts.metadata)["shift_u_px"], 1.0, atol=1e-3)


def test_xtilt_one_value_accepted_varying_refused(stack):
    xf = _xf(stack)
    write_tlt(stack / "one.xtilt", [0.7] * N)
    assert _load(stack, xf=xf, xtilt=str(stack / "one.xtilt")).metadata["file_alignment"]["xtilt_deg"] == 0.7
    write_tlt(stack / "var.xtilt", [0.0, 0.1, 0.2, 0.3, 0.4])
    with pytest.raises(DataFileError, match="X-axis tilt differs between views"):
        _load(stack, xf=xf, xtilt=str(stack / "var.xtilt"))


@pytest.mark.parametrize("kw, key", [
    (dict(xf="a.xf", aln="a.aln"), "data.xf/data.aln"),
    (dict(xf="a.xf", crop=[0, 8, 0, 8]), "data.crop"),
    (dict(aln="a.aln", tilt_axis_angle=85.0), "data.tilt_axis_angle"),
    (dict(xtilt="a.xtilt"), "data.xtilt: is IMOD's X-axis tilt of an .xf alignment: set data.xf too"),
    (dict(aln="a.aln", xtilt="a.xtilt"), "data.xtilt: is IMOD's X-axis tilt of an .xf alignment, which an AreTomo "
                                         ".aln has no place for: leave data.xtilt unset with data.aln"),
])
def test_config_refuses_what_does_not_go_with_a_file_alignment(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        data_cfg(source="mrc", path="s.mrc", **kw)


def test_views_follow_exclusion_and_sorting(tmp_path):
    order = np.array([0.0, 20.0, -20.0, 40.0, -40.0])  # dose-symmetric: sorted by fasttomo
    write_raw_mrc(tmp_path / "s.mrc", make_stack(N, H, W), voxel=2.0)
    write_tlt(tmp_path / "s.tlt", order)
    xf = write_xf(tmp_path / "s.xf", [rot(float(a) / 10) for a in order], [(0.0, 0.0)] * N)
    ts = load_tiltseries(data_cfg(source="mrc", path=str(tmp_path / "s.mrc"), angles=str(tmp_path / "s.tlt"),
                                  xf=xf, exclude_views=[4]))
    assert ts.angles.tolist() == [-40.0, -20.0, 0.0, 20.0]
    np.testing.assert_allclose(view_poses(ts.metadata)["z3_deg"], -ts.angles / 10, atol=1e-5)


def test_written_back_files_list_every_section(stack):
    ts = _load(stack, xf=_xf(stack), exclude_views=[5], binning=3)
    poses = {"tilt_deg": ts.angles.tolist(), "z1_deg": [0.0] * 4, "z3_deg": [1.0, 2.0, 3.0, 4.0],
             "shift_u_px": [0.5, 0.0, -0.5, 1.0], "shift_v_px": [0.0, 0.25, 0.0, -1.0], "reference_index": 2}
    paths = write_alignment_files(stack / "out", poses, ts.metadata, (ts.height, ts.width))
    assert [p.rsplit(".", 1)[1] for p in paths] == ["xf", "tlt", "aln"]
    z3, shifts = xf_to_poses(read_xf(stack / "out.xf"), "out.xf")
    assert z3.shape == (N,) and read_aln(stack / "out.aln").raw_size == (W, H, N)
    np.testing.assert_allclose(z3[:4], poses["z3_deg"], atol=1e-5)
    np.testing.assert_allclose(z3[4], -12.0, atol=1e-5)  # section 5 was excluded: the input file's value
    np.testing.assert_allclose(np.ravel(read_tilt_file(stack / "out.tlt")), ANGLES)
    # back in binned pixels (3: the binned centre is off the raw one), the shifts are the ones given
    from fasttomo.data.io.alignment import _centre_term

    back = (shifts[:4] + _centre_term(z3[:4], W, H, 3)) / 3
    np.testing.assert_allclose(back, np.stack((poses["shift_u_px"], poses["shift_v_px"]), -1), atol=2e-3)
    with pytest.raises(Exception, match="exists"):
        write_alignment_files(stack / "out", poses, ts.metadata, (ts.height, ts.width))  # never overwrites


@pytest.mark.slow
def test_cli_names_a_bad_alignment_file_in_one_line_and_exits_2(stack):
    from cli_helpers import cli

    bad = _xf(stack, mats=[1.03 * rot(0.0)] * N)
    proc = cli(["data=mrc", f"data.path={stack / 's.mrc'}", f"data.angles={stack / 's.tlt'}", f"data.xf={bad}",
                "model=sirt", "runtime=cpu", f"hydra.run.dir={stack / 'run'}"], stack, timeout=300)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if "tolerance 0.5%" in ln]
    assert len(lines) == 1 and bad in lines[0] and "MagOption 0" in lines[0]
