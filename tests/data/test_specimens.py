"""The cell and catalyst specimens: the features they promise, exact projections that agree with
fasttomo's own projector of the truth, seeds, and the errors of a box too small."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fasttomo.config import DataConfig
from fasttomo.data import specimens as S
from fasttomo.data.phantom import PhantomError, make_tiltseries
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box
from fasttomo.methods.sirt import forward_project

CELL_BOX, CATALYST_BOX = (56, 96, 96), (64, 96, 96)
ANGLES = np.array([-60.0, -25.0, 0.0, 35.0, 60.0])


@pytest.fixture(scope="module")
def cell():
    sp = S.cell(CELL_BOX, 10.0, 0)
    return sp, sp.volume()


@pytest.fixture(scope="module")
def catalyst():
    sp = S.catalyst(CATALYST_BOX, 2.5, 0)
    return sp, sp.volume()


def _named(sp, prefix: str) -> list:
    return [e for e in sp.phantom.ellipsoids if e.name.startswith(prefix)]


def _voxel(shape, xyz) -> tuple[int, int, int]:
    """Nearest voxel index (z, y, x) of the centred point (x, y, z)."""
    return tuple(int(round(float(xyz[2 - a]) + (shape[a] - 1) / 2.0)) for a in range(3))


def test_cell_holds_every_part(cell):
    sp, vol = cell
    p = sp.parts
    assert p["vesicles"] >= 1 and p["ribosomes"] >= 1 and p["gold_fiducials"] >= 1
    assert p["actin_subunits"] >= 1 and p["texture_blobs"] > 100
    assert all(150.0 <= r <= 300.0 for r in p["vesicle_radii_A"])
    # the filaments' subunits follow the F-actin helix: consecutive ones rise 27.5 A and turn -166.7 degrees
    c = S.CELL
    step = math.hypot(c["actin_rise"], 2.0 * c["actin_radius"] * math.sin(math.radians(c["actin_twist_deg"]) / 2.0))
    subs = {e.name: e.center_xyz for e in _named(sp, "filament ")}
    pairs = [(subs[n], subs[n.rsplit(" ", 1)[0] + f" {int(n.rsplit(' ', 1)[1]) + 1}"]) for n in subs
             if n.rsplit(" ", 1)[0] + f" {int(n.rsplit(' ', 1)[1]) + 1}" in subs]
    assert pairs and all(abs(np.linalg.norm(a - b) * 10.0 - step) < 1e-6 for a, b in pairs)
    assert vol.shape == CELL_BOX and vol.dtype == np.float32 and float(vol.min()) >= 0.0


def test_cell_bilayer_shows_two_leaflets_4nm_apart(cell):
    """A radial line profile through a vesicle wall: two density peaks, leaflet_spacing apart, with
    a clear dip between them (the truth volume, 10 A voxels)."""
    sp, vol = cell
    outer = _named(sp, "vesicle 0 outer leaflet")[0]
    c, r = outer.center_xyz, float(outer.semi_axes[0])
    k, i, _ = _voxel(vol.shape, c)
    radial = np.arange(vol.shape[2]) - (vol.shape[2] - 1) / 2.0 - c[0]      # distance from the centre along +x
    sel = (radial > r - 8.0) & (radial < r + 2.0)
    radial, profile = radial[sel], vol[k, i, sel]
    peaks = [q for q in range(1, len(profile) - 1) if profile[q] > profile[q - 1] and profile[q] >= profile[q + 1]]
    assert len(peaks) == 2, (radial, profile)
    sep = (radial[peaks[1]] - radial[peaks[0]]) * 10.0                       # Angstrom
    assert abs(sep - S.CELL["leaflet_spacing"]) <= 10.0
    dip = profile[peaks[0]:peaks[1] + 1].min()
    assert dip < 0.6 * min(profile[peaks[0]], profile[peaks[1]])


def test_cell_gold_is_the_densest_and_ribosomes_have_cores(cell):
    sp, vol = cell
    gold = _named(sp, "gold fiducial")
    assert gold and all(abs(2 * float(g.semi_axes[0]) * 10.0 - 100.0) < 1e-9 for g in gold)
    for g in gold:
        assert vol[_voxel(vol.shape, g.center_xyz)] >= S.CELL["gold_density"]
    assert float(vol.max()) < S.CELL["gold_density"] * 1.1
    large = _named(sp, "ribosome 0 large")[0]
    cores = _named(sp, "ribosome 0 RNA core")
    assert 3 <= len(cores) <= 6
    for core in cores:                                                   # inside the large subunit
        assert np.linalg.norm(core.center_xyz - large.center_xyz) + core.semi_axes[0] <= large.semi_axes[0] + 1e-9


def test_catalyst_particles_sit_on_a_porous_support(catalyst):
    sp, vol = catalyst
    p = sp.parts
    assert p["pores"] >= 1 and p["particles"] >= 3
    assert all(10.0 <= s <= 100.0 for s in p["particle_sizes_A"])
    poly = sp.polyhedra
    for c, h in zip(poly.centres, poly.offsets[:, 0]):
        assert vol[_voxel(vol.shape, c)] >= 0.9 * S.CATALYST["particle_density"]   # heavy at its centre
        # the Wulff shape: {100} faces 1.15 x as far as the {111} faces
    assert np.allclose(poly.offsets[:, 8:], S.CATALYST["h100_over_h111"] * poly.offsets[:, :1])
    pores = _named(sp, "pore")
    for e in pores:                                                      # a pore is a hole in the support
        assert vol[_voxel(vol.shape, e.center_xyz)] < 0.5 * S.CATALYST["support_density"]


@pytest.mark.parametrize("which", ["cell", "catalyst"])
def test_projections_match_fasttomos_projector_of_the_truth(which, request):
    sp, vol = request.getfixturevalue(which)
    shape = vol.shape
    proj = sp.project(ANGLES, shape[1], shape[2]).astype(np.float64)
    fp = forward_project(torch.from_numpy(vol), Poses(ANGLES, 2), Box(shape), (shape[1], shape[2]), step=0.25)
    fp = fp.numpy().astype(np.float64)
    # measured: 2.5 % (cell) and 4.5 % (catalyst: sharp heavy particles); trilinear voxels vs exact
    assert np.linalg.norm(fp - proj) / np.linalg.norm(proj) < 0.06
    assert np.corrcoef(fp.ravel(), proj.ravel())[0, 1] > 0.995


def test_polyhedron_chords_are_exact():
    """A lone truncated octahedron: the projected chord equals a fine numerical integration."""
    from fasttomo.data.specimen import euler_zxz, pose_rotations

    nrm, off = S.truncated_octahedron(6.0, 6.9, euler_zxz([20.0, 35.0, -10.0]))
    poly = S.Polyhedra(np.array([[1.5, -2.0, 0.5]]), nrm[None], off[None], np.array([math.sqrt(3) * 6.0]),
                       np.array([2.0]))
    r = pose_rotations(np.deg2rad(30.0), 0.0, 0.0)
    img = poly.project_view(r, np.zeros(2), 32, 32)
    t = np.linspace(-20, 20, 16001)
    dt = t[1] - t[0]
    for i, j in [(16, 16), (13, 17), (18, 12), (16, 20)]:
        u, v = j - 15.5, i - 15.5
        pts = (r.T @ np.stack([np.full_like(t, u), np.full_like(t, v), t]))   # (3, T) world points
        inside = np.all(nrm @ (pts - poly.centres[0][:, None]) <= off[:, None], axis=0)
        assert abs(img[i, j] - 2.0 * inside.sum() * dt) < 2.0 * 2 * dt


def test_zero_poses_equal_no_poses_and_shift_moves_the_image(catalyst):
    sp, vol = catalyst
    h, w = vol.shape[1:]
    zero = {"shift_u_px": [0.0] * 2, "shift_v_px": [0.0] * 2}
    a = sp.project(np.array([-30.0, 40.0]), h, w)
    np.testing.assert_array_equal(sp.project(np.array([-30.0, 40.0]), h, w, poses=zero), a)
    moved = sp.project(np.array([-30.0, 40.0]), h, w, poses={"shift_u_px": [3.0, 3.0], "shift_v_px": [0.0, 0.0]})
    np.testing.assert_allclose(moved[:, :, 3 + 10:-10], a[:, :, 10:-13], atol=1e-4 * float(a.max()))


def test_seeded_and_reproducible():
    a, b, c = (S.catalyst(CATALYST_BOX, 2.5, s) for s in (4, 4, 5))
    assert a.describe() == b.describe() and a.describe() != c.describe()
    np.testing.assert_array_equal(a.polyhedra.centres, b.polyhedra.centres)
    x, y = S.cell(CELL_BOX, 10.0, 4), S.cell(CELL_BOX, 10.0, 4)
    assert x.phantom == y.phantom and np.array_equal(x.blobs.xyz, y.blobs.xyz)


def test_a_box_too_small_names_the_fix():
    with pytest.raises(PhantomError, match="data.pixel_size"):
        S.cell((16, 32, 32), 10.0, 0)
    with pytest.raises(PhantomError, match="data.pixel_size"):
        S.catalyst((16, 16, 16), 1.0, 0)


def test_make_tiltseries_dispatches_with_pixel_size_defaults():
    ts = make_tiltseries(DataConfig(phantom="catalyst", width=64, height=64, thickness=48, n_tilts=5))
    assert ts.pixel_size == S.CATALYST_PIXEL_SIZE and ts.ground_truth.shape == (48, 64, 64)
    assert ts.metadata["phantom_kind"] == "catalyst" and ts.metadata["phantom"]["parts"]["particles"] >= 1
    assert ts.stack.shape == (5, 64, 64) and ts.stack.dtype == np.float32
    with pytest.raises(Exception, match="data.phantom"):
        DataConfig(phantom="tissue")
