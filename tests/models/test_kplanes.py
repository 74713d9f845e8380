import math

import numpy as np
import pytest
import torch
from torch.func import functional_call

from fasttomo.config import ModelConfig
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box, line_integral, ray_samples
from fasttomo.models import KPlanesTILTED, build_field

TINY = dict(channels=2, resolutions=[[3, 4, 5], [4, 3, 3]], hidden=4)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_shapes_groups_and_tilted_extent():
    m = KPlanesTILTED(n_rotations=3, generator=_gen(), **TINY)
    pts = torch.rand(5, 7, 3, generator=_gen(1)) * 2 - 1
    out = m(pts)
    assert out.shape == (5, 7) and (out >= 0).all()
    assert m.plane_data.dim() == 1 and m.plane_data.numel() == m.layout.numel
    assert (m.plane_data >= 0.1).all() and (m.plane_data <= 0.5).all()
    groups = m.param_groups()
    assert set(groups) == {"grids", "decoder", "rotations"}
    assert groups["grids"] == [m.plane_data] and groups["rotations"] == [m.rot_params]
    assert len(groups["decoder"]) == 6  # hybrid: three Linear layers
    n_all = sum(p.numel() for p in m.parameters())
    assert n_all == sum(p.numel() for g in groups.values() for p in g)
    r = m.rotation_matrices()
    torch.testing.assert_close(r[0], torch.eye(3))  # frame 0 starts at the identity
    assert (r[1] - torch.eye(3)).abs().max() > 0.05
    corners = torch.tensor([[sx, sy, sz] for sx in (-1., 1.) for sy in (-1., 1.) for sz in (-1., 1.)])
    q = torch.einsum("tij,nj->tni", m.sampling_matrices(), corners)
    assert q.abs().max() <= 1 + 1e-6  # rotated unit cube stays inside the planes
    torch.testing.assert_close(m.sampling_matrices(), r / math.sqrt(3))


@pytest.mark.parametrize("param", ["svd", "quaternion"])
def test_gradients_reach_planes_decoder_and_rotations(param):
    m = KPlanesTILTED(n_rotations=2, rotation_param=param, generator=_gen(), **TINY)
    pts = torch.rand(64, 3, generator=_gen(2)) * 2 - 1
    (m(pts) ** 2).sum().backward()
    assert m.plane_data.grad.abs().sum() > 0
    for p in m.decoder.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert torch.isfinite(m.rot_params.grad).all()
    for t in range(2):  # every frame gets a gradient, identity included
        assert m.rot_params.grad[t].abs().sum() > 0


def test_frozen_rotations_and_plain_kplanes():
    m = KPlanesTILTED(n_rotations=2, learn_frames=False, generator=_gen(), **TINY)
    assert not m.rot_params.requires_grad and m.param_groups()["rotations"] == []
    assert m.extent == pytest.approx(math.sqrt(3))  # random frames still need the margin
    plain = KPlanesTILTED(n_rotations=1, learn_frames=False, **TINY)
    assert plain.plain and plain.extent == 1.0
    torch.testing.assert_close(plain.sampling_matrices(), torch.eye(3)[None])
    with pytest.raises(TypeError):
        KPlanesTILTED(bogus=1)


def test_plain_kplanes_matches_hand_computed_bilinear_values():
    # anisotropic (rx, ry, rz) = (3, 4, 5): xy plane is 4 x 3, xz 5 x 3, yz 5 x 4 (H x W), C = 1
    m = KPlanesTILTED(n_rotations=1, learn_frames=False, channels=1, resolutions=[[3, 4, 5]],
                      decoder="linear", activation="softplus", density_shift=0.0)
    with torch.no_grad():
        m.plane_data.copy_(torch.rand(m.plane_data.numel(), generator=_gen(3)) + 0.5)
        m.decoder.net.weight.fill_(1.0)
        m.decoder.net.bias.zero_()
    pd = m.plane_data.detach()
    assert pd.numel() == 12 + 15 + 20

    def xy(iy, ix): return pd[iy * 3 + ix]          # flat, channels-last, row-major (H, W)
    def xz(iz, ix): return pd[12 + iz * 3 + ix]
    def yz(iz, iy): return pd[27 + iz * 4 + iy]
    def coord(i, n): return -1 + 2 * i / (n - 1)    # align_corners=True texel centres

    ix, iy, iz = 2, 1, 3
    p = torch.tensor([[coord(ix, 3), coord(iy, 4), coord(iz, 5)]])
    feat = xy(iy, ix) * xz(iz, ix) * yz(iz, iy)
    torch.testing.assert_close(m(p)[0], torch.nn.functional.softplus(feat))
    # halfway between x texels 0 and 1 (y, z on texel centres): linear in x on xy and xz
    p = torch.tensor([[-0.5, coord(iy, 4), coord(iz, 5)]])
    feat = 0.5 * (xy(iy, 0) + xy(iy, 1)) * 0.5 * (xz(iz, 0) + xz(iz, 1)) * yz(iz, iy)
    torch.testing.assert_close(m(p)[0], torch.nn.functional.softplus(feat))


def test_gradcheck_float64_points_planes_and_rotations():
    m = KPlanesTILTED(n_rotations=2, generator=_gen(4), **TINY).double()
    pts = (torch.rand(4, 3, generator=_gen(5), dtype=torch.float64) * 1.8 - 0.9).requires_grad_(True)
    assert torch.autograd.gradcheck(m, (pts,))
    params = {k: v.detach() for k, v in m.named_parameters()}

    def of(name):
        def f(x):
            return functional_call(m, {**params, name: x}, (pts.detach(),))
        return f
    pd = params["plane_data"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(of("plane_data"), (pd,))
    rp = params["rot_params"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(of("rot_params"), (rp,))


def test_anisotropic_resolutions_give_correct_planes_and_train():
    m = KPlanesTILTED(n_rotations=1, learn_frames=False, channels=4, resolutions=[[4, 6, 8]],
                      decoder="hybrid", hidden=16, generator=_gen(6))
    lay = m.layout
    assert [tuple(lay.view(m.plane_data, 0, k).shape) for k in range(3)] == [
        (1, 6, 4, 4), (1, 8, 4, 4), (1, 8, 6, 4)]
    g = _gen(7)
    pts = torch.rand(256, 3, generator=g) * 2 - 1
    target = 0.5 + 0.4 * torch.sin(2.5 * pts[:, 2]) * torch.cos(1.5 * pts[:, 1]) + 0.2 * pts[:, 0]
    opt = torch.optim.Adam(m.parameters(), lr=2e-2)
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = ((m(pts) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    for k in range(3):  # every plane kind was trained
        assert (lay.view(m.plane_data.grad, 0, k) != 0).any()


def test_end_to_end_projection_gradients_and_fixed_reference_pose():
    angles = np.array([-40.0, -20.0, 0.0, 20.0, 40.0])
    h, w, thick = 6, 8, 4
    box = Box.for_images(h, w, thick)
    torch.manual_seed(0)
    field = build_field(ModelConfig(**TINY, n_rotations=2), box)
    poses = Poses(angles, reference_index=2, learn_rotations=True, learn_shifts=True)
    g = _gen(8)
    b = 64
    tilt = torch.arange(b) % 5
    row, col = torch.randint(0, h, (b,), generator=g), torch.randint(0, w, (b,), generator=g)
    R, s = poses(tilt, row)
    rs = ray_samples(row, col, R, s, (h, w), box, 8)
    pred = line_integral(field(rs.points), rs)
    ((pred - 1.0) ** 2).mean().backward()
    for p in (poses.z1, poses.z3):
        assert p.grad[2] == 0 and (p.grad[[0, 1, 3, 4]] != 0).all()
    assert (poses.shifts.grad[2] == 0).all() and (poses.shifts.grad[[0, 1, 3, 4]] != 0).any(dim=1).all()
    assert field.plane_data.grad.abs().sum() > 0 and field.rot_params.grad.abs().sum() > 0
