"""Synthetic benchmark cases: posed analytic projections, random-ellipsoid specimens, noise relative
to the maximum, misaligned series whose true poses mean what fasttomo's learned poses mean."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from fasttomo.config import ConfigError, DataConfig
from fasttomo.data.phantom import (
    Ellipsoid,
    Phantom,
    PhantomError,
    default_phantom,
    make_tiltseries,
    project,
    random_ellipsoids,
    random_pose_errors,
)
from fasttomo.geometry.alignment import set_poses
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box, project_points
from fasttomo.methods.field.projector import Projector


def _zero_poses(n: int) -> dict:
    return {k: np.zeros(n) for k in ("z1_deg", "z3_deg", "shift_u_px", "shift_v_px")}


def _tilted_phantom() -> Phantom:
    return Phantom((24, 40, 56), [
        Ellipsoid((3.0, -2.0, 1.0), (14.0, 9.0, 6.0), (25.0, 40.0, -15.0), 0.5, "big"),
        Ellipsoid((-6.0, 5.0, -2.0), (5.0, 3.0, 4.0), (-60.0, 70.0, 10.0), 1.2, "tilted"),
        Ellipsoid((8.0, -4.0, 3.0), (3.0, 3.0, 3.0), None, -0.3, "hole"),
    ])


# --------------------------------------------------------------------------------------- posed projection
def test_zero_poses_match_the_fast_path():
    for ph in (default_phantom(), _tilted_phantom()):
        _, h, w = ph.shape_zyx
        angles = np.array([-60.0, -23.0, 0.0, 41.0, 60.0])
        fast = project(ph, angles, h, w)
        posed = project(ph, angles, h, w, poses=_zero_poses(5))
        np.testing.assert_allclose(posed, fast, rtol=0, atol=1e-5 * float(fast.max()))
    per_line = angles[:, None] + np.linspace(-4.0, 4.0, h)[None, :]
    np.testing.assert_allclose(project(ph, per_line, h, w, poses={"z3_deg": np.zeros(5)}),
                               project(ph, per_line, h, w), rtol=0, atol=1e-5 * float(fast.max()))


def test_integer_shift_is_exactly_the_shifted_image():
    """(su, sv) = (2, -3): pixel (i, j) shows what the unposed view shows at (i + 3, j - 2). A wider
    and taller unposed image has its pixel centres on the same u, v values, so the crop is exact."""
    ph = _tilted_phantom()
    _, h, w = ph.shape_zyx
    angles = np.array([-50.0, 0.0, 35.0])
    su, sv, k = 2, -3, 4
    shifted = project(ph, angles, h, w, poses={"shift_u_px": [su] * 3, "shift_v_px": [sv] * 3})
    wide = project(ph, angles, h + 2 * k, w + 2 * k, poses=_zero_poses(3))   # pixel (i+k, j+k) = (u, v) of (i, j)
    np.testing.assert_array_equal(shifted, wide[:, k - sv:k - sv + h, k - su:k - su + w])
    fast = project(ph, angles, h + 2 * k, w + 2 * k)
    np.testing.assert_allclose(shifted, fast[:, k - sv:k - sv + h, k - su:k - su + w], rtol=0, atol=1e-5)
    # (sub-pixel shifts: test_posed_point_lands_where_the_pose_model_says)


@pytest.mark.parametrize("width", [64, 65])
def test_posed_point_lands_where_the_pose_model_says(width):
    """A small sphere's image centroid is fasttomo's own projection (geometry.rays.project_points
    with the torch Poses module) of its centre, for z1, z3 and shifts; (0, 0, +10) at +30 degrees
    still lands at u = +5 with zero poses."""
    h = 48
    angles = np.array([-55.0, -30.0, 0.0, 30.0, 48.0])
    ref = int(np.argmin(np.abs(angles)))
    u = np.arange(width) - (width - 1) / 2.0
    v = np.arange(h) - (h - 1) / 2.0

    def centroids(img: np.ndarray) -> np.ndarray:
        m = img.sum(axis=(1, 2))
        return np.stack(((img.sum(axis=1) * u).sum(1) / m, (img.sum(axis=2) * v).sum(1) / m), -1)

    on_axis = Phantom((32, h, width), [Ellipsoid((0.0, 0.0, 10.0), (2.0, 2.0, 2.0))])
    c0 = centroids(project(on_axis, angles, h, width, poses=_zero_poses(5)).astype(np.float64))
    np.testing.assert_allclose(c0[:, 0], 10 * np.sin(np.deg2rad(angles)), atol=0.1)    # pixel sampling
    np.testing.assert_allclose(c0[1:4, 0], [-5.0, 0.0, 5.0], atol=1e-6)                # symmetric: exact

    centre = np.array([9.0, -6.0, 7.0])
    sphere = Phantom((32, h, width), [Ellipsoid(centre, (2.5, 2.5, 2.5))])
    cases = {
        "z3 only": dict(z3_deg=[20.0, -35.0, 0.0, 15.0, 40.0]),
        "z1 only": dict(z1_deg=[25.0, -15.0, 0.0, 30.0, -20.0]),
        "all": dict(z1_deg=[5.0, -8.0, 0.0, 12.0, 3.0], z3_deg=[-10.0, 6.0, 0.0, 25.0, -4.0],
                    shift_u_px=[2.5, -1.25, 0.0, 3.0, -0.5], shift_v_px=[-2.0, 0.75, 0.0, 1.5, 2.25]),
    }
    for name, vals in cases.items():
        img = project(sphere, angles, h, width, poses=vals).astype(np.float64)
        poses = Poses(angles, ref)
        set_poses(poses, vals)
        rot, shift = poses(torch.arange(5))
        pu, pv = project_points(torch.tensor(centre, dtype=torch.float64).expand(5, 3), rot.double(), shift.double())
        expected = np.stack((pu.numpy(), pv.numpy()), -1)
        # a 5-voxel sphere sampled on pixels: its centroid is within ~0.07 px of the centre's image
        np.testing.assert_allclose(centroids(img), expected, atol=0.1, err_msg=name)
        unposed = centroids(project(sphere, angles, h, width).astype(np.float64))
        assert np.abs(expected - unposed).max() > 1.0, name                 # the poses really moved it


def test_posed_projection_of_128_cube_is_fast():
    ph = random_ellipsoids((128, 128, 128), 8, seed=0)
    angles = np.linspace(-70.0, 70.0, 61)
    poses = random_pose_errors(angles, 3.0, 1.0, seed=0)
    t0 = time.perf_counter()
    stack = project(ph, angles, 128, 128, poses=poses)
    assert time.perf_counter() - t0 < 3.0
    assert stack.shape == (61, 128, 128) and stack.dtype == np.float32 and stack.max() > 0


def test_bad_poses_are_named():
    ph = _tilted_phantom()
    with pytest.raises(PhantomError, match="shift_u_px"):
        project(ph, np.array([0.0, 10.0]), poses={"shift_u_px": [1.0]})
    with pytest.raises(PhantomError, match="none of the keys"):
        project(ph, np.array([0.0, 10.0]), poses={"shifts": [1.0, 2.0]})
    with pytest.raises(PhantomError, match="tilt_deg"):
        project(ph, np.array([0.0, 10.0]), poses={"z3_deg": [0.0, 1.0], "tilt_deg": [10.0, 0.0]})


# --------------------------------------------------------------------------------------- random specimen
def test_random_ellipsoids_deterministic_and_inside_the_box():
    shape = (128, 128, 128)
    a, b = random_ellipsoids(shape, 8, seed=5), random_ellipsoids(shape, 8, seed=5)
    assert a == b and len(a.ellipsoids) == 8
    assert random_ellipsoids(shape, 8, seed=6) != a
    assert random_ellipsoids(shape, 3, seed=5).ellipsoids == a.ellipsoids[:3]   # one stream per ellipsoid
    for seed in range(20):
        for ph in (random_ellipsoids(shape, 8, seed), random_ellipsoids((24, 40, 56), 8, seed)):
            half = np.array(ph.shape_zyx[::-1]) / 2.0
            side = min(ph.shape_zyx)
            for e in ph.ellipsoids:
                assert np.all(np.abs(e.center_xyz) + e.half_extent <= half - 2.0 + 1e-9)
                assert np.all((e.semi_axes >= 0.05 * side) & (e.semi_axes <= 0.2 * side))
                assert 0.2 <= e.density <= 1.0
                assert np.linalg.det(e.rotation) == pytest.approx(1.0)
    # orientations are spread over SO(3): the body axes point every which way
    axes = np.array([e.rotation[:, 0] for s in range(20) for e in random_ellipsoids(shape, 8, s).ellipsoids])
    assert np.abs(axes.mean(axis=0)).max() < 0.15 and np.abs(axes).mean(axis=0).min() > 0.35
    with pytest.raises(PhantomError, match="does not fit"):
        random_ellipsoids((4, 64, 64), 8, seed=0, axis_range=(0.4, 0.45))
    with pytest.raises(PhantomError, match="seed"):
        random_ellipsoids(shape, 8, seed=-1)


# --------------------------------------------------------------------------------------- tilt series
def _cfg(**kw) -> DataConfig:
    base = dict(phantom="ellipsoids", width=32, height=24, n_tilts=9, tilt_min=-60.0, tilt_max=60.0)
    return DataConfig(**{**base, **kw})


def test_noise_relative_to_max_has_the_right_std():
    clean = make_tiltseries(_cfg())
    noisy = make_tiltseries(_cfg(noise=0.1, noise_relative_to="max"))
    by_std = make_tiltseries(_cfg(noise=0.1))
    np.testing.assert_array_equal(noisy.ground_truth, clean.ground_truth)      # same specimen
    assert noisy.metadata["noise_std"] == pytest.approx(0.1 * float(clean.stack.max()))
    assert (noisy.stack - clean.stack).std() / clean.stack.max() == pytest.approx(0.1, rel=0.03)
    assert (by_std.stack - clean.stack).std() / clean.stack.std() == pytest.approx(0.1, rel=0.03)
    assert noisy.metadata["noise_relative_to"] == "max" and noisy.metadata["clean_projection_max"] > 0


def test_misaligned_series_keeps_its_true_poses():
    cfg = _cfg(pose_error_shift=3.0, pose_error_rotation=1.0, n_tilts=61, tilt_min=-70.0, tilt_max=70.0)
    ts = make_tiltseries(cfg)
    tp = ts.metadata["true_poses"]
    json.dumps(ts.metadata)
    ref = ts.reference_index()
    assert tp["reference_index"] == ref == 30
    np.testing.assert_allclose(tp["tilt_deg"], ts.angles)
    for key, bound in (("shift_u_px", 3.0), ("shift_v_px", 3.0), ("z3_deg", 1.0)):
        a = np.asarray(tp[key])
        assert a.shape == (61,) and a[ref] == 0.0 and np.abs(a).max() <= bound
        assert np.abs(a).max() > 0.8 * bound and abs(a.mean()) < 0.3 * bound   # spread over +-bound
    assert tp["z1_deg"] == [0.0] * 61
    np.testing.assert_array_equal(ts.stack, project(random_ellipsoids((32, 24, 32), 8, 0), ts.angles, 24, 32,
                                                    poses=tp))
    aligned = make_tiltseries(_cfg(n_tilts=61, tilt_min=-70.0, tilt_max=70.0))
    assert "true_poses" not in aligned.metadata
    np.testing.assert_array_equal(aligned.ground_truth, ts.ground_truth)        # poses move views, not the specimen
    np.testing.assert_array_equal(aligned.stack[ref], ts.stack[ref])            # the reference view is untouched
    # the pose draws do not depend on the magnitudes (unit draws scaled)
    only_shift = make_tiltseries(_cfg(pose_error_shift=1.5, n_tilts=61, tilt_min=-70.0, tilt_max=70.0))
    np.testing.assert_allclose(only_shift.metadata["true_poses"]["shift_u_px"], np.asarray(tp["shift_u_px"]) / 2)
    assert make_tiltseries(_cfg(thickness=20)).ground_truth.shape == (20, 24, 32)


@pytest.mark.parametrize("kind,shift,rotation,axis", [("benchmark-like", 3.0, 1.0, 0.0), ("rotations only", 0.0, 10.0, 0.0),
                                                     ("tilt-axis error", 1.0, 1.0, 4.0)])
def test_misaligned_data_match_the_projector_with_the_true_poses(kind, shift, rotation, axis):
    """The projector of fasttomo (Poses -> rays -> quadrature), fed the specimen's exact density
    and the true poses loaded into Poses, reproduces the misaligned pixels; without them, or with
    the opposite poses, it does not. This is what makes the truth comparable with learned poses.
    A tilt-axis error turns the reference view too: its z3 loads as the common rotation."""
    ts = make_tiltseries(_cfg(pose_error_shift=shift, pose_error_rotation=rotation, n_tilts=11, tilt_axis_error=axis))
    n, h, w = ts.stack.shape
    ph = random_ellipsoids(ts.ground_truth.shape, 8, 0)
    half = torch.tensor([w / 2, h / 2, ts.ground_truth.shape[0] / 2], dtype=torch.float64)

    class TrueDensity(torch.nn.Module):
        def forward(self, p):
            return torch.from_numpy(ph.density((p.double() * half).numpy())).to(p.dtype)

    rng = np.random.default_rng(0)
    tilt, row, col = (torch.from_numpy(rng.integers(0, m, 160)) for m in (n, h, w))
    measured = torch.from_numpy(ts.stack[tilt.numpy(), row.numpy(), col.numpy()]).double()
    true = ts.metadata["true_poses"]
    opposite = {k: [-x for x in true[k]] for k in ("z3_deg", "shift_u_px", "shift_v_px")}
    errors = {}
    ref = ts.reference_index()
    assert true["z3_deg"][ref] == axis and ts.metadata["tilt_axis_error_deg"] == axis
    for name, vals in (("true", true), ("none", None), ("opposite", opposite)):
        poses = Poses(ts.angles, ref)
        if vals is not None:
            set_poses(poses, vals)
        proj = Projector(TrueDensity(), poses, Box(ts.ground_truth.shape), (h, w), 1200)
        with torch.no_grad():
            pred = proj(tilt, row, col).double() * proj.length_unit
        errors[name] = float((pred - measured).norm() / measured.norm())
    assert errors["true"] < 5e-3, errors
    assert errors["none"] > 10 * errors["true"] and errors["opposite"] > 10 * errors["true"], errors


def test_new_config_fields_validate():
    d = DataConfig()
    assert (d.phantom, d.n_ellipsoids, d.noise_relative_to, d.pose_error_shift, d.pose_error_rotation) == (
        "default", 8, "std", 0.0, 0.0)
    for kw, field in ((dict(phantom="spheres"), "data.phantom"), (dict(n_ellipsoids=0), "data.n_ellipsoids"),
                      (dict(noise_relative_to="mean"), "data.noise_relative_to"),
                      (dict(pose_error_shift=-1.0), "data.pose_error_shift"),
                      (dict(pose_error_rotation=60.0), "data.pose_error_rotation"),
                      (dict(tilt_axis_error=50.0), "data.tilt_axis_error"),
                      (dict(tilt_axis_error=float("nan")), "data.tilt_axis_error"),
                      (dict(phantom_seed=-2), "data.phantom_seed")):
        with pytest.raises(ConfigError, match=field):
            DataConfig(**kw)
