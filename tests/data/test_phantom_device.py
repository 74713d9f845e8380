"""The ellipsoid specimens projected and voxelized with torch (on the GPU for camera-sized series)
give numpy's values bit for bit: the same float64 operations, one rounding each. Here torch runs
on the CPU, and on a GPU machine on CUDA too."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import fasttomo.data.ellipsoids as ellipsoids
from fasttomo.config import DataConfig
from fasttomo.data.phantom import make_tiltseries, project, random_ellipsoids, voxelize

ANGLES = np.linspace(-60.0, 60.0, 7)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def specimen():
    return random_ellipsoids((40, 48, 56), n=8, seed=3)


@pytest.mark.parametrize("device", DEVICES)
def test_projection_on_a_device_is_numpys_bit_for_bit(specimen, device):
    ref = project(specimen, ANGLES, 48, 56)
    assert ref.std() > 0.5  # the specimen is in the picture
    np.testing.assert_array_equal(project(specimen, ANGLES, 48, 56, device=device), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_posed_projection_on_a_device_is_numpys_bit_for_bit(specimen, device):
    poses = {"z1_deg": np.linspace(-1, 1, 7), "z3_deg": np.linspace(0.5, -0.5, 7),
             "shift_u_px": np.linspace(-2.3, 2, 7), "shift_v_px": np.linspace(1, -1.7, 7)}
    ref = project(specimen, ANGLES, 48, 56, poses=poses)
    assert not np.array_equal(ref, project(specimen, ANGLES, 48, 56))  # the poses move the views
    np.testing.assert_array_equal(project(specimen, ANGLES, 48, 56, poses=poses, device=device), ref)


@pytest.mark.parametrize("device", DEVICES)
def test_voxelization_in_slabs_on_a_device_is_numpys_bit_for_bit(specimen, device, monkeypatch):
    ref = voxelize(specimen, (20, 30, 56), supersample=3)
    assert 0 < (ref > 0).mean() < 1
    monkeypatch.setattr(ellipsoids, "VOXELIZE_SLAB_POINTS", 5000)  # many slabs per ellipsoid
    np.testing.assert_array_equal(voxelize(specimen, (20, 30, 56), supersample=3, device=device), ref)


def test_tiltseries_on_a_device_and_without_truth():
    cfg = DataConfig(phantom="ellipsoids", width=40, height=32, thickness=24, n_tilts=5, noise=0.05,
                     noise_relative_to="max", phantom_seed=2)
    ref = make_tiltseries(cfg)
    dev = make_tiltseries(cfg, device="cpu")
    np.testing.assert_array_equal(dev.stack, ref.stack)
    np.testing.assert_array_equal(dev.ground_truth, ref.ground_truth)
    bare = make_tiltseries(cfg, truth=False)
    assert bare.ground_truth is None
    np.testing.assert_array_equal(bare.stack, ref.stack)


def test_simulate_without_truth_and_device_errors(tmp_path):
    def sim(*args):
        return subprocess.run([sys.executable, "-m", "fasttomo.cli.simulate", "data.width=32", "data.n_tilts=5",
                               *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)

    res = sim("out=a", "truth=false", "device=cpu")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mrc", "a.rawtlt"]
    res = sim("out=b", "device=gpu")
    assert res.returncode == 2
    assert "device: must be auto, cpu, cuda or cuda:N, got 'gpu'" in res.stderr + res.stdout
    if not torch.cuda.is_available():
        res = sim("out=c", "device=cuda")
        assert res.returncode == 2
        assert "this machine has no CUDA GPU; use device=cpu" in res.stderr + res.stdout
    assert not list(tmp_path.glob("b*")) and not list(tmp_path.glob("c*"))
