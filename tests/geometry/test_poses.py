import math

import numpy as np
import pytest
import torch

from fasttomo.data.tiltseries import TiltSeries
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import project_points

ANGLES = np.array([-60.0, -30.0, -5.0, 0.5, 30.0, 60.0])


def _ry(t):
    c, s = math.cos(t), math.sin(t)
    return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])


def _rz(a):
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def _project(poses, tilt, p):
    tilt = torch.tensor([tilt])
    r, s = poses(tilt, torch.zeros_like(tilt))
    u, v = project_points(torch.tensor([p], dtype=torch.float32), r, s)
    return float(u.detach()[0]), float(v.detach()[0])


def test_imod_sign_check_point_above_the_centre_moves_to_plus_u():
    poses = Poses(np.array([-30.0, 0.0, 30.0]), reference_index=1)
    u, v = _project(poses, 2, (0.0, 0.0, 10.0))
    assert u == pytest.approx(5.0, abs=1e-5) and v == pytest.approx(0.0, abs=1e-6)
    u, _ = _project(poses, 0, (0.0, 0.0, 10.0))
    assert u == pytest.approx(-5.0, abs=1e-5)


@pytest.mark.parametrize("tilt", range(len(ANGLES)))
def test_off_axis_point_lands_at_the_documented_formula(tilt):
    poses = Poses(ANGLES, reference_index=3)
    x, y, z = 7.0, -3.0, 11.0
    th = math.radians(ANGLES[tilt])
    u, v = _project(poses, tilt, (x, y, z))
    assert u == pytest.approx(x * math.cos(th) + z * math.sin(th), abs=1e-4)
    assert v == pytest.approx(y, abs=1e-5)


@pytest.mark.parametrize("which", ["z1", "z3", "both"])
def test_in_plane_rotations_and_shifts_match_the_explicit_matrix_product(which):
    poses = Poses(ANGLES, reference_index=3, learn_rotations=True, learn_shifts=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if which in ("z1", "both"):
            poses.z1.copy_(torch.rand(len(ANGLES), generator=g) - 0.5)
        if which in ("z3", "both"):
            poses.z3.copy_(torch.rand(len(ANGLES), generator=g) - 0.5)
        poses.shifts.copy_(torch.randn(len(ANGLES), 2, generator=g) * 3)
    p = np.array([7.0, -3.0, 11.0])
    for tilt in (0, 1, 4, 5):  # not the reference
        z1, z3 = float(poses.z1.detach()[tilt]), float(poses.z3.detach()[tilt])
        su, sv = poses.shifts.detach()[tilt].tolist()
        q = _rz(z3) @ _ry(math.radians(ANGLES[tilt])) @ _rz(z1) @ p
        u, v = _project(poses, tilt, tuple(p))
        assert (u, v) == (pytest.approx(q[0] + su, abs=1e-4), pytest.approx(q[1] + sv, abs=1e-4))
        if which == "z1":  # z1 alone rotates the object before tilting: v changes too
            assert abs(v - (p[1] + sv)) > 1e-2


@pytest.mark.parametrize("per_line", [False, True])
def test_fixed_poses_come_from_a_table_that_follows_every_change(per_line):
    """Nothing learned: the rotations and shifts come from a per-view table (no rotation math per
    step). It equals the learned path's formula, and a state-dict load (what a resume or a
    rollback does) updates it in the same tensors a captured CUDA graph reads."""
    ang = np.linspace(-40, 40, 6 * 4).reshape(6, 4) if per_line else ANGLES
    fixed = Poses(ang, reference_index=3)
    learned = Poses(ang, reference_index=3, learn_rotations=True, learn_shifts=True, learn_z1=True)
    tilt, row = torch.tensor([0, 1, 4, 5, 3]), torch.tensor([0, 3, 2, 1, 0])
    g = torch.Generator().manual_seed(1)
    state = {"z1": torch.rand(6, generator=g) - 0.5, "z3": torch.rand(6, generator=g) - 0.5,
             "shifts": torch.randn(6, 2, generator=g), "axis": torch.tensor(0.2)}
    r0, s0 = fixed(tilt, row)
    table = fixed._table
    assert table is not None and learned._fixed_table() is None
    np.testing.assert_allclose(r0.numpy(), learned(tilt, row)[0].detach().numpy(), atol=1e-6)
    for poses in (fixed, learned):
        poses.load_state_dict({**poses.state_dict(), **state})
    r1, s1 = fixed(tilt, row)
    r2, s2 = learned(tilt, row)
    assert fixed._table[0] is table[0] and fixed._table[1] is table[1]  # updated in place
    np.testing.assert_allclose(r1.numpy(), r2.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(s1.numpy(), s2.detach().numpy(), atol=1e-6)
    assert (r1 - r0).abs().max() > 0.1 and s1.abs().max() > 0.1


def test_reference_view_is_fixed_and_gets_zero_gradient():
    poses = Poses(ANGLES, reference_index=3, learn_rotations=True, learn_shifts=True)
    with torch.no_grad():
        poses.z1.fill_(0.1)
        poses.z3.fill_(-0.2)
        poses.shifts.fill_(1.5)
    tilts = torch.arange(len(ANGLES))
    r, s = poses(tilts, tilts)
    torch.testing.assert_close(r[3], torch.from_numpy(_ry(math.radians(0.5))).float())
    assert s[3].abs().max() == 0
    (r.sum() + (r * r.roll(1, 0)).sum() + s.sum()).backward()
    for p in (poses.z1, poses.z3):
        assert p.grad[3] == 0 and (p.grad[[0, 1, 2, 4, 5]] != 0).all()
    assert (poses.shifts.grad[3] == 0).all() and (poses.shifts.grad[[0, 1, 2, 4, 5]] != 0).all()


def test_frozen_poses_have_no_trainable_parameters_and_survive_a_device_move():
    poses = Poses(ANGLES, reference_index=3)
    assert [p for p in poses.parameters() if p.requires_grad] == [] and not poses.z1.requires_grad
    learn = Poses(ANGLES, reference_index=3, learn_rotations=False, learn_shifts=True)
    assert [p for p in learn.parameters() if p.requires_grad] == [learn.shifts]
    with torch.no_grad():
        learn.shifts.fill_(2.0)
    moved = learn.to("cpu").to(torch.device("cpu"))
    assert (moved.shifts == 2.0).all()
    fresh = Poses(ANGLES, reference_index=3, learn_shifts=True)
    fresh.load_state_dict(learn.state_dict())
    assert (fresh.shifts == 2.0).all()
    np.testing.assert_allclose(fresh.angles_deg(), ANGLES, atol=1e-5)


def test_per_line_angles_select_the_row():
    n, h = 3, 4
    ang = np.linspace(-40, 40, n * h).reshape(n, h)
    poses = Poses(ang, reference_index=1)
    tilt = torch.tensor([0, 2, 2])
    row = torch.tensor([1, 0, 3])
    r, _ = poses(tilt, row)
    for b in range(3):
        expect = _ry(math.radians(ang[tilt[b], row[b]]))
        np.testing.assert_allclose(r[b].numpy(), expect, atol=1e-6)
    with pytest.raises(ValueError):
        poses(tilt)
    d = poses.describe()
    assert len(d["tilt_deg"]) == n and d["tilt_deg"][0] == pytest.approx(ang[0].mean())


def test_from_tiltseries_describe_and_fp32_under_autocast():
    ts = TiltSeries(stack=np.zeros((5, 4, 6), np.float32), angles=np.array([-40, -20, 1, 20, 40.0]))
    poses = Poses(ts.angles, ts.reference_index(), learn_rotations=True, learn_shifts=False)
    assert poses.reference_index == 2 and poses.learn_rotations and not poses.learn_shifts
    with torch.no_grad():
        poses.z1[0] = math.radians(2.0)
        poses.z1[2] = math.radians(9.0)  # reference: masked
    d = poses.describe()
    assert d["z1_deg"][0] == pytest.approx(2.0, abs=1e-4) and d["z1_deg"][2] == 0.0
    assert d["max_abs_inplane_deg"] == pytest.approx(2.0, abs=1e-4)
    assert not [p for p in Poses(ts.angles, ts.reference_index()).parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r, s = poses(torch.tensor([0, 4]), torch.tensor([0, 0]))
    assert r.dtype == torch.float32 and s.dtype == torch.float32


def _posed(free: bool, seed: int = 0, tilt_axis: bool = False) -> Poses:
    """Poses over ANGLES (reference 0.5 degrees, index 3) with random rotations and shifts; with
    ``tilt_axis`` z3 alone (z1 not learned) plus a rotation common to every view."""
    poses = Poses(ANGLES, reference_index=3, learn_rotations=True, learn_shifts=True, free_reference_shift=free,
                  learn_z1=not tilt_axis, learn_tilt_axis=tilt_axis)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        z1 = 0.02 * torch.randn(len(ANGLES), generator=g)
        poses.z1.copy_(0.0 * z1 if tilt_axis else z1)
        poses.z3.copy_(0.02 * torch.randn(len(ANGLES), generator=g))
        poses.shifts.copy_(2.0 * torch.randn(len(ANGLES), 2, generator=g))
        poses.axis.fill_(0.03 if tilt_axis else 0.0)
    return poses


def test_free_reference_shift_is_reported_in_the_frame_where_it_is_zero():
    """Raw shifts = true shifts (reference 0) + P R_n t for a translation t across the reference
    beam: the gauge translation is t and describe() gives back the true shifts."""
    poses = _posed(True)
    ref = poses.reference_index
    true = poses.shifts.detach().clone()
    true[ref] = 0.0
    with torch.no_grad():
        r, _ = poses(torch.arange(len(ANGLES)))
        t = r[ref].t() @ torch.tensor([0.7, -1.3, 0.0])       # across the reference beam
        poses.shifts.copy_(true + (r @ t)[:, :2])
    assert torch.allclose(poses.gauge_translation(), t, atol=1e-5)
    d = poses.describe()
    np.testing.assert_allclose(d["shift_u_px"], true[:, 0].numpy(), atol=1e-5)
    np.testing.assert_allclose(d["shift_v_px"], true[:, 1].numpy(), atol=1e-5)
    assert d["shift_u_px"][ref] == 0.0 and d["shift_v_px"][ref] == 0.0
    # pinned (the default of the class): the reference shift has no effect and no gradient
    pinned = _posed(False)
    assert torch.equal(pinned.gauge_translation(), torch.zeros(3))
    _, s = pinned(torch.tensor([ref]))
    assert torch.equal(s, torch.zeros(1, 2))


def test_tilt_axis_rotation_turns_every_view_and_learns_only_without_z1():
    """The common rotation adds to every view's z3, the reference's included, and is learned from
    all of them (z1 not learned); with z1 learned it is not learned (else an exact gauge)."""
    poses = _posed(False, tilt_axis=True)
    assert poses.learn_tilt_axis and poses.axis.requires_grad and not poses.z1.requires_grad
    r, _ = poses(torch.arange(len(ANGLES)))
    for v in range(len(ANGLES)):
        z3 = (0.0 if v == 3 else float(poses.z3.detach()[v])) + 0.03
        np.testing.assert_allclose(r[v].detach().numpy(), _rz(z3) @ _ry(math.radians(ANGLES[v])), atol=1e-6)
    r.sum().backward()
    assert poses.axis.grad != 0 and poses.z3.grad[3] == 0
    d = poses.describe()
    assert d["tilt_axis_deg"] == pytest.approx(math.degrees(0.03), rel=1e-6)
    assert d["z3_deg"][3] == pytest.approx(math.degrees(0.03), rel=1e-6)
    with_z1 = Poses(ANGLES, reference_index=3, learn_rotations=True, learn_z1=True, learn_tilt_axis=True)
    assert not with_z1.learn_tilt_axis and not with_z1.axis.requires_grad
    # a state dict from before the common rotation existed loads (it was zero)
    old = {k: v for k, v in poses.state_dict().items() if k != "axis"}
    fresh = Poses(ANGLES, reference_index=3, learn_rotations=True, learn_z1=False, learn_tilt_axis=True)
    with torch.no_grad():
        fresh.axis.fill_(0.5)
    fresh.load_state_dict(old)
    assert float(fresh.axis.detach()) == 0.0 and torch.equal(fresh.z3, poses.z3.detach())


class _Blob(torch.nn.Module):
    """An analytic field: a Gaussian blob at ``centre`` (voxels) in a box (normalized input)."""

    def __init__(self, box, centre, sigma=2.5):
        super().__init__()
        self.box, self.sigma = box, sigma
        self.register_buffer("centre", torch.as_tensor(centre, dtype=torch.float32))
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, pts):
        p = self.box.denormalize(pts)
        return torch.exp(-((p - self.centre) ** 2).sum(-1) / (2 * self.sigma ** 2)) + 0 * self.dummy


@pytest.mark.parametrize("tilt_axis", [False, True])
def test_projector_images_and_exported_volume_agree_across_the_gauge(tilt_axis):
    """The field f seen with raw shifts s_n predicts the same images as the exported volume (f moved
    by t) seen with the reported shifts s_n - P R_n t; volume() puts the blob at centre + t. Also
    with a tilt-axis rotation turning the reference view, which t includes."""
    from fasttomo.geometry.rays import Box
    from fasttomo.methods.field.projector import Projector

    box = Box((24, 24, 24))
    hw = (24, 24)
    poses = _posed(True, seed=3, tilt_axis=tilt_axis)
    centre = torch.tensor([1.5, -2.0, 3.0])
    proj = Projector(_Blob(box, centre), poses, box, hw, samples_per_ray=96)
    t = poses.gauge_translation()
    assert float(t.norm()) > 0.5
    moved = Poses(ANGLES, reference_index=3, learn_rotations=True, learn_shifts=True,
                  learn_z1=not tilt_axis, learn_tilt_axis=tilt_axis)
    d = poses.describe()
    with torch.no_grad():
        moved.z1.copy_(poses.z1)
        moved.z3.copy_(poses.z3)
        moved.axis.copy_(poses.axis)
        moved.shifts.copy_(torch.tensor(np.stack((d["shift_u_px"], d["shift_v_px"]), -1), dtype=torch.float32))
    proj_moved = Projector(_Blob(box, centre + t), moved, box, hw, samples_per_ray=96)
    tilt = torch.arange(len(ANGLES)).repeat_interleave(hw[0] * hw[1])
    row = torch.arange(hw[0]).repeat_interleave(hw[1]).repeat(len(ANGLES))
    col = torch.arange(hw[1]).repeat(hw[0] * len(ANGLES))
    with torch.no_grad():
        a, b = proj(tilt, row, col), proj_moved(tilt, row, col)
    assert float(a.max()) > 0.05
    assert torch.allclose(a, b, atol=2e-3 * float(a.max()))
    vol = proj.volume()                                                     # (Z, Y, X)
    z, y, x = torch.meshgrid(*(torch.arange(n, dtype=torch.float32) - (n - 1) / 2 for n in vol.shape), indexing="ij")
    com = torch.stack([(vol * c).sum() / vol.sum() for c in (x, y, z)])
    assert torch.allclose(com, centre + t, atol=0.05)


def test_the_reported_tilt_angles_are_the_given_ones_not_their_float32_rounding():
    """poses.tlt and metrics.json's tilt_deg held -60.000001669652114 for a file's -60.0: the
    angles went through the float32 buffer the rays use."""
    angles = np.array([-60.0, -54.0, -1.5, 0.0, 33.3, 60.0])
    d = Poses(angles, reference_index=3, learn_rotations=True).describe()
    assert d["tilt_deg"] == angles.tolist()
