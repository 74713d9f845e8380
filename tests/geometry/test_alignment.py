"""Pose errors against the truth: zero for identical poses, blind to the translation gauge, the
geodesic angle for rotations; and loading pose dicts into Poses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fasttomo.data.phantom import Ellipsoid, Phantom, pose_rotations, project, random_pose_errors
from fasttomo.geometry.alignment import pose_errors, set_poses
from fasttomo.geometry.poses import Poses

ODD = np.linspace(-60.0, 60.0, 61)      # reference view at exactly 0 degrees
EVEN = np.linspace(-60.0, 60.0, 40)     # reference view at -1.54 degrees


def _shifted(poses: dict, du: np.ndarray, dv: np.ndarray | float = 0.0) -> dict:
    out = dict(poses)
    out["shift_u_px"] = list(np.asarray(poses["shift_u_px"]) + du)
    out["shift_v_px"] = list(np.asarray(poses["shift_v_px"]) + dv)
    return out


def _gauge_shift(poses: dict, t_xyz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shift change -P R_n t that compensates a volume translated by t (see the module docstring)."""
    r = pose_rotations(np.deg2rad(poses["tilt_deg"]), np.deg2rad(poses["z1_deg"]), np.deg2rad(poses["z3_deg"]))
    d = -(r @ t_xyz)
    return d[:, 0], d[:, 1]


def test_identical_poses_give_zero():
    true = random_pose_errors(ODD, 3.0, 1.0, seed=1)
    err = pose_errors(true, true)
    json.dumps(err)
    for key in ("shift_rms_px", "shift_rms_px_gauge_free", "rotation_rms_deg", "rotation_z3_rms_deg",
                "shift_max_px", "rotation_max_deg", "gauge_tau_px"):
        assert err[key] == 0.0, key
    assert err["n_views"] == 61 and err["n_compared"] == 60 and err["reference_index"] == 30
    # the learned side in its real format: Poses.describe() of a module holding the true poses (fp32)
    poses = Poses(ODD, 30, learn_rotations=True, learn_shifts=True)
    set_poses(poses, true)
    err = pose_errors(poses.describe(), true)
    assert err["shift_rms_px"] < 1e-5 and err["rotation_rms_deg"] < 1e-4


def test_a_tilt_axis_error_is_scored_on_the_reference_view_too():
    """A tilt-axis error turns every view, the reference's included: learned poses that miss it on
    the reference view (pinned) show that view's error; the same poses with it learned score 0."""
    true = random_pose_errors(ODD, 1.0, 0.5, seed=4, axis=2.0)
    assert true["z3_deg"][30] == 2.0
    err = pose_errors(true, true)
    assert err["rotation_rms_deg"] == 0.0 and err["n_rotations_compared"] == 61
    pinned = dict(true, z3_deg=[0.0 if i == 30 else z for i, z in enumerate(true["z3_deg"])])
    err = pose_errors(pinned, true)
    assert err["rotation_max_deg"] == pytest.approx(2.0, abs=1e-9) and err["n_rotations_compared"] == 61
    assert err["per_view"]["rotation_error_deg"][30] == pytest.approx(2.0, abs=1e-9)
    assert err["rotation_rms_deg"] == pytest.approx(2.0 / np.sqrt(61), abs=1e-9)
    # without any reference rotation the reference view stays out of the figures (as before)
    assert pose_errors(random_pose_errors(ODD, 1.0, 0.5, seed=4), random_pose_errors(ODD, 1.0, 0.5, seed=4)
                       )["n_rotations_compared"] == 60
    poses = Poses(ODD, 30, learn_rotations=True, learn_z1=False, learn_shifts=True, learn_tilt_axis=True)
    set_poses(poses, true)
    assert pose_errors(poses.describe(), true)["rotation_rms_deg"] < 1e-4
    assert poses.describe()["tilt_axis_deg"] == pytest.approx(2.0, abs=1e-5)
    with pytest.raises(ValueError, match="reference view 30 has a non-zero shift_u_px"):
        set_poses(poses, dict(true, shift_u_px=[1.0] * 61))


def test_pure_tz_gauge_is_removed():
    true = random_pose_errors(ODD, 3.0, 0.0, seed=2)                 # no in-plane rotations: su += -t_z sin(theta)
    tz = 4.0
    theta = np.deg2rad(ODD)
    learned = _shifted(true, -tz * np.sin(theta))
    err = pose_errors(learned, true)
    free = np.arange(61) != 30
    assert err["shift_rms_px"] == pytest.approx(tz * np.sqrt(np.mean(np.sin(theta[free]) ** 2)), rel=1e-12)
    assert err["shift_rms_px_gauge_free"] < 1e-12
    np.testing.assert_allclose(err["gauge_translation_xyz_px"], [0.0, 0.0, tz], atol=1e-12)
    # a real error on top survives the gauge removal (it is not along sin(theta))
    bump = np.zeros(61)
    bump[[3, 40]] = [1.0, -1.0]
    err = pose_errors(_shifted(learned, 0.0, bump), true)
    assert err["shift_rms_px_gauge_free"] == pytest.approx(np.sqrt(2 / 60), rel=1e-9)


def test_gauge_with_rotations_and_a_tilted_reference():
    """With in-plane rotations and theta_ref != 0 the gauge is a translation along the reference
    beam; it is a true symmetry of the forward model (same images), and pose_errors removes it."""
    true = random_pose_errors(EVEN, 3.0, 1.0, seed=3)
    ref = true["reference_index"]
    beam = pose_rotations(np.deg2rad(EVEN[ref]), 0.0, 0.0).T @ np.array([0.0, 0.0, 1.0])
    t = 2.5 * beam
    du, dv = _gauge_shift(true, t)
    assert abs(du[ref]) < 1e-12 and abs(dv[ref]) < 1e-12                      # the reference view keeps its pose
    learned = _shifted(true, du, dv)
    err = pose_errors(learned, true)
    assert err["shift_rms_px"] > 1.0 and err["shift_rms_px_gauge_free"] < 1e-9
    np.testing.assert_allclose(err["gauge_translation_xyz_px"], t, atol=1e-9)
    # the symmetry: the specimen moved by t, imaged with the learned poses, gives the same images
    sphere = lambda c: Phantom((24, 32, 40), [Ellipsoid(c, (3.0, 2.0, 2.5), (10.0, 20.0, 30.0), 1.0)])  # noqa: E731
    c = np.array([3.0, -2.0, 1.0])
    a = project(sphere(c), EVEN, poses=true)
    b = project(sphere(c + t), EVEN, poses=learned)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * float(a.max()))
    assert np.abs(project(sphere(c + t), EVEN, poses=true) - a).max() > 0.1 * a.max()   # t alone is visible


def test_rotation_offset_gives_its_angle():
    true = random_pose_errors(ODD, 3.0, 1.0, seed=4)
    free = np.arange(61) != 30
    off = np.where(free, 0.7, 0.0)
    err = pose_errors({**true, "z3_deg": list(np.asarray(true["z3_deg"]) + off)}, true)
    assert err["rotation_rms_deg"] == pytest.approx(0.7, rel=1e-9)
    assert err["rotation_max_deg"] == pytest.approx(0.7, rel=1e-9)
    assert err["rotation_z3_rms_deg"] == pytest.approx(0.7, rel=1e-9)
    assert err["shift_rms_px"] == 0.0
    err = pose_errors({**true, "z1_deg": list(off)}, true)                    # about the specimen z: also 0.7
    assert err["rotation_rms_deg"] == pytest.approx(0.7, rel=1e-9) and err["rotation_z3_rms_deg"] == 0.0
    # the z1/z3 split: +a about the specimen z, -a about the beam is nearly no rotation at low tilt,
    # (2 a sin(theta/2)); comparing z3 alone would call it an error of a everywhere
    split = pose_errors({**true, "z1_deg": list(off), "z3_deg": list(np.asarray(true["z3_deg"]) - off)}, true)
    expected = np.where(free, 2 * 0.7 * np.abs(np.sin(np.deg2rad(ODD) / 2)), 0.0)
    np.testing.assert_allclose(split["per_view"]["rotation_error_deg"], expected, atol=1e-3)
    assert split["rotation_z3_rms_deg"] == pytest.approx(0.7, rel=1e-9)
    assert split["per_view"]["rotation_error_deg"][31] < 0.03                 # theta = 2 degrees


def test_mismatched_inputs_are_named():
    true = random_pose_errors(ODD, 3.0, 1.0, seed=5)
    with pytest.raises(ValueError, match="lack"):
        pose_errors({"z3_deg": true["z3_deg"]}, true)
    with pytest.raises(ValueError, match="views"):
        pose_errors(random_pose_errors(EVEN, 1.0, 1.0), true)
    with pytest.raises(ValueError, match="tilt angles differ"):
        pose_errors({**true, "tilt_deg": list(ODD[::-1] + 0.5)}, true)
    with pytest.raises(ValueError, match="reference"):
        pose_errors({**true, "reference_index": 29}, true)


def test_set_poses_checks_the_reference_and_angles():
    true = random_pose_errors(ODD, 3.0, 1.0, seed=6)
    poses = Poses(ODD, 30)
    set_poses(poses, true)
    d = poses.describe()
    np.testing.assert_allclose(d["shift_u_px"], true["shift_u_px"], atol=1e-6)
    np.testing.assert_allclose(d["z3_deg"], true["z3_deg"], atol=1e-5)
    bad = dict(true, z1_deg=[1.0] * 61)
    with pytest.raises(ValueError, match="reference view 30 has a non-zero z1_deg"):
        set_poses(poses, bad)
    # a z3 on the reference view is a rotation of every view (a tilt-axis error): it loads
    turned = dict(true, z3_deg=[1.0] * 61)
    set_poses(poses, turned)
    np.testing.assert_allclose(poses.describe()["z3_deg"], [1.0] * 61, atol=1e-5)
    with pytest.raises(ValueError, match="tilt_deg"):
        set_poses(poses, dict(true, tilt_deg=list(ODD + 1.0)))
