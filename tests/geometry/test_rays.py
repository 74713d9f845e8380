import math

import numpy as np
import pytest
import torch

from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import (INSIDE_TOL, Box, RaySamples, inside_box, line_integral, project_points,
                                    ray_samples, voxel_grid, voxel_plane)


def _np_ray(R, shift, row, col, hw):
    """Independent numpy origin/direction of a pixel's ray (float64)."""
    h, w = hw
    det = np.array([col - (w - 1) / 2 - shift[0], row - (h - 1) / 2 - shift[1], 0.0])
    return R.T @ det, R.T @ np.array([0.0, 0.0, 1.0])


def _brute_chord(o, d, box, n=40001):
    half = np.array(box.half_extent)
    big = float(np.linalg.norm(half)) * 2 + np.abs(o).max() * 2
    t = np.linspace(-big, big, n)
    p = o[None] + t[:, None] * d[None]
    inside = (np.abs(p) <= half).all(axis=1)
    return inside.mean() * 2 * big, 2 * big / (n - 1)


def _poses(angles, learn=True, seed=0):
    poses = Poses(np.asarray(angles, float), reference_index=int(np.argmin(np.abs(angles))),
                  learn_rotations=learn, learn_shifts=learn)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        poses.z1.copy_((torch.rand(len(angles), generator=g) - 0.5) * 0.6)
        poses.z3.copy_((torch.rand(len(angles), generator=g) - 0.5) * 0.6)
        poses.shifts.copy_(torch.randn(len(angles), 2, generator=g) * 1.5)
    return poses


def test_constant_density_integrates_to_the_chord_for_random_rays_rectangular_images():
    n_tilts, h, w, thick = 13, 6, 10, 7  # n_tilts > H, H != W
    box = Box.for_images(h, w, thick)
    assert box.shape_zyx == (7, 6, 10) and box.half_extent == (5.0, 3.0, 3.5)
    poses = _poses(np.linspace(-60, 60, n_tilts))
    g = torch.Generator().manual_seed(1)
    b = 400
    tilt = torch.randint(0, n_tilts, (b,), generator=g)
    row = torch.rand(b, generator=g) * (h + 4) - 2  # sub-pixel, some outside the image
    col = torch.rand(b, generator=g) * (w + 4) - 2
    R, s = poses(tilt, row.long())
    rs = ray_samples(row, col, R, s, (h, w), box, n_samples=16)
    assert rs.points.shape == (b, 16, 3) and rs.dt.shape == (b,) and rs.inside.shape == (b, 16)
    integral = line_integral(torch.ones(b, 16), rs).detach()
    Rn, sn = R.detach().double().numpy(), s.detach().double().numpy()
    n_hit = n_miss = 0
    for k in range(b):
        o, d = _np_ray(Rn[k], sn[k], float(row[k]), float(col[k]), (h, w))
        chord, step = _brute_chord(o, d, box)
        assert float(integral[k]) == pytest.approx(chord, abs=2 * step + 1e-4)
        n_hit += chord > 0.1
        n_miss += chord == 0
    assert n_hit > 150 and n_miss > 5  # both cases exercised
    # every sample inside the box is flagged inside, and only those
    assert (rs.inside == (rs.points.abs() <= 1 + 1e-5).all(-1) & (rs.dt > 0)[:, None]).all()


@pytest.mark.parametrize("case", ["z_faces", "x_faces", "y_faces"])
def test_density_one_everywhere_integrates_to_exactly_the_box_chord(case):
    if case == "z_faces":
        shape, tilt, z1, expect = (8, 7, 21), 20.0, 0.0, 8 / math.cos(math.radians(20))
    elif case == "x_faces":
        shape, tilt, z1, expect = (40, 7, 9), 60.0, 0.0, 9 / math.sin(math.radians(60))
    else:  # z1 = 90 deg turns the tilt's sideways travel onto y
        shape, tilt, z1, expect = (40, 5, 41), 60.0, 90.0, 5 / math.sin(math.radians(60))
    box = Box(shape)
    h, w = shape[1], shape[2]
    poses = Poses(np.array([0.0, tilt]), reference_index=0, learn_rotations=True)
    with torch.no_grad():
        poses.z1[1] = math.radians(z1)
    R, s = poses(torch.tensor([1]), torch.tensor([0]))
    row, col = torch.tensor([(h - 1) // 2]), torch.tensor([(w - 1) // 2])
    rs = ray_samples(row, col, R, s, (h, w), box, n_samples=7)

    def everywhere_one(points):  # a density defined on all of R^3
        return torch.ones(points.shape[:-1])

    got = line_integral(everywhere_one(rs.points), rs).detach()
    assert float(got[0]) == pytest.approx(expect, rel=1e-5)
    # the samples' physical positions lie on the clipped chord and span it symmetrically
    p = box.denormalize(rs.points[0].detach())
    assert float((p[-1] - p[0]).norm() + rs.dt[0].detach()) == pytest.approx(expect, rel=1e-5)
    # midpoint rule: exact for a linear density (the central ray's chord is centred on 0)
    lin = 1.0 + (p * torch.tensor([0.3, -0.2, 0.25])).sum(-1)
    got = line_integral(lin[None], rs).detach()
    assert float(got[0]) == pytest.approx(expect, rel=1e-5)
    torch.testing.assert_close(p.mean(0), torch.zeros(3), atol=1e-5, rtol=0)


def test_inside_mask_applies_to_all_three_axes():
    pts = torch.tensor([[[0.0, 0.0, 0.0], [1.2, 0.0, 0.0], [0.0, -1.2, 0.0], [0.0, 0.0, 1.2],
                         [1.0, -1.0, 1.0]]])
    assert inside_box(pts).tolist() == [[True, False, False, False, True]]
    off = torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 1.0 + 2 * INSIDE_TOL]])
    assert inside_box(off).tolist() == [False, False]  # a NaN coordinate; just past the tolerance
    rs = RaySamples(points=pts, dt=torch.tensor([0.5]), inside=inside_box(pts))
    assert float(line_integral(torch.ones(1, 5), rs)) == pytest.approx(1.0)  # 2 inside * 0.5


def test_rays_that_miss_the_box_integrate_to_zero():
    box = Box((6, 8, 10))
    h, w = 8, 10
    poses = Poses(np.array([0.0, 30.0]), reference_index=0, learn_shifts=True)
    with torch.no_grad():
        poses.shifts[1, 0] = 1000.0
    tilt = torch.tensor([1, 0, 0, 1])
    row = torch.tensor([3.0, 3.0, h + 3.0, -5.0])  # rows 2, 3: outside the y slab (parallel case)
    col = torch.tensor([4.0, -20.0, 4.0, 4.0])  # ray 1: x-parallel at tilt 0, outside the x slab
    R, s = poses(tilt, row.long())
    rs = ray_samples(row, col, R, s, (h, w), box, n_samples=8)
    assert (rs.dt == 0).all() and not rs.inside.any()
    assert torch.isfinite(rs.points).all() and (rs.points.abs() <= 1).all()
    assert (line_integral(torch.full((4, 8), 7.0), rs) == 0).all()


def _gauss_field(box, centre, sigma):
    c = torch.tensor(centre, dtype=torch.float64)

    def density(points_n):
        p = box.denormalize(points_n.double())
        return torch.exp(-((p - c) ** 2).sum(-1) / (2 * sigma ** 2))
    return density


@pytest.mark.parametrize("angle", [-60.0, -30.0, 30.0, 60.0])
def test_gaussian_blob_projection_matches_the_analytic_line_integral(angle):
    h, w, thick, sigma = 21, 31, 32, 1.2
    box = Box.for_images(h, w, thick)
    centre = (5.0, -2.0, 6.0)
    poses = _poses(np.array([0.0, angle]), seed=3)
    tilt = torch.ones(h * w, dtype=torch.long)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    rows, cols = rows.reshape(-1), cols.reshape(-1)
    R, s = poses(tilt, rows)
    rs = ray_samples(rows, cols, R, s, (h, w), box, n_samples=96)
    img = line_integral(_gauss_field(box, centre, sigma)(rs.points), rs).reshape(h, w).detach()
    Rn, sn = R[0].detach().double().numpy(), s[0].detach().double().numpy()
    expect = np.zeros((h, w))
    for i in range(h):
        for j in range(w):
            o, d = _np_ray(Rn, sn, i, j, (h, w))
            dist2 = np.sum((np.array(centre) - o) ** 2) - np.dot(np.array(centre) - o, d) ** 2
            expect[i, j] = math.sqrt(2 * math.pi) * sigma * math.exp(-dist2 / (2 * sigma ** 2))
    np.testing.assert_allclose(img.numpy(), expect, atol=2e-4)
    # the blob's image centre is where project_points puts the centre
    u, v = project_points(torch.tensor([centre]), R[:1].detach(), s[:1].detach())
    wsum = img.sum()
    u_mean = float((img.sum(0) * (torch.arange(w) - (w - 1) / 2)).sum() / wsum)
    v_mean = float((img.sum(1) * (torch.arange(h) - (h - 1) / 2)).sum() / wsum)
    assert (u_mean, v_mean) == (pytest.approx(float(u[0]), abs=0.02), pytest.approx(float(v[0]), abs=0.02))


def test_point_above_centre_projects_to_plus_u_at_plus_30():
    h, w, thick = 5, 21, 24
    box = Box.for_images(h, w, thick)
    poses = Poses(np.array([0.0, 30.0]), reference_index=0)
    rows, cols = torch.full((w,), 2), torch.arange(w)
    R, s = poses(torch.ones(w, dtype=torch.long), rows)
    rs = ray_samples(rows, cols, R, s, (h, w), box, n_samples=64)
    img = line_integral(_gauss_field(box, (0.0, 0.0, 10.0), 0.7)(rs.points), rs)
    assert int(img.argmax()) == 10 + 5  # u = +5


def test_ray_math_stays_fp32_under_autocast_and_is_differentiable_in_the_pose():
    box = Box((6, 8, 10))
    poses = _poses(np.array([-20.0, 0.0, 20.0]))
    tilt, row, col = torch.tensor([0, 2]), torch.tensor([3, 4]), torch.tensor([5, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        R, s = poses(tilt, row)
        rs = ray_samples(row, col, R, s, (8, 10), box, 8)
        dens = rs.points.square().sum(-1).to(torch.bfloat16)
        out = line_integral(dens, rs)
    assert rs.points.dtype == torch.float32 and rs.dt.dtype == torch.float32 and out.dtype == torch.float32
    line_integral(rs.points.square().sum(-1), rs).sum().backward()
    assert poses.shifts.grad.abs().sum() > 0 and poses.z1.grad.abs().sum() > 0


def test_voxel_grid_centres_match_pixel_centres():
    box = Box.for_images(4, 6, 3)
    g = voxel_grid(box)
    assert g.shape == (3, 4, 6, 3)
    p = box.denormalize(g)
    torch.testing.assert_close(p[0, 0, :, 0], torch.arange(6) - 2.5)  # u of column j
    torch.testing.assert_close(p[0, :, 0, 1], torch.arange(4) - 1.5)  # v of row i
    torch.testing.assert_close(p[:, 0, 0, 2], torch.arange(3) - 1.0)
    g2 = voxel_grid(box, (2, 2, 2))
    torch.testing.assert_close(g2[..., 0].unique(), torch.tensor([-0.5, 0.5]))


def test_voxel_plane_is_the_grid_cut_at_one_index():
    """The central slices' points (Trainer.central_slices) are built plane by plane: each plane is
    the whole grid's cut, bit for bit, at every index of every axis."""
    box = Box.for_images(4, 6, 3)
    g = voxel_grid(box)
    for axis in range(3):
        for i in range(g.shape[axis]):
            assert torch.equal(voxel_plane(box, axis, i), g.select(axis, i))
