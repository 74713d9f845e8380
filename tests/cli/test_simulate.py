"""fasttomo-simulate (its function, without Hydra's start-up): the true poses of misaligned views
are written beside the tilt series as <out>_poses.json, in both formats, never overwritten."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fasttomo.config import DataConfig
from fasttomo.data.io import OutputExistsError
from fasttomo.data.io.poses import FORMAT, read_poses_json
from fasttomo.data.phantom import make_tiltseries
from fasttomo.geometry.alignment import pose_errors
from fasttomo.cli.simulate import simulate

MISALIGNED = dict(phantom="ellipsoids", width=24, height=20, n_tilts=9, pose_error_shift=2.0, pose_error_rotation=1.0)


@pytest.mark.parametrize("fmt", ["mrc", "h5"])
def test_simulate_writes_true_poses_and_never_overwrites(tmp_path, fmt):
    cfg = DataConfig(**MISALIGNED)
    base = tmp_path / "mis"
    paths = simulate(cfg, str(base), fmt)
    pose_file = tmp_path / "mis_poses.json"
    assert pose_file in paths and (tmp_path / f"mis.{fmt}").is_file()
    doc = json.loads(pose_file.read_text())
    assert doc["format"] == FORMAT and doc["version"] == 1 and doc["n_views"] == 9 and "Rz(z3)" in doc["convention"]
    assert doc["source"]["pose_error_shift_px"] == 2.0 and doc["source"]["phantom"] == "ellipsoids"
    read = read_poses_json(pose_file)
    truth = make_tiltseries(cfg).metadata["true_poses"]
    assert {k: read[k] for k in truth} == truth
    assert pose_errors(read, truth)["shift_rms_px"] == 0.0                    # the file feeds pose_errors directly
    before = pose_file.read_bytes()
    with pytest.raises(OutputExistsError, match="overwrite"):
        simulate(cfg, str(base), fmt)
    (tmp_path / f"mis.{fmt}").unlink()                                        # only the poses file is in the way:
    with pytest.raises(OutputExistsError, match="_poses.json"):
        simulate(cfg, str(base), fmt)
    assert not (tmp_path / f"mis.{fmt}").exists()                             # refused before writing anything
    assert pose_file.read_bytes() == before
    simulate(DataConfig(**{**MISALIGNED, "phantom_seed": 1}), str(base), fmt, overwrite=True)
    assert read_poses_json(pose_file)["shift_u_px"] != truth["shift_u_px"]


def test_aligned_series_write_no_poses_file(tmp_path):
    paths = simulate(DataConfig(width=24, height=20, n_tilts=9, noise=0.05, noise_relative_to="max"),
                     str(tmp_path / "ph"), "mrc")
    assert not (tmp_path / "ph_poses.json").exists()
    assert sorted(p.name for p in paths) == ["ph.mrc", "ph.rawtlt", "ph_truth.mrc"]
    np.testing.assert_allclose(np.loadtxt(tmp_path / "ph.rawtlt"), np.linspace(-60, 60, 9))
