"""GPU suite of the SIRT projector kernels: parity with the twins at realistic sizes, the dispatch
spy, the kill switch and autograd routing, opcheck, and fused SIRT against the twin SIRT.
Skipped (with the reason) where CUDA or triton is missing."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from fasttomo.methods.sirt import back_project, forward_project, sirt
from fasttomo.methods.sirt.projectors import view_poses
from fasttomo.data import phantom as P
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box
from fasttomo.kernels import dispatch, reference

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON),
                                 reason="needs a CUDA GPU and triton (SIRT projector GPU suite)")]


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _poses(n, inplane: bool, seed=0):
    angles = np.linspace(-60, 60, n)
    poses = Poses(angles, int(np.argmin(np.abs(angles))), learn_rotations=inplane, learn_shifts=inplane)
    if inplane:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            poses.z1.copy_((torch.rand(n, generator=g) - 0.5) * 0.2)
            poses.z3.copy_((torch.rand(n, generator=g) - 0.5) * 0.2)
            poses.shifts.copy_(torch.randn(n, 2, generator=g) * 3.0)
    return poses


@pytest.fixture(scope="module")
def case128():
    ph = P.default_phantom(128, 128, 128)
    vol = torch.from_numpy(P.voxelize(ph)).cuda()
    return ph, vol


@pytest.mark.parametrize("inplane", [False, True])
def test_parity_at_the_benchmark_size(case128, inplane):
    """128^3, 61 views, 128 x 128 images (the bench case), pure tilt and with in-plane poses."""
    _, vol = case128
    box = Box(tuple(vol.shape))
    poses = _poses(61, inplane)
    rot, shift = view_poses(poses, None, vol.device)
    dispatch.reset_counters()
    a = forward_project(vol, poses, box, (128, 128))
    img = a + 0.1 * torch.rand_like(a)
    b = back_project(img, poses, box)
    assert dispatch.counters == {"ray_project": {"triton": 1}, "voxel_backproject": {"triton": 1}}
    a_ref = reference.ray_project(vol, rot, shift, (128, 128), 0.5)
    b_ref = reference.voxel_backproject(img, rot, shift, box.shape_zyx)
    assert a.device == vol.device and a.shape == (61, 128, 128) and b.shape == (128, 128, 128)
    # fp32 positions of two different formulas: ~1e-6; a ray whose cell count rounds differently
    # (chord within ~1e-5 of a whole number of steps past the tolerance) differs by its quadrature
    # error only, ~1e-4 of its value
    assert rel(a, a_ref) < 1e-5 and float((a - a_ref).abs().max()) < 1e-3 * float(a_ref.abs().max())
    assert rel(b, b_ref) < 1e-5 and float((b - b_ref).abs().max()) < 1e-4 * float(b_ref.abs().max())


@pytest.mark.parametrize("shape,hw,n", [((40, 33, 57), (35, 61), 7), ((1, 64, 64), (64, 64), 5),
                                        ((64, 1, 96), (1, 96), 31), ((17, 9, 300), (9, 301), 3)])
def test_parity_odd_shapes(shape, hw, n):
    g = torch.Generator(device="cuda").manual_seed(1)
    vol = torch.rand(shape, device="cuda", generator=g)
    box = Box(shape)
    poses = _poses(n, True, seed=2)
    rot, shift = view_poses(poses, None, vol.device)
    for step in (0.5, 1.0, 0.3):
        a = forward_project(vol, poses, box, hw, step=step)
        assert rel(a, reference.ray_project(vol, rot, shift, hw, step)) < 1e-5
    img = torch.rand((n,) + hw, device="cuda", generator=g)
    assert rel(back_project(img, poses, box), reference.voxel_backproject(img, rot, shift, shape)) < 1e-5


def test_far_off_poses_give_zeros_not_garbage():
    vol = torch.rand(16, 16, 16, device="cuda")
    box = Box((16, 16, 16))
    poses = _poses(3, True)
    with torch.no_grad():
        poses.shifts.fill_(1e6)
        poses.free_mask.fill_(1.0)    # the reference view's rotations
        poses.shift_mask.fill_(1.0)   # and its shift (a separate mask since c688ace)
    a = forward_project(vol, poses, box, (16, 16))
    b = back_project(torch.rand(3, 16, 16, device="cuda"), poses, box)
    assert torch.equal(a, torch.zeros_like(a)) and torch.equal(b, torch.zeros_like(b))


def test_sirt_fused_matches_twin_and_takes_the_fast_path():
    ph = P.default_phantom(64, 64, 32)
    angles = np.linspace(-60, 60, 41)
    stack = torch.from_numpy(P.project(ph, angles)).cuda()
    poses = _poses(41, True, seed=3)
    box = Box(ph.shape_zyx)
    dispatch.reset_counters()
    x_fused = sirt(stack, poses, box, 10)
    assert dispatch.counters == {"ray_project": {"triton": 11}, "voxel_backproject": {"triton": 11}}
    dispatch.configure("torch")
    x_twin = sirt(stack, poses, box, 10)
    assert dispatch.counters["ray_project"] == {"triton": 11, "torch": 11}
    assert x_fused.device.type == "cuda" and rel(x_fused, x_twin) < 1e-4


def test_spy_kill_switch_dtype_and_autograd_routing():
    vol = torch.rand(8, 9, 10, device="cuda")
    box = Box((8, 9, 10))
    poses = _poses(3, False)
    img = torch.rand(3, 9, 10, device="cuda")
    dispatch.configure("torch")
    forward_project(vol, poses, box, (9, 10))
    back_project(img, poses, box)
    assert dispatch.counters == {"ray_project": {"torch": 1}, "voxel_backproject": {"torch": 1}}
    dispatch.configure("auto")
    dispatch.reset_counters()
    forward_project(vol.double(), poses, box, (9, 10))  # float64: twin
    v = vol.clone().requires_grad_()
    out = forward_project(v, poses, box, (9, 10))  # needs a gradient: twin (forward-only fast path)
    (g,) = torch.autograd.grad(out.sum(), [v])
    assert torch.isfinite(g).all() and float(g.abs().sum()) > 0
    with torch.no_grad():
        forward_project(v, poses, box, (9, 10))  # no grad mode: fast path
    assert dispatch.counters == {"ray_project": {"torch": 2, "triton": 1}}
    dispatch.configure("triton")
    with pytest.raises(dispatch.KernelUnavailableError, match="forward-only"):
        forward_project(v, poses, box, (9, 10))
    with pytest.raises(dispatch.KernelUnavailableError, match="float32"):
        back_project(img.double(), poses, box)


def test_opcheck():
    from fasttomo.kernels.triton import ops  # noqa: F401
    poses = _poses(4, True)
    rot, shift = view_poses(poses, None, torch.device("cuda"))
    vol = torch.rand(6, 7, 8, device="cuda")
    img = torch.rand(4, 7, 9, device="cuda")
    torch.library.opcheck(torch.ops.fasttomo.ray_project.default, (vol, rot, shift, 7, 9, 0.5))
    torch.library.opcheck(torch.ops.fasttomo.voxel_backproject.default, (img, rot, shift, 6, 7, 8))
