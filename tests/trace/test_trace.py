"""Atom tracing (fasttomo.trace): peaks, the fit, merging, the coordinate frame through a real
MRC file, the writers read back, and the accuracy on volumes rendered from known coordinates."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fasttomo.trace.core import (TraceError, TraceParams, find_peaks, gaussian_smooth, kmeans_1d,
                                 trace_volume)
from fasttomo.trace.files import (CSV_HEADER, AtomsFileError, read_atoms_csv, read_xyz, write_atoms_csv,
                                  write_xyz)
from fasttomo.data.gauss import fit_gaussians, patch_index, render
from fasttomo.trace.neighbors import greedy_match, greedy_suppress, pairs_within
from fasttomo.trace.score import score_trace


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def jittered_atoms(shape, spacing, jitter, seed):
    """(N, 3) (z, y, x) positions on a grid of ``spacing`` voxels, each moved by up to +-jitter."""
    rng = np.random.default_rng(seed)
    axes = [np.arange(spacing / 2 + 2, s - spacing / 2 - 1, spacing) for s in shape]
    g = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    return g + rng.uniform(-jitter, jitter, g.shape)


def rendered(shape, zyx, amp, sigma=1.0):
    return render(shape, torch.from_numpy(zyx), torch.from_numpy(np.asarray(amp, dtype=np.float64)),
                  float(sigma)).float().numpy()


# --------------------------------------------------------------------------------------- peaks
def test_find_peaks_returns_the_local_maxima_above_the_threshold():
    vol = torch.zeros(20, 22, 24)
    for z, y, x, a in [(5, 6, 7, 1.0), (12, 15, 9, 0.8), (15, 4, 18, 0.1)]:
        vol[z, y, x] = a
    sm = gaussian_smooth(vol, 0.7)
    found = {tuple(p) for p in find_peaks(sm, 0.2 * float(sm.max())).tolist()}
    assert found == {(5, 6, 7), (12, 15, 9)}  # the weak one is below the threshold


def test_gaussian_smooth_keeps_mass_and_centre():
    vol = torch.zeros(15, 15, 15)
    vol[7, 7, 7] = 1.0
    sm = gaussian_smooth(vol, 1.0)
    assert float(sm.sum()) == pytest.approx(1.0, abs=1e-5)
    assert tuple(np.unravel_index(int(sm.argmax()), sm.shape)) == (7, 7, 7)


# --------------------------------------------------------------------------------------- fit
def test_batched_fit_recovers_subvoxel_centres_amplitude_and_width():
    rng = np.random.default_rng(3)
    n = 50
    centre = torch.tensor(rng.uniform(-0.5, 0.5, (n, 3)) + 10.0)
    amp = torch.tensor(rng.uniform(0.5, 2.0, n))
    sig = torch.tensor(rng.uniform(0.7, 1.5, n))
    flat, coords, inside = patch_index(torch.full((n, 3), 10.0, dtype=torch.float64), 2, (21, 21, 21))
    data = amp[:, None] * torch.exp(-0.5 * ((coords - centre[:, None]) ** 2).sum(-1) / sig[:, None] ** 2) + 0.05
    start = torch.cat([torch.full((n, 3), 10.0, dtype=torch.float64), torch.ones(n, 1, dtype=torch.float64),
                       torch.ones(n, 1, dtype=torch.float64), torch.zeros(n, 1, dtype=torch.float64)], -1)
    p, sse = fit_gaussians(data, coords, inside.double(), start, iterations=30)
    assert torch.allclose(p[:, :3], centre, atol=1e-4)
    assert torch.allclose(p[:, 3], amp, rtol=1e-3)
    assert torch.allclose(p[:, 4], sig, rtol=1e-3)
    assert torch.allclose(p[:, 5], torch.full((n,), 0.05, dtype=torch.float64), atol=1e-4)
    assert float(sse.max()) < 1e-8


# --------------------------------------------------------------------------------------- merging
def test_greedy_suppression_is_the_sequential_greedy_result():
    # A (strongest) - B close, B - C close, A - C far: A suppresses B, so C survives
    pts = torch.tensor([[0.0, 0, 0], [0, 0, 1.5], [0, 0, 3.0], [10, 10, 10]])
    score = torch.tensor([3.0, 2.0, 1.0, 0.5])
    assert greedy_suppress(pts, score, 2.0).tolist() == [True, False, True, True]
    # random cloud against a plain sequential loop
    rng = np.random.default_rng(0)
    pts = torch.tensor(rng.uniform(0, 20, (400, 3)))
    score = torch.tensor(rng.uniform(size=400))
    keep = greedy_suppress(pts, score, 2.5).tolist()
    ref = [False] * 400
    for i in np.argsort(-score.numpy(), kind="stable"):
        if not any(ref[j] and np.linalg.norm(pts[i] - pts[j]) < 2.5 for j in range(400)):
            ref[i] = True
    assert keep == ref


def test_pairs_within_finds_every_close_pair():
    rng = np.random.default_rng(1)
    a = torch.tensor(rng.uniform(0, 10, (300, 3)))
    b = torch.tensor(rng.uniform(0, 10, (200, 3)))
    i, j, d = pairs_within(a, b, 1.3)
    got = set(zip(i.tolist(), j.tolist()))
    dist = torch.cdist(a, b)
    want = set(map(tuple, torch.nonzero(dist < 1.3).tolist()))
    assert got == want


def test_duplicates_of_one_atom_are_merged():
    # an atom exactly between two voxels along x: two equal maxima (a plateau), one atom
    shape = (16, 16, 16)
    vol = rendered(shape, np.array([[8.0, 8.0, 7.5]]), [1.0])
    res = trace_volume(vol, 1.0, TraceParams(smooth=0.0))
    assert res.n == 1
    assert res.stats["n_candidates"] == 2 and res.stats["merged_duplicates"] == 1
    assert np.allclose(res.zyx[0], [8.0, 8.0, 7.5], atol=1e-3)


def test_greedy_match_pairs_closest_first():
    a = torch.tensor([[0.0, 0, 0], [0, 0, 0.9]])
    b = torch.tensor([[0.0, 0, 0.8], [0, 0, 5.0]])
    ia, ib, d = greedy_match(a, b, 1.0)
    assert ia.tolist() == [1] and ib.tolist() == [0]  # (a1, b0) 0.1 apart wins over (a0, b0) 0.8 apart


def test_kmeans_is_deterministic_and_ordered():
    rng = np.random.default_rng(2)
    x = torch.tensor(np.concatenate([rng.normal(10, 0.5, 100), rng.normal(3, 0.3, 80), rng.normal(6, 0.3, 50)]))
    lab, c = kmeans_1d(x, 3)
    lab2, _ = kmeans_1d(x, 3)
    assert torch.equal(lab, lab2)
    assert c.tolist() == sorted(c.tolist())
    assert (lab[:100] == 2).all() and (lab[100:180] == 0).all() and (lab[180:] == 1).all()


# --------------------------------------------------------------------------------------- accuracy
@pytest.fixture(scope="module")
def atoms64():
    """~800 atoms of width 1 voxel, 6 +- 1 voxels apart (at least 4 sigma, as in AET data: FCC
    metals have neighbours 2.9 A apart and atoms about 0.5 A wide), 40 % of them twice as dense."""
    shape = (56, 64, 72)
    zyx = jittered_atoms(shape, 6.0, 1.0, seed=4)
    amp = np.where(np.random.default_rng(5).uniform(size=len(zyx)) < 0.4, 2.0, 1.0)
    return shape, zyx, amp


def test_rendered_volume_is_traced_exactly(atoms64):
    shape, zyx, amp = atoms64
    vol = rendered(shape, zyx, amp)
    res = trace_volume(vol, 0.8, TraceParams(classes=2))
    truth_xyz = zyx[:, ::-1] * 0.8
    sc = score_trace(res.xyz_A, truth_xyz, voxel_size_A=0.8, traced_species=res.species,
                     true_species=np.where(amp > 1.5, 2, 1))
    assert len(zyx) > 500
    assert sc["precision"] == 1.0 and sc["recall"] == 1.0
    assert sc["rmsd_voxels"] <= 0.05
    assert sc["species_accuracy"] == 1.0


def test_rendered_volume_with_10_percent_noise(atoms64):
    shape, zyx, amp = atoms64
    vol = rendered(shape, zyx, amp)
    noise = np.random.default_rng(6).normal(0.0, 0.1 * float(vol.max()), vol.shape).astype(np.float32)
    res = trace_volume(vol + noise, 0.8, TraceParams(classes=2))
    # the noise level behind min_snr: fits of the noise maxima above the threshold must not lower it
    assert res.stats["noise_level"] == pytest.approx(0.1 * float(vol.max()), rel=0.03)
    sc = score_trace(res.xyz_A, zyx[:, ::-1] * 0.8, voxel_size_A=0.8, traced_species=res.species,
                     true_species=np.where(amp > 1.5, 2, 1))
    assert sc["precision"] >= 0.99 and sc["recall"] >= 0.99
    assert sc["rmsd_voxels"] <= 0.2
    assert sc["species_accuracy"] >= 0.99


def test_the_prefit_screen_drops_noise_maxima_and_no_atom(atoms64):
    """The screen before the fits: its noise bound lies just above the noise (here white, 10 %; the
    densely packed atoms widen the voxels' spread by 7 %), it removes most candidates (noise
    maxima), and the atoms traced are the ones traced without it."""
    from fasttomo.trace.core import prefit_noise_level

    shape, zyx, amp = atoms64
    vol = rendered(shape, zyx, amp)
    sd = 0.1 * float(vol.max())
    noisy = vol + np.random.default_rng(6).normal(0.0, sd, vol.shape).astype(np.float32)
    assert sd * 0.98 <= prefit_noise_level(torch.from_numpy(noisy)) <= sd * 1.15
    assert prefit_noise_level(torch.from_numpy(vol)) < 0.05 * sd            # a clean volume: far below
    screened = trace_volume(noisy, 0.8, TraceParams(classes=2))
    every = trace_volume(noisy, 0.8, TraceParams(classes=2, screen=0.0))
    assert screened.stats["screened_before_fit"] > 0.5 * screened.stats["n_candidates"]
    assert every.stats["screened_before_fit"] == 0
    assert screened.n == every.n
    np.testing.assert_allclose(screened.zyx, every.zyx, atol=0.02)


def test_refuses_bad_volumes():
    with pytest.raises(TraceError, match="NaN"):
        trace_volume(np.full((8, 8, 8), np.nan, dtype=np.float32), 1.0)
    with pytest.raises(TraceError, match="no positive voxels"):
        trace_volume(-np.ones((8, 8, 8), dtype=np.float32), 1.0)
    with pytest.raises(TraceError, match="3-D"):
        trace_volume(np.ones((8, 8), dtype=np.float32), 1.0)


# --------------------------------------------------------------------------------------- files
def test_atoms_csv_and_xyz_read_back(tmp_path):
    xyz = np.array([[1.25, 2.5, 3.75], [10.0, 0.0, 5.5]])
    paths = write_atoms_csv(tmp_path / "a.csv", xyz, [3.5, 7.0], [0.01, 0.02], [1, 2], meta={"what": "two atoms"})
    assert paths == [str(tmp_path / "a.csv"), str(tmp_path / "a.json")]
    text = (tmp_path / "a.csv").read_text().splitlines()
    assert text[0] == CSV_HEADER and len(text) == 3                        # plain CSV: the header comes first
    assert json.loads((tmp_path / "a.json").read_text())["what"] == "two atoms"
    back = read_atoms_csv(tmp_path / "a.csv")
    assert np.allclose(back["xyz_A"], xyz) and back["species"].tolist() == [1, 2]
    assert np.allclose(back["intensity"], [3.5, 7.0]) and np.allclose(back["fit_error"], [0.01, 0.02])
    from fasttomo.data.io import OutputExistsError

    with pytest.raises(OutputExistsError):
        write_atoms_csv(tmp_path / "a.csv", xyz, [3.5, 7.0], [0.01, 0.02], [1, 2])
    (tmp_path / "a.csv").unlink()                                          # only the description is in the way:
    with pytest.raises(OutputExistsError, match="a.json"):
        write_atoms_csv(tmp_path / "a.csv", xyz, [3.5, 7.0], [0.01, 0.02], [1, 2], meta={})
    assert not (tmp_path / "a.csv").exists()                               # refused before writing anything
    # a file of an older version starts with '#' comment lines: still read
    (tmp_path / "old.csv").write_text("# fasttomo trace of v.mrc; voxel 0.5 A\n" + CSV_HEADER + "\n1,2,3,4,0.1,2\n")
    old = read_atoms_csv(tmp_path / "old.csv")
    assert old["xyz_A"].tolist() == [[1.0, 2.0, 3.0]] and old["species"].tolist() == [2]
    write_xyz(tmp_path / "a.xyz", xyz, [1, 2], ["Pd", "Pt"], [3.5, 7.0], [0.01, 0.02], (20.0, 30.0, 40.0), 0.5)
    x = read_xyz(tmp_path / "a.xyz")
    assert x["symbols"] == ["Pd", "Pt"] and np.allclose(x["xyz_A"], xyz)
    assert x["info"]["Lattice"] == "20 0 0 0 30 0 0 0 40" and x["info"]["pbc"] == "F F F"
    assert x["properties"]["class"].tolist() == [1, 2]
    lines = (tmp_path / "a.xyz").read_text().splitlines()
    assert lines[0] == "2" and len(lines) == 4


def test_read_atoms_csv_errors_name_the_problem(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("x,y,z\n1,2,3\n")
    with pytest.raises(AtomsFileError, match="lacks"):
        read_atoms_csv(p)
    p.write_text(CSV_HEADER + "\n1,2,three,4,5,1\n")
    with pytest.raises(AtomsFileError, match="not a number"):
        read_atoms_csv(p)
    with pytest.raises(AtomsFileError, match="not found"):
        read_atoms_csv(tmp_path / "missing.csv")


# --------------------------------------------------------------------------------------- frame
def test_an_off_centre_atom_comes_back_at_its_position_in_angstrom(tmp_path):
    """Through a real MRC file: the atom at voxel coordinates (x, y, z) = (col 12.3, row 7.6,
    section 20.2) of a (Z, Y, X) = (32, 24, 40) volume of 0.5 A voxels is at (6.15, 3.8, 10.1) A."""
    from fasttomo.data.io.mrc import read_mrc
    from fasttomo.data.io.volume import write_volume
    from fasttomo.cli.trace import TraceConfig, TraceOutputConfig, run_trace

    vol = rendered((32, 24, 40), np.array([[20.2, 7.6, 12.3]]), [1.0], sigma=1.2)
    write_volume(tmp_path / "v.mrc", vol, 0.5, label="test", attrs={}, fmt="mrc")
    m = read_mrc(str(tmp_path / "v.mrc"))
    assert m.data.shape == (32, 24, 40)  # MRC nx = X = 40 columns, ny = Y = 24 rows, nz = Z = 32 sections
    cfg = TraceConfig(volume=str(tmp_path / "v.mrc"), device="cpu",
                      output=TraceOutputConfig(dir=str(tmp_path / "run")))
    metrics = run_trace(cfg)
    assert metrics["n_atoms"] == 1 and metrics["voxel_size_A"] == 0.5
    atoms = read_atoms_csv(tmp_path / "run" / "atoms.csv")
    assert np.allclose(atoms["xyz_A"][0], [6.15, 3.8, 10.1], atol=1e-3)
    x = read_xyz(tmp_path / "run" / "atoms.xyz")
    assert np.allclose(x["xyz_A"][0], [6.15, 3.8, 10.1], atol=1e-3) and x["symbols"] == ["X"]


def test_hdf5_volume_with_voxel_size_override(tmp_path):
    from fasttomo.data.io.volume import write_volume
    from fasttomo.cli.trace import TraceConfig, TraceOutputConfig, run_trace

    vol = rendered((20, 20, 20), np.array([[5.0, 9.5, 14.25]]), [2.0])
    write_volume(tmp_path / "v.h5", vol, 1.0, label="test", attrs={}, fmt="h5")
    cfg = TraceConfig(volume=str(tmp_path / "v.h5"), voxel_size=2.0, device="cpu",
                      output=TraceOutputConfig(dir=str(tmp_path / "run")))
    m = run_trace(cfg)
    assert m["voxel_size_source"] == "voxel_size="
    atoms = read_atoms_csv(tmp_path / "run" / "atoms.csv")
    assert np.allclose(atoms["xyz_A"][0], [28.5, 19.0, 10.0], atol=1e-3)


def test_config_errors_name_the_key():
    from fasttomo.config import ConfigError
    from fasttomo.cli.trace import TraceConfig

    with pytest.raises(ConfigError, match="elements"):
        TraceConfig(volume="v.mrc", classes=2, elements=["Pt"])
    with pytest.raises(ConfigError, match=r"elements: pd, Xx: not element symbols as the periodic table writes them .*"
                                          r"; write Pd for pd\.$"):  # atoms.xyz would carry them as given
        TraceConfig(volume="v.mrc", classes=2, elements=["pd", "Xx"])
    assert TraceConfig(volume="v.mrc", classes=2, elements=["Pd", "Pt"]).elements == ["Pd", "Pt"]
    with pytest.raises(ConfigError, match="threshold"):
        TraceConfig(volume="v.mrc", threshold=1.5)
    with pytest.raises(ConfigError, match="sigma_range"):
        TraceConfig(volume="v.mrc", sigma_range=[2.0, 1.0])
    with pytest.raises(ConfigError, match="min_separation"):
        TraceConfig(volume="v.mrc", min_separation=0)
