"""Initial poses (a file alignment) in the Poses module: every view starts from them, the
reference view's rotation and shift included; refinement learns a correction on top, with the
reference view's correction held (or gauged) as before; checkpoints without them load."""

import math

import numpy as np
import pytest
import torch

from fasttomo.geometry.poses import Poses

ANGLES = np.array([-40.0, -20.0, 0.0, 20.0, 40.0])
INITIAL = {"z1_deg": [0.0] * 5, "z3_deg": [10.0, 11.0, 12.0, 13.0, 14.0],
           "shift_u_px": [1.0, -2.0, 0.5, 3.0, 0.0], "shift_v_px": [0.0, 1.0, -1.5, 2.0, -0.5]}


def _rz(a):
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def _ry(t):
    c, s = math.cos(t), math.sin(t)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def test_every_view_starts_at_its_initial_pose_the_reference_included():
    poses = Poses(ANGLES, 2, initial=INITIAL)
    r, s = poses(torch.arange(5))
    for i in range(5):
        want = _rz(math.radians(INITIAL["z3_deg"][i])) @ _ry(math.radians(ANGLES[i]))
        np.testing.assert_allclose(r[i].numpy(), want, atol=1e-6)
        assert s[i].tolist() == pytest.approx([INITIAL["shift_u_px"][i], INITIAL["shift_v_px"][i]])
    d = poses.describe()
    assert d["z3_deg"] == pytest.approx(INITIAL["z3_deg"], abs=1e-5)
    assert d["shift_u_px"] == pytest.approx(INITIAL["shift_u_px"]) and d["shift_v_px"][2] == pytest.approx(-1.5)
    assert d["max_abs_inplane_deg"] == pytest.approx(0.0, abs=1e-4) and d["max_abs_shift_px"] == pytest.approx(0.0)


def test_refinement_learns_a_correction_and_reports_the_sum():
    poses = Poses(ANGLES, 2, learn_rotations=True, learn_shifts=True, learn_z1=False, free_reference_shift=True,
                  learn_tilt_axis=True, initial=INITIAL)
    r, s = poses(torch.arange(5))
    (r.sum() + s.sum()).backward()
    assert poses.z3.grad[2] == 0 and poses.z3.grad[0] != 0  # the reference's rotation correction is held
    with torch.no_grad():
        poses.shifts[2] = torch.tensor([0.4, -0.2])   # the gauge: reported in the frame where it is zero
        poses.shifts[0] = torch.tensor([0.1, 0.0])
        poses.z3[0] = math.radians(1.0)
    d = poses.describe()
    assert d["shift_u_px"][2] == pytest.approx(0.5) and d["shift_v_px"][2] == pytest.approx(-1.5)
    assert d["z3_deg"][0] == pytest.approx(11.0, abs=1e-4)
    assert d["max_abs_inplane_deg"] == pytest.approx(1.0, abs=1e-4)  # how far it moved, not where it is
    # the volume translation t of the gauge undoes the reference's correction alone
    t = poses.gauge_translation()
    r_ref = _rz(math.radians(12.0)) @ _ry(0.0)
    np.testing.assert_allclose((r_ref @ t.numpy())[:2], [0.4, -0.2], atol=1e-6)


def test_checkpoint_without_initial_poses_loads_and_keeps_the_module_s():
    poses = Poses(ANGLES, 2, initial=INITIAL)
    old = {k: v for k, v in Poses(ANGLES, 2).state_dict().items() if not k.startswith("base_")}
    poses.load_state_dict(old)
    assert poses.describe()["z3_deg"] == pytest.approx(INITIAL["z3_deg"], abs=1e-5)


def test_initial_poses_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match=r"initial\['z3_deg'\] must be 5 finite numbers"):
        Poses(ANGLES, 2, initial={**INITIAL, "z3_deg": [0.0] * 4})
