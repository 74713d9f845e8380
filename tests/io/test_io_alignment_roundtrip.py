"""Round trips of alignment files on a synthetic series with known misalignment: the raw views of
the phantom are posed (random in-plane rotations and shifts, a tilt-axis error and a shift of
every view, the reference's included), the poses are written as an IMOD .xf and an AreTomo .aln
following each format's definition (align_helpers), and

 * SIRT of the raw stack with the file gives the volume SIRT gives of the stack aligned first
   (newstack -xf applied to the images), also binned;
 * a fit that refines the poses from the file writes them back as poses.xf / .tlt / .aln, which
   read back to the poses of metrics.json and reconstruct the same volume again (a refined
   phantom run writes them too)."""

from __future__ import annotations

import json

import mrcfile
import numpy as np
import pytest
from align_helpers import newstack_xf, rot, write_aln, write_xf
from cli_helpers import TINY, TINY_RUN
from io_helpers import write_raw_mrc, write_tlt

from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.data.io.alignment import xf_to_poses
from fasttomo.data.io.aretomo import read_aln
from fasttomo.data.io.imod import read_xf
from fasttomo.data.phantom import default_phantom, project, random_pose_errors

H, W = 35, 33
ANGLES = np.linspace(-60.0, 60.0, 15)
SIRT = ["model=sirt", "model.iterations=30", "runtime=cpu", "runtime.threads=1", "logging=quiet",
        "evaluation.view_residuals=false", "output.formats=[mrc]", "data.thickness=16"]


def _true_poses():
    p = random_pose_errors(ANGLES, 2.0, 3.0, seed=1, axis=4.0)
    p["shift_u_px"] = [s + 1.0 for s in p["shift_u_px"]]   # a shift of every view, the reference's too
    p["shift_v_px"] = [s - 0.7 for s in p["shift_v_px"]]
    return p


def _xf_of(poses):
    """IMOD's raw -> aligned transform of fasttomo poses (raw r = R(z3) q + s): A = R(-z3), d = -A s."""
    mats = [rot(-z3) for z3 in poses["z3_deg"]]
    shifts = [-(a @ np.array([su, sv])) for a, su, sv in zip(mats, poses["shift_u_px"], poses["shift_v_px"])]
    return mats, shifts


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    d = tmp_path_factory.mktemp("align")
    poses = _true_poses()
    raw = project(default_phantom(W, H, 16), ANGLES, H, W, poses=poses)
    mats, shifts = _xf_of(poses)
    write_raw_mrc(d / "raw.mrc", raw, voxel=5.0)
    write_raw_mrc(d / "ali.mrc", newstack_xf(raw, mats, shifts), voxel=5.0)
    write_tlt(d / "raw.tlt", ANGLES)
    write_xf(d / "raw.xf", mats, shifts)
    rot_deg = [np.rad2deg(np.arctan2(a[1, 0], a[0, 0])) for a in mats]
    write_aln(d / "raw.aln", rot_deg, [-np.linalg.solve(a, s) for a, s in zip(mats, shifts)], ANGLES, (W, H, 15))
    return d


def _sirt(d, name, stack, *extra):
    out = d / name
    run(compose_config([*SIRT, "data=mrc", f"data.path={d / stack}", *extra, f"output.dir={out}"]))
    with mrcfile.open(out / "volume.mrc", permissive=True) as m:
        return np.asarray(m.data, dtype=np.float64)


def _pearson(a, b):
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1])


@pytest.mark.parametrize("binning", [1, 2])
def test_raw_stack_with_xf_or_aln_matches_the_aligned_stack(series, binning):
    d = series
    tlt, b = f"data.angles={d / 'raw.tlt'}", f"data.binning={binning}"
    ali = _sirt(d, f"ali{binning}", "ali.mrc", tlt, b)
    with_xf = _sirt(d, f"xf{binning}", "raw.mrc", tlt, f"data.xf={d / 'raw.xf'}", b)
    with_aln = _sirt(d, f"aln{binning}", "raw.mrc", f"data.aln={d / 'raw.aln'}", b)
    without = _sirt(d, f"none{binning}", "raw.mrc", tlt, b)
    assert _pearson(with_xf, ali) > 0.97
    assert _pearson(with_aln, with_xf) > 0.999  # the same alignment in the other format
    assert _pearson(without, ali) < _pearson(with_xf, ali) - 0.1  # the misalignment is real


@pytest.mark.slow
def test_learned_poses_written_back_read_and_applied_again(series, tmp_path):
    d = series
    out = tmp_path / "fit"
    metrics = run(compose_config([*TINY_RUN, "optim.steps=60", "pose=refine", "pose.start_step=0", "data=mrc",
                                  f"data.path={d / 'raw.mrc'}", f"data.angles={d / 'raw.tlt'}",
                                  f"data.xf={d / 'raw.xf'}", "data.thickness=16", f"output.dir={out}"]))
    poses = json.loads((out / "metrics.json").read_text())["poses"]
    assert poses == json.loads(json.dumps(metrics["poses"]))
    z3, shifts = xf_to_poses(read_xf(out / "poses.xf"), "poses.xf")
    np.testing.assert_allclose(z3, poses["z3_deg"], atol=1e-4)
    np.testing.assert_allclose(shifts, np.stack((poses["shift_u_px"], poses["shift_v_px"]), -1), atol=2e-3)
    np.testing.assert_allclose(np.loadtxt(out / "poses.tlt"), ANGLES, atol=1e-4)
    # the poses started from the file's and moved little in 60 steps: both give the same volume
    first = _sirt(d, "first", "raw.mrc", f"data.angles={d / 'raw.tlt'}", f"data.xf={d / 'raw.xf'}")
    again = _sirt(d, "again", "raw.mrc", f"data.angles={out / 'poses.tlt'}", f"data.xf={out / 'poses.xf'}")
    again_aln = _sirt(d, "again_aln", "raw.mrc", f"data.aln={out / 'poses.aln'}")
    assert _pearson(again, first) > 0.97
    assert _pearson(again_aln, again) > 0.999


def test_a_refined_phantom_run_writes_its_poses_for_imod_and_aretomo(tmp_path):
    out = tmp_path / "run"
    metrics = run(compose_config([*TINY, "optim.steps=8", "pose=refine", "pose.start_step=0", "output.formats=[mrc]",
                                  f"output.dir={out}"]))
    z3, shifts = xf_to_poses(read_xf(out / "poses.xf"), "poses.xf")
    np.testing.assert_allclose(z3, metrics["poses"]["z3_deg"], atol=1e-4)
    np.testing.assert_allclose(shifts, np.stack((metrics["poses"]["shift_u_px"], metrics["poses"]["shift_v_px"]), -1),
                               atol=2e-3)
    aln = read_aln(out / "poses.aln")
    assert aln.raw_size == (24, 20, 15)
    np.testing.assert_allclose(aln.column("TILT"), np.linspace(-60.0, 60.0, 15), atol=1e-3)


def test_a_refined_phantom_run_with_held_out_views_writes_the_views_it_fitted(tmp_path):
    """No stack file is behind a phantom: the pose files list the run's own (training) views; the
    views set aside for scoring are not indices into them (an IndexError before)."""
    out = tmp_path / "run"
    metrics = run(compose_config([*TINY, "optim.steps=8", "pose=refine", "pose.start_step=0",
                                  "evaluation.holdout_views=[4,9]", f"output.dir={out}"]))
    z3, _ = xf_to_poses(read_xf(out / "poses.xf"), "poses.xf")
    assert len(z3) == 13
    np.testing.assert_allclose(z3, metrics["poses"]["z3_deg"], atol=1e-4)
    np.testing.assert_allclose(np.loadtxt(out / "poses.tlt"), metrics["poses"]["tilt_deg"], atol=1e-4)
