"""IMOD's .xf and AreTomo's .aln applied to a raw stack put an off-centre bead where IMOD puts it:
the bead at (x, y, z) (centred voxels, IMOD's reoriented frame: u = x cos(theta) + z sin(theta),
v = y in the aligned images) is drawn into raw images moved by each view's transform exactly as
the formats define it (align_helpers), and the volume fasttomo reconstructs from the raw stack
and the file holds the bead at (x, y, z), not mirrored; without the file it does not."""

from __future__ import annotations

import mrcfile
import numpy as np
import pytest
from align_helpers import blob_images, rot, write_aln, write_xf
from io_helpers import write_raw_mrc, write_tlt

from fasttomo.cli.reconstruct import compose_config, run

H, W, THICK = 36, 40, 20
ANGLES = np.arange(-60.0, 60.1, 10.0)
BEAD = (6.0, -5.0, 4.0)
SIRT = ["model=sirt", "model.iterations=40", "runtime=cpu", "runtime.threads=1", "logging=quiet",
        "evaluation.view_residuals=false", "output.formats=[mrc]", f"data.thickness={THICK}"]


def _alignment():
    """Per view: the raw -> aligned transform (A, d) of IMOD's .xf (a rotation of about 20 degrees
    and a shift; the reference view's too)."""
    n = ANGLES.size
    mats = [rot(20.0 + 0.7 * i) for i in range(n)]
    shifts = [(2.0 - 0.4 * i, -1.5 + 0.3 * i) for i in range(n)]
    return mats, shifts


def _raw_bead_stack():
    """The bead's raw images: its aligned position q (IMOD's projection), moved to A^-1 (q - d)."""
    x, y, z = BEAD
    pts = []
    for theta, a, d in zip(ANGLES, *_alignment()):
        t = np.deg2rad(theta)
        q = np.array([x * np.cos(t) + z * np.sin(t), y])
        r = np.linalg.solve(a, q - np.asarray(d))          # IMOD coordinates from the centre
        pts.append((r[1] + H / 2 - 0.5, r[0] + W / 2 - 0.5))  # (row, col) of the pixel grid
    return blob_images(pts, H, W)


def _bead_position(path):
    with mrcfile.open(path, permissive=True) as m:
        v = np.asarray(m.data, dtype=np.float64)
    m = np.where(v > 0.5 * v.max(), v, 0.0)
    k, i, j = (np.indices(v.shape) * m).reshape(3, -1).sum(axis=1) / m.sum()
    z, y, x = (np.array([k, i, j]) - (np.array(v.shape) - 1) / 2)
    return np.array([x, y, z])


def _run(tmp_path, name, *extra):
    out = tmp_path / name
    run(compose_config([*SIRT, "data=mrc", f"data.path={tmp_path / 'raw.mrc'}", *extra, f"output.dir={out}"]))
    return _bead_position(out / "volume.mrc")


@pytest.fixture
def raw_series(tmp_path):
    write_raw_mrc(tmp_path / "raw.mrc", _raw_bead_stack(), voxel=4.0)
    write_tlt(tmp_path / "raw.tlt", ANGLES)
    return tmp_path


def test_imod_xf_puts_the_bead_where_imod_does(raw_series):
    mats, shifts = _alignment()
    xf = write_xf(raw_series / "raw.xf", mats, shifts)
    got = _run(raw_series, "xf", f"data.angles={raw_series / 'raw.tlt'}", f"data.xf={xf}")
    assert got == pytest.approx(BEAD, abs=0.5)
    mirrored = np.array(BEAD) * np.array([1, 1, -1])
    assert np.abs(got - mirrored).max() > 3  # a mirrored volume would hold it at z = -4
    plain = _run(raw_series, "none", f"data.angles={raw_series / 'raw.tlt'}")
    assert np.abs(plain - np.array(BEAD)).max() > 1.5  # the file is what puts it there


def test_aretomo_aln_puts_the_bead_where_imod_does(raw_series):
    mats, shifts = _alignment()
    # AreTomo's row for the same transform: A = R(ROT), (DX, DY) = -A (TX, TY)
    rot_deg = [np.rad2deg(np.arctan2(a[1, 0], a[0, 0])) for a in mats]
    txy = [-np.linalg.solve(a, np.asarray(d)) for a, d in zip(mats, shifts)]
    aln = write_aln(raw_series / "raw.aln", rot_deg, txy, ANGLES, (W, H, ANGLES.size))
    got = _run(raw_series, "aln", f"data.aln={aln}")  # the angles: the .aln's TILT column
    assert got == pytest.approx(BEAD, abs=0.5)
