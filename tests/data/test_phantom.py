"""Analytic phantom: exact projections, geometry conventions, chirality, ground truth, tilt series."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fasttomo.config import DataConfig
from fasttomo.data.phantom import (
    Ellipsoid,
    Phantom,
    PhantomError,
    default_phantom,
    default_thickness,
    euler_zxz,
    make_tiltseries,
    project,
    voxelize,
)
from fasttomo.data.tiltseries import TiltSeries


def _numeric_projection(phantom: Phantom, theta_deg: np.ndarray, u: np.ndarray, v: np.ndarray,
                        n_samples: int = 8000) -> np.ndarray:
    """Midpoint-rule line integrals of the point-evaluated density along the rays of (u, v, theta)."""
    half = np.array(phantom.shape_zyx[::-1], dtype=np.float64) / 2.0
    reach = float(np.linalg.norm(half)) + 1.0
    dt = 2.0 * reach / n_samples
    t = -reach + (np.arange(n_samples) + 0.5) * dt                          # (S,)
    th = np.deg2rad(theta_deg)[:, None]
    c, s = np.cos(th), np.sin(th)
    out = np.empty(len(u))
    for k0 in range(0, len(u), 64):
        sl = slice(k0, k0 + 64)
        x = u[sl, None] * c[sl] - t * s[sl]
        z = u[sl, None] * s[sl] + t * c[sl]
        y = np.broadcast_to(v[sl, None], x.shape)
        out[sl] = phantom.density(np.stack([x, y, z], -1)).sum(-1) * dt
    return out


def _tilted_phantom() -> Phantom:
    """A few rotated, overlapping ellipsoids (incl. a negative one) in a rectangular box."""
    return Phantom((24, 40, 56), [
        Ellipsoid((3.0, -2.0, 1.0), (14.0, 9.0, 6.0), (25.0, 40.0, -15.0), 0.5, "big"),
        Ellipsoid((-6.0, 5.0, -2.0), (5.0, 3.0, 4.0), (-60.0, 70.0, 10.0), 1.2, "tilted"),
        Ellipsoid((8.0, -4.0, 3.0), (3.0, 3.0, 3.0), None, -0.3, "hole"),
    ])


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("which", ["default", "tilted"])
def test_analytic_projection_matches_numeric_integration(which):
    ph = default_phantom() if which == "default" else _tilted_phantom()
    _, h, w = ph.shape_zyx
    angles = np.array([-60.0, -37.0, 0.0, 37.0, 60.0])
    proj = project(ph, angles, h, w).astype(np.float64)
    rng = np.random.default_rng(1)
    n_pix = 300
    ti = np.repeat(np.arange(len(angles)), n_pix)
    ii, jj = rng.integers(0, h, ti.size), rng.integers(0, w, ti.size)
    u, v = jj - (w - 1) / 2.0, ii - (h - 1) / 2.0
    num = _numeric_projection(ph, angles[ti], u, v)
    ana = proj[ti, ii, jj]
    assert np.count_nonzero(ana) > ti.size // 10         # the rays really hit the objects
    assert _rel_err(ana, num) < 1e-3
    assert np.max(np.abs(ana - num)) < 0.01 * np.abs(num).max()


def test_per_line_angles_match_numeric_and_per_tilt():
    ph = _tilted_phantom()
    _, h, w = ph.shape_zyx
    base = np.array([-50.0, -10.0, 25.0])
    per_line = base[:, None] + np.linspace(-3.0, 3.0, h)[None, :]             # (N, H), varies along rows
    proj = project(ph, per_line, h, w).astype(np.float64)
    assert proj.shape == (3, h, w)
    rng = np.random.default_rng(2)
    ti = np.repeat(np.arange(3), 300)
    ii, jj = rng.integers(0, h, ti.size), rng.integers(0, w, ti.size)
    num = _numeric_projection(ph, per_line[ti, ii], jj - (w - 1) / 2.0, ii - (h - 1) / 2.0)
    assert _rel_err(proj[ti, ii, jj], num) < 1e-3
    # constant rows reproduce the per-tilt projection exactly
    const = np.repeat(base[:, None], h, axis=1)
    np.testing.assert_allclose(project(ph, const, h, w), project(ph, base, h, w), rtol=0, atol=1e-6)
    with pytest.raises(PhantomError, match="n_tilts, H"):
        project(ph, np.zeros((3, h + 1)), h, w)


@pytest.mark.parametrize("width", [64, 65])
def test_off_axis_point_lands_at_imod_position(width):
    height = 48
    sphere = Phantom((32, height, width), [Ellipsoid((0.0, 0.0, 10.0), (2.0, 2.0, 2.0))])
    proj = project(sphere, np.array([-30.0, 0.0, 30.0]), height, width).astype(np.float64)
    u = np.arange(width) - (width - 1) / 2.0
    centroid_u = (proj.sum(axis=1) * u).sum(axis=1) / proj.sum(axis=(1, 2))
    np.testing.assert_allclose(centroid_u, [-5.0, 0.0, 5.0], atol=1e-6)    # +30 deg -> u = +5 (not -5)
    if width % 2 == 1:                                                     # a pixel centre sits at u = 5
        cols = proj.sum(axis=1).argmax(axis=1)
        assert cols.tolist() == [(width - 1) // 2 - 5, (width - 1) // 2, (width - 1) // 2 + 5]
    # a sphere at y = +7 peaks at row v = +7 at every tilt
    up = Phantom((32, height, width), [Ellipsoid((3.0, 7.0, -4.0), (2.0, 2.0, 2.0))])
    p = project(up, np.array([-45.0, 0.0, 45.0]), height, width)
    v = np.arange(height) - (height - 1) / 2.0
    centroid_v = (p.sum(axis=2) * v).sum(axis=1) / p.sum(axis=(1, 2))
    np.testing.assert_allclose(centroid_v, 7.0, atol=1e-5)


def test_rectangular_images_and_many_tilts():
    ph = default_phantom(width=80, height=48)
    assert ph.shape_zyx == (40, 48, 80)
    angles = np.linspace(-65.0, 65.0, 97)                                  # n_tilts > H
    proj = project(ph, angles, 48, 80)
    assert proj.shape == (97, 48, 80) and proj.dtype == np.float32
    gt = voxelize(ph)
    assert gt.shape == (40, 48, 80) and gt.dtype == np.float32
    # every object is inside the box: each view carries the full mass (up to pixel sampling)
    np.testing.assert_allclose(proj.sum(axis=(1, 2)), ph.mass, rtol=1e-2)
    # the projection of a rectangular phantom is not its transpose (no silent X/Y swap)
    p0 = project(ph, np.array([0.0]), 48, 80)[0]
    np.testing.assert_allclose(p0.sum(axis=0), gt.sum(axis=(0, 1)), rtol=0, atol=0.02 * p0.sum(axis=0).max())
    np.testing.assert_allclose(p0.sum(axis=1), gt.sum(axis=(0, 2)), rtol=0, atol=0.02 * p0.sum(axis=1).max())


def test_objects_must_lie_inside_the_box():
    with pytest.raises(PhantomError, match="inside the box|reaches"):
        Phantom((16, 32, 32), [Ellipsoid((0.0, 0.0, 6.0), (4.0, 4.0, 4.0))])    # z reaches 10 > 8
    with pytest.raises(PhantomError, match="reaches"):
        Phantom((32, 32, 32), [Ellipsoid((12.0, 0.0, 0.0), (12.0, 2.0, 2.0), (0.0, 0.0, 0.0))])
    with pytest.raises(PhantomError, match="proper rotation"):
        Ellipsoid((0, 0, 0), (1, 1, 1), np.diag([-1.0, 1.0, 1.0]))
    with pytest.raises(PhantomError, match="too small"):
        default_phantom(8, 8)
    for w, h, t in [(64, 64, None), (32, 24, None), (200, 120, 60), (64, 64, 48)]:
        ph = default_phantom(w, h, t)                                      # the constructor checks it
        half = np.array(ph.shape_zyx[::-1]) / 2.0
        for e in ph.ellipsoids:
            assert np.all(np.abs(e.center_xyz) + e.half_extent <= half - 0.5)
        assert voxelize(ph).min() >= 0.0                                   # the hole stays inside the body


def test_default_phantom_shape_and_content():
    ph = default_phantom()
    assert ph.shape_zyx == (32, 64, 64) and default_thickness(64) == 32 and default_thickness(100) == 50
    assert default_phantom() == ph                                         # deterministic
    others = [e for e in ph.ellipsoids if not e.name.startswith("helix")]
    beads = [e for e in ph.ellipsoids if e.name.startswith("helix")]
    assert 6 <= len(others) <= 10 and 5 <= len(beads) <= 8
    assert len({e.density for e in others}) >= 5
    for e in ph.ellipsoids:                                                # nothing thinner than ~3 voxels
        assert 2 * e.semi_axes.min() >= 3.0
    gt = voxelize(ph)
    assert gt.max() > 0.9 and len(np.unique(np.round(gt[gt > 0.05], 2))) > 5
    # at +-60 degrees every object stays on the detector (nothing reaches the image border)
    proj = project(ph, np.linspace(-60, 60, 61))
    assert not proj[:, :, :2].any() and not proj[:, :, -2:].any()
    assert not proj[:, :2, :].any() and not proj[:, -2:, :].any()
    np.testing.assert_allclose(proj.sum(axis=(1, 2)), ph.mass, rtol=1e-2)


def test_helix_is_right_handed_and_phantom_is_chiral():
    ph = default_phantom()
    mirror = ph.mirror()
    assert mirror != ph and mirror.mirror() == ph
    np.testing.assert_array_equal(voxelize(mirror.mirror()), voxelize(ph))

    def torsion_sign(p: Phantom) -> np.ndarray:
        c = np.array([e.center_xyz for e in p.ellipsoids if e.name.startswith("helix")])
        d = np.diff(c, axis=0)
        return np.sign(np.einsum("ij,ij->i", np.cross(d[:-2], d[1:-1]), d[2:]))

    assert np.all(torsion_sign(ph) > 0)                                    # right-handed
    assert np.all(torsion_sign(mirror) < 0)
    gt, gm = voxelize(ph), voxelize(mirror)
    np.testing.assert_array_equal(gm, gt[:, :, ::-1])                      # x -> -x on the voxel grid
    assert np.corrcoef(gt.ravel(), gm.ravel())[0, 1] < 0.8
    # the helix alone is chiral: no proper rotation of 180 degrees about x, y or z maps its mirror onto it
    helix = Phantom(ph.shape_zyx, [e for e in ph.ellipsoids if e.name.startswith("helix")])
    hc = np.mean([e.center_xyz for e in helix.ellipsoids], axis=0)
    centred = Phantom(ph.shape_zyx, [Ellipsoid(e.center_xyz - hc, e.semi_axes, None, e.density)
                                     for e in helix.ellipsoids])
    h, hm = voxelize(centred), voxelize(centred.mirror())
    for rotated in (hm[::-1, ::-1, :], hm[::-1, :, ::-1], hm[:, ::-1, ::-1]):   # 180 deg about x, y, z
        assert np.corrcoef(h.ravel(), rotated.ravel())[0, 1] < 0.6
    # projections see the handedness too: at +30 deg the mirror's projection is not the original's
    p, pm = project(ph, np.array([30.0])), project(mirror, np.array([30.0]))
    assert _rel_err(pm, p) > 0.3
    np.testing.assert_allclose(pm[0], project(ph, np.array([-30.0]))[0][:, ::-1], atol=1e-4)


def test_mass_conservation_at_zero_tilt():
    # The pixel sum of a projection is a midpoint-rule area integral of exact line integrals, so it
    # matches the mass up to a sampling error that shrinks as the objects grow in pixels.
    for ph in (default_phantom(), _tilted_phantom()):
        gt = voxelize(ph, supersample=4)
        p0 = project(ph, np.array([0.0]))[0].astype(np.float64)
        assert abs(gt.sum() - ph.mass) < 1e-3 * ph.mass
        assert abs(p0.sum() - gt.sum()) < 1e-2 * gt.sum()
    twice = default_phantom(128, 128)                                      # the same phantom at 2x size
    assert twice.mass == pytest.approx(8 * default_phantom().mass, rel=1e-12)
    p0 = project(twice, np.array([0.0]))[0].astype(np.float64)
    assert abs(p0.sum() - voxelize(twice).sum()) < 2e-3 * twice.mass


def test_voxelize_partial_volume_and_resampling():
    sphere = Phantom((16, 16, 16), [Ellipsoid((0.3, -0.2, 0.1), (4.0, 4.0, 4.0), None, 2.0)])
    exact = sphere.mass
    coarse = voxelize(sphere, supersample=1)
    fine = voxelize(sphere, supersample=4)
    assert abs(fine.sum() - exact) < abs(coarse.sum() - exact) + 1e-9 or abs(fine.sum() - exact) < 5e-3 * exact
    assert abs(fine.sum() - exact) < 1e-2 * exact
    assert len(np.unique(fine)) > 10                                       # partial-volume values on the edge
    # a finer grid of the same box: the voxel volume is (16/32)^3
    half_voxels = voxelize(sphere, (32, 32, 32), supersample=2)
    assert half_voxels.shape == (32, 32, 32)
    assert abs(half_voxels.sum() * 0.5 ** 3 - exact) < 1e-2 * exact
    # voxel centres follow the convention x = j - (X-1)/2: centroid of the voxelized sphere
    zz, yy, xx = np.meshgrid(*[np.arange(16) - 7.5] * 3, indexing="ij")
    cen = [(fine * a).sum() / fine.sum() for a in (xx, yy, zz)]
    np.testing.assert_allclose(cen, [0.3, -0.2, 0.1], atol=0.02)


def test_euler_rotation_is_proper_and_body_to_world():
    r = euler_zxz((30.0, 50.0, -20.0))
    np.testing.assert_allclose(r.T @ r, np.eye(3), atol=1e-12)
    assert np.linalg.det(r) == pytest.approx(1.0)
    # a 90-degree z rotation turns a rod along body x into a rod along world y
    rod = Ellipsoid((0, 0, 0), (6.0, 1.5, 1.5), (90.0, 0.0, 0.0))
    np.testing.assert_allclose(rod.half_extent, [1.5, 6.0, 1.5], atol=1e-9)


def test_projection_is_fast():
    ph = default_phantom()
    t0 = time.perf_counter()
    project(ph, np.linspace(-60, 60, 61), 64, 64)
    assert time.perf_counter() - t0 < 1.0
    big = default_phantom(200, 200)
    t0 = time.perf_counter()
    project(big, np.linspace(-60, 60, 61), 200, 200)
    assert time.perf_counter() - t0 < 5.0


def test_make_tiltseries_from_config():
    cfg = DataConfig(width=48, height=40, n_tilts=21, tilt_min=-50.0, tilt_max=50.0)
    ts = make_tiltseries(cfg)
    assert isinstance(ts, TiltSeries) and ts.source == "phantom"
    assert ts.stack.shape == (21, 40, 48) and ts.stack.dtype == np.float32
    np.testing.assert_allclose(ts.angles, np.linspace(-50, 50, 21))
    assert ts.pixel_size == 10.0
    assert ts.ground_truth.shape == (default_thickness(48), 40, 48)
    assert ts.metadata["thickness"] == 24 and ts.metadata["noise"] == 0.0
    assert ts.metadata["phantom"]["ellipsoids"]
    import json
    json.dumps(ts.metadata)                                                # serializable
    np.testing.assert_array_equal(ts.stack, project(default_phantom(48, 40), ts.angles, 40, 48))

    noisy = make_tiltseries(DataConfig(width=48, height=40, n_tilts=21, noise=0.1, phantom_seed=3,
                                       thickness=20, pixel_size=4.5))
    again = make_tiltseries(DataConfig(width=48, height=40, n_tilts=21, noise=0.1, phantom_seed=3,
                                       thickness=20, pixel_size=4.5))
    other = make_tiltseries(DataConfig(width=48, height=40, n_tilts=21, noise=0.1, phantom_seed=4,
                                       thickness=20, pixel_size=4.5))
    assert noisy.pixel_size == 4.5 and noisy.ground_truth.shape == (20, 40, 48)
    np.testing.assert_array_equal(noisy.stack, again.stack)                # seeded
    assert not np.array_equal(noisy.stack, other.stack)
    clean = project(default_phantom(48, 40, 20), noisy.angles, 40, 48)
    ratio = (noisy.stack - clean).std() / clean.std()
    assert 0.09 < ratio < 0.11


# ----------------------------------------------------------------------------------- chunked simulation (issue 26)
@pytest.mark.parametrize("posed", [False, True])
def test_projection_in_view_chunks_is_the_whole_projection_bit_for_bit(posed):
    from fasttomo.data.phantom import project, project_views, random_ellipsoids, random_pose_errors

    ph = random_ellipsoids((16, 24, 28), 5, seed=2)
    angles = np.linspace(-60, 60, 11)
    poses = random_pose_errors(angles, 2.0, 1.0, seed=3) if posed else None
    whole = project(ph, angles, 24, 28, poses=poses)
    for views in (1, 3, 4, 11):
        np.testing.assert_array_equal(project_views(ph, angles, (24, 28), poses, chunk_pixels=views * 24 * 28), whole)


def test_noise_added_in_view_chunks_is_the_whole_draw():
    from fasttomo.data.phantom import add_noise

    stack = np.random.default_rng(5).random((7, 6, 5), dtype=np.float32)
    expected = (stack + np.random.default_rng(9).normal(0.0, 0.3, size=stack.shape)).astype(np.float32)
    for views in (1, 2, 7):
        got = stack.copy()
        add_noise(got, 0.3, 9, chunk_pixels=views * 30)
        np.testing.assert_array_equal(got, expected)


def test_simulated_series_in_chunks_equals_the_one_shot_series(monkeypatch):
    """make_tiltseries with 2-view chunks gives today's stack (whole projection, one noise draw)."""
    import fasttomo.data.phantom as phantom_mod
    from fasttomo.config import PhantomDataConfig

    cfg = PhantomDataConfig(phantom="ellipsoids", width=20, height=18, thickness=12, n_tilts=9, noise=0.05,
                            noise_relative_to="max", phantom_seed=4)
    ph = phantom_mod.random_ellipsoids((12, 18, 20), 8, 4)
    clean = phantom_mod.project(ph, np.linspace(-60, 60, 9), 18, 20)
    rng = np.random.default_rng(4)
    expected = (clean + rng.normal(0.0, 0.05 * float(clean.max()), size=clean.shape)).astype(np.float32)
    monkeypatch.setattr(phantom_mod, "PROJECT_CHUNK_PIXELS", 2 * 18 * 20)
    np.testing.assert_array_equal(phantom_mod.make_tiltseries(cfg).stack, expected)
