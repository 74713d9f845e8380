import pytest
import torch

from fasttomo.config import LossConfig, ModelConfig
from fasttomo.geometry.rays import Box
from fasttomo.kernels import reference
from fasttomo.models import KPlanesTILTED, VoxelField
from fasttomo.models.regularizers import field_volume_tv, random_subgrid, regularization

TINY = dict(channels=2, resolutions=[4, [3, 4, 5]], hidden=4)


def test_random_subgrid_is_small_inside_and_reproducible():
    for seed in range(20):
        g = random_subgrid(5, torch.Generator().manual_seed(seed))
        assert g.shape == (5, 5, 5, 3)
        assert (g.abs() <= 1 + 1e-6).all()
        side = g[-1, -1, -1] - g[0, 0, 0]
        assert (side > 0.099).all() and (side < 0.501).all()
        torch.testing.assert_close(side, side[:1].expand(3))  # cubic
        # x varies along the last index, z along the first
        assert (g[0, 0, 1, 0] > g[0, 0, 0, 0]) and (g[1, 0, 0, 2] > g[0, 0, 0, 2])
    a = random_subgrid(4, torch.Generator().manual_seed(3))
    b = random_subgrid(4, torch.Generator().manual_seed(3))
    c = random_subgrid(4, torch.Generator().manual_seed(4))
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, c)


def test_random_subgrid_is_its_definition_bit_for_bit():
    """The corner lo and side from the noise, then lo + linspace(0, 1, n) * side along x, y, z
    (index order z, y, x): the cached unit grid gives these floats exactly, given noise or drawn."""
    from fasttomo.models.regularizers import SUBGRID_NOISE, SUBGRID_SIZE

    lo_s, hi_s = SUBGRID_SIZE
    for seed in range(30):
        for n in (2, 5, 16):
            r = torch.rand(SUBGRID_NOISE, generator=torch.Generator().manual_seed(seed))
            side = 2.0 * (lo_s + (hi_s - lo_s) * r[0])
            lo = -1.0 + (2.0 - side) * r[1:]
            t = torch.linspace(0.0, 1.0, n) * side
            gz, gy, gx = torch.meshgrid(lo[2] + t, lo[1] + t, lo[0] + t, indexing="ij")
            want = torch.stack((gx, gy, gz), dim=-1)
            assert torch.equal(random_subgrid(n, noise=r), want)
            assert torch.equal(random_subgrid(n, torch.Generator().manual_seed(seed)), want)


def test_field_volume_tv_is_zero_for_a_constant_field_and_differentiable():
    class Affine(torch.nn.Module):
        def __init__(self, slope):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor([slope, 0.0, 0.0]))

        def forward(self, p):
            return p @ self.w

    assert field_volume_tv(Affine(0.0), 4, "squared", torch.Generator().manual_seed(0)).item() == 0.0
    f = Affine(2.0)
    tv = field_volume_tv(f, 4, "l1", torch.Generator().manual_seed(0))
    g = random_subgrid(4, torch.Generator().manual_seed(0))
    step = float(g[0, 0, 1, 0] - g[0, 0, 0, 0])
    assert tv.item() == pytest.approx(2.0 * step, rel=1e-5)  # only x differences, mean |2 dx|
    tv.backward()
    assert f.w.grad[0] != 0


def test_regularization_parts_and_weights():
    torch.manual_seed(0)
    m = KPlanesTILTED(n_rotations=2, **TINY)
    cfg = LossConfig(plane_tv=0.5, volume_tv=2.0, volume_tv_points=4)
    total, parts = regularization(m, cfg, torch.Generator().manual_seed(1))
    assert set(parts) == {"plane_tv", "volume_tv"}
    torch.testing.assert_close(parts["plane_tv"], 0.5 * reference.plane_tv(m.plane_data, m.layout))
    torch.testing.assert_close(parts["volume_tv"],
                               2.0 * field_volume_tv(m, 4, cfg.volume_tv_kind, torch.Generator().manual_seed(1)))
    torch.testing.assert_close(total, parts["plane_tv"] + parts["volume_tv"])
    total.backward()
    assert m.plane_data.grad.abs().sum() > 0
    # weights of zero drop the term; the voxel grid uses its own TV and has no plane TV
    total, parts = regularization(m, LossConfig(plane_tv=0.0, volume_tv=0.0))
    assert parts == {} and total.item() == 0.0
    v = VoxelField((3, 4, 5))
    with torch.no_grad():
        v.grid.copy_(torch.randn(3, 4, 5))
    total, parts = regularization(v, LossConfig(plane_tv=1.0, volume_tv=3.0, volume_tv_kind="l1"))
    assert set(parts) == {"volume_tv"}
    torch.testing.assert_close(total, 3.0 * reference.volume_tv(v.density(), "l1"))


def test_the_sub_grid_evaluated_with_the_rays_gives_the_same_losses_and_gradients():
    """Projector.forward(extra_points=) evaluates the field once for the rays and the volume TV's
    sub-grid, and with plane_tv=True also gives the plane TV (the trainer's step); predictions, the
    TV terms and every gradient match the separate evaluations."""
    from fasttomo.geometry.poses import Poses
    from fasttomo.methods.field.projector import Projector

    torch.manual_seed(0)
    box = Box((4, 6, 6))
    cfg = LossConfig(plane_tv=0.5, volume_tv=2.0, volume_tv_points=4)
    proj = Projector(KPlanesTILTED(n_rotations=2, **TINY), Poses(torch.tensor([-30.0, 0.0, 30.0]), 1), box,
                     (6, 6), samples_per_ray=5, loss=cfg)
    tilt, row, col = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 2, 5, 3]), torch.tensor([1, 3, 0, 5])
    noise = torch.rand(4, generator=torch.Generator().manual_seed(5))
    grads = []
    assert proj.plane_tv_in_forward()
    for merged in ("no", "sub-grid", "sub-grid and plane TV"):
        proj.zero_grad(set_to_none=True)
        if merged == "no":
            pred = proj(tilt, row, col)
            reg, parts = proj.regularization(noise=noise)
        else:
            pts = proj.tv_points(noise=noise)
            assert pts.shape == (4, 4, 4, 3)
            with_tv = merged == "sub-grid and plane TV"
            pred, dens, ptv = proj(tilt, row, col, pts, plane_tv=with_tv)
            assert dens.shape == (4, 4, 4) and (ptv is not None) == with_tv
            reg, parts = proj.regularization(noise=noise, tv_density=dens, plane_tv=ptv)
        (pred.square().sum() + reg).backward()
        grads.append((pred.detach(), parts["volume_tv"].detach(), parts["plane_tv"].detach(),
                      [p.grad.clone() for p in proj.parameters() if p.grad is not None]))
    p0, tv0, ptv0, g0 = grads[0]
    assert tv0 > 0 and ptv0 > 0 and len(g0) >= 3
    for p1, tv1, ptv1, g1 in grads[1:]:
        torch.testing.assert_close(p1, p0)
        torch.testing.assert_close(tv1, tv0)
        torch.testing.assert_close(ptv1, ptv0)
        assert len(g1) == len(g0)
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b, a)
    # no volume TV term: no sub-grid
    proj.loss = LossConfig(volume_tv=0.0)
    assert proj.tv_points(noise=noise) is None


def test_the_plane_tv_schedule_holds_the_light_weight_then_ramps_to_the_chosen_one():
    from fasttomo.models.regularizers import PLANE_TV, PlaneTVSchedule

    s = PlaneTVSchedule(1.0, hold=0.3, ramp=0.2)
    weights = [1.0 * s.factor(step, 100) for step in range(100)]
    assert weights[0] == weights[29] == pytest.approx(PLANE_TV)  # held at the light weight
    assert weights[40] == pytest.approx(PLANE_TV + (1.0 - PLANE_TV) * 0.5)  # half way up the ramp
    assert weights[50] == weights[99] == 1.0
    assert all(b >= a for a, b in zip(weights, weights[1:]))  # never falls back
    step_up = PlaneTVSchedule(0.5, hold=0.5)  # no ramp: a step at the hold's end
    assert step_up.factor(49, 100) * 0.5 == pytest.approx(PLANE_TV) and step_up.factor(50, 100) == 1.0
    # a weight at or below the light one, or neither fraction set: constant
    for const in (PlaneTVSchedule(PLANE_TV, 0.3, 0.3), PlaneTVSchedule(1e-2, 0.3, 0.3), PlaneTVSchedule(1.0)):
        assert not const.varies and {const.factor(s, 100) for s in range(100)} == {1.0}


def test_regularization_scales_the_plane_tv_by_the_schedule_factor_only():
    torch.manual_seed(0)
    m = KPlanesTILTED(n_rotations=2, **TINY)
    cfg = LossConfig(plane_tv=0.5, volume_tv=2.0, volume_tv_points=4)
    _, full = regularization(m, cfg, torch.Generator().manual_seed(1))
    _, scaled = regularization(m, cfg, torch.Generator().manual_seed(1), plane_tv_scale=torch.tensor(0.06))
    torch.testing.assert_close(scaled["plane_tv"], 0.06 * full["plane_tv"])
    torch.testing.assert_close(scaled["volume_tv"], full["volume_tv"])


@pytest.mark.parametrize("hold,ramp,match", [(-0.1, 0.0, "loss.plane_tv_hold"), (0.0, 1.5, "loss.plane_tv_ramp"),
                                             (0.6, 0.6, "plane_tv_hold \\+ loss.plane_tv_ramp")])
def test_plane_tv_hold_and_ramp_out_of_range_name_the_keys(hold, ramp, match):
    from fasttomo.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        LossConfig(plane_tv_hold=hold, plane_tv_ramp=ramp)
