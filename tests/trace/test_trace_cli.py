"""fasttomo-trace as a real process, and the nanoparticle phantom it is scored on."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttomo.config import ConfigError, DataConfig, ParticleConfig
from fasttomo.data.atoms import AtomPhantom, fcc_sphere, nanoparticle
from fasttomo.data.phantom import make_tiltseries
from fasttomo.trace.files import read_atoms_csv

SRC = str(Path(__file__).resolve().parents[2] / "src")


def trace_cli(args, cwd, module="fasttomo.cli.trace"):
    env = {**os.environ, "PYTHONPATH": SRC + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH")
                                              else ""), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def small_particle_cfg(**kw):
    return DataConfig(phantom="nanoparticle", width=32, height=32, n_tilts=9, tilt_min=-70, tilt_max=70,
                      particle=ParticleConfig(radius=6.0, species=2, **kw))


# --------------------------------------------------------------------------------------- phantom
def test_fcc_sphere_has_the_fcc_neighbour_shell():
    pts = fcc_sphere(9.0, 4.08)
    d = np.linalg.norm(pts[:, None] - pts[None], axis=-1)
    np.fill_diagonal(d, np.inf)
    assert np.allclose(d.min(axis=1)[np.linalg.norm(pts, axis=1) < 4], 4.08 / math.sqrt(2))
    centre = np.argmin(np.linalg.norm(pts, axis=1))
    assert int((np.abs(d[centre] - 4.08 / math.sqrt(2)) < 1e-6).sum()) == 12


def test_nanoparticle_projections_are_line_integrals_of_its_volume():
    ts = make_tiltseries(small_particle_cfg())
    assert ts.pixel_size == 0.75 and ts.ground_truth.shape == (32, 32, 32)
    i0 = int(np.argmin(np.abs(ts.angles)))
    # the 0-degree view is the sum of the truth along Z (the atoms are sampled finely enough that
    # the voxel sum equals the integral)
    assert abs(ts.angles[i0]) < 1e-9
    np.testing.assert_allclose(ts.stack[i0], ts.ground_truth.sum(axis=0), atol=2e-3 * float(ts.stack.max()))
    table = ts.metadata["true_atoms"]
    assert set(np.unique(table["species"])) == {1, 2}


def test_nanoparticle_handedness_matches_the_phantom_convention():
    # one atom at (x, y, z) = (0, 0, +10) voxels seen at +30 degrees lands at u = +5
    ph = AtomPhantom((32, 32, 32), np.array([[0.0, 0.0, 10.0]]), np.array([1]), np.array([1.0]), 1.0)
    img = ph.project(np.array([30.0]), 32, 32)[0]
    u = np.arange(32) - 15.5
    col = (img.sum(axis=0) * u).sum() / img.sum()
    assert col == pytest.approx(5.0, abs=1e-3)


def test_particle_too_big_for_the_box_is_refused():
    with pytest.raises(ValueError, match="data.particle.radius"):
        make_tiltseries(DataConfig(phantom="nanoparticle", width=16, height=16, particle=ParticleConfig(radius=12.0)))
    with pytest.raises(ConfigError, match="data.particle.species"):
        ParticleConfig(species=3)


def test_trace_of_the_phantom_truth_finds_every_atom_in_the_csv_frame(tmp_path):
    """fasttomo-simulate (the real command) writes <out>_atoms.csv beside the tilt series; its truth
    volume, traced by fasttomo-trace (the real command) with truth=, gives those atoms back."""
    from fasttomo.cli.simulate import simulate

    r = trace_cli(["out=np", "data.phantom=nanoparticle", "data.width=32", "data.height=32", "data.n_tilts=9",
                   "data.tilt_min=-70", "data.tilt_max=70", "data.particle.radius=6.0", "data.particle.species=2"],
                  tmp_path, module="fasttomo.cli.simulate")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("np.mrc", "np.rawtlt", "np_truth.mrc", "np_atoms.csv", "np_atoms.json"):
        assert (tmp_path / name).is_file(), name
    lines = (tmp_path / "np_atoms.csv").read_text().splitlines()
    assert lines[0] == "x_A,y_A,z_A,intensity,fit_error,species"          # plain CSV, header first
    meta = json.loads((tmp_path / "np_atoms.json").read_text())
    assert meta["made_by"] == "fasttomo-simulate" and meta["voxel_size_A"] == 0.75
    truth = read_atoms_csv(tmp_path / "np_atoms.csv")
    # the same atoms as the phantom the function builds, in atoms.csv's frame: a sphere of radius
    # 6 A around the centre of the 32^3 box of 0.75 A voxels, (31 / 2) x 0.75 = 11.625 A on each axis
    table = make_tiltseries(small_particle_cfg()).metadata["true_atoms"]
    np.testing.assert_allclose(truth["xyz_A"], table["xyz_A"], atol=1e-4)  # 4 decimals in the file
    assert truth["species"].tolist() == table["species"].tolist() and set(truth["species"].tolist()) == {1, 2}
    r_A = np.linalg.norm(truth["xyz_A"] - 11.625, axis=1)
    assert r_A.max() <= 6.0 and len(r_A) > 30
    r = trace_cli(["volume=np_truth.mrc", "truth=np_atoms.csv", "classes=2", "elements=[Pd,Pt]", "device=cpu",
                   "hydra.run.dir=run"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    # the closing summary, in fasttomo-reconstruct's style
    tail = r.stdout[r.stdout.index("finished."):]
    assert f"run folder: {tmp_path / 'run'}\n" in tail and "\n  atoms.csv " in tail and "\n  atoms.json " in tail
    assert f"{m['n_atoms']} atoms from " in tail and "quality: precision 1.0000, recall 1.0000" in tail
    assert f"look at it: {tmp_path / 'run' / 'slabs.png'}" in tail
    assert m["n_atoms"] == len(truth["species"])
    t = m["truth"]
    assert t["precision"] == 1.0 and t["recall"] == 1.0 and t["species_accuracy"] == 1.0
    assert t["rmsd_voxels"] < 0.05
    for name in ("atoms.csv", "atoms.json", "atoms.xyz", "slabs.png", "config.yaml", "trace.log", "manifest.json"):
        assert (tmp_path / "run" / name).is_file(), name
    # atoms.csv is plain CSV: the standard reader takes the header from the first line
    with open(tmp_path / "run" / "atoms.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["x_A", "y_A", "z_A", "intensity", "fit_error", "species"] and len(rows) == m["n_atoms"]
    assert sorted({int(r["species"]) for r in rows}) == [1, 2]
    np.testing.assert_allclose([[float(r[c]) for c in ("x_A", "y_A", "z_A")] for r in rows],
                               read_atoms_csv(tmp_path / "run" / "atoms.csv")["xyz_A"])
    atoms_meta = json.loads((tmp_path / "run" / "atoms.json").read_text())
    assert atoms_meta["voxel_size_A"] == 0.75 and atoms_meta["volume"] == "np_truth.mrc"
    # never silently overwritten: the same folder again is refused, with the fix in one line
    r2 = trace_cli(["volume=np_truth.mrc", "device=cpu", "hydra.run.dir=run"], tmp_path)
    assert r2.returncode == 2 and "output.overwrite=true" in r2.stdout + r2.stderr
    r3 = trace_cli(["volume=np_truth.mrc", "device=cpu", "hydra.run.dir=run", "output.overwrite=true"], tmp_path)
    assert r3.returncode == 0, r3.stdout + r3.stderr
    assert "truth" not in json.loads((tmp_path / "run" / "metrics.json").read_text())
    # simulate refuses to replace the coordinates file
    from fasttomo.data.io import OutputExistsError

    with pytest.raises(OutputExistsError, match="np_atoms.csv"):
        simulate(small_particle_cfg(), str(tmp_path / "np"), "mrc")


def test_cli_errors_are_one_line(tmp_path):
    r = trace_cli(["device=cpu"], tmp_path)
    assert r.returncode == 2 and "volume: give the volume" in r.stdout + r.stderr
    r = trace_cli(["volume=missing.mrc", "device=cpu"], tmp_path)
    assert r.returncode == 2 and "file not found" in r.stdout + r.stderr
    r = trace_cli(["volume=x.mrc", "classes=2", "elements=[Pt]"], tmp_path)
    assert r.returncode == 2 and "elements" in r.stdout + r.stderr
    r = trace_cli(["volume=x.mrc", "treshold=0.3"], tmp_path)
    assert r.returncode == 2 and "treshold: no such key. Did you mean threshold?" in r.stderr
    r = trace_cli(["volume=x.mrc", "classes=two"], tmp_path)
    assert r.returncode == 2 and "classes: expected an integer, got 'two'" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "outputs").exists()  # no empty run folders left behind


def test_trace_help_is_fasttomos(tmp_path):
    """fasttomo-trace shares the front of the other commands: --help, --help KEY, --help GROUP."""
    r = trace_cli(["--help"], tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("fasttomo-trace: trace the atoms"), r.stdout + r.stderr
    assert "min_snr: float, default 4.5" in r.stdout and "kplanes_tilted" not in r.stdout
    r = trace_cli(["--help", "volume"], tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("volume: str or null, default null"), r.stdout + r.stderr
    assert "The volume to trace" in r.stdout and "Traceback" not in r.stderr
    r = trace_cli(["--help", "output"], tmp_path)
    assert r.returncode == 0 and "output.overwrite: bool, default false" in r.stdout
    r = trace_cli(["--help", "volum"], tmp_path)
    assert r.returncode == 2 and "did you mean volume?" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_trace_matches_cpu():
    from fasttomo.trace.core import TraceParams, trace_volume

    ph = nanoparticle((48, 48, 48), 0.75, ParticleConfig(radius=9.0, species=2), 0)
    vol = ph.volume()
    a = trace_volume(vol, 0.75, TraceParams(classes=2), device="cpu")
    b = trace_volume(vol, 0.75, TraceParams(classes=2), device="cuda")
    assert a.n == b.n == len(ph.xyz)
    np.testing.assert_allclose(a.zyx, b.zyx, atol=1e-3)
    assert (a.species == b.species).all()
