"""fasttomo-simulate and fasttomo-reconstruct with the cell and catalyst specimens: files a user can
read back (Poisson counts at a dose), and one clear line with exit code 2 for a box too small."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from cli_helpers import _env, cli
from fasttomo.config import DataConfig
from fasttomo.cli.simulate import simulate
from fasttomo.data.io.mrc import read_mrc


def test_simulate_writes_a_catalyst_at_a_dose(tmp_path):
    cfg = DataConfig(phantom="catalyst", width=48, height=48, n_tilts=5, dose=30.0, invert=False)
    simulate(cfg, str(tmp_path / "cat"), "mrc")
    stack = np.asarray(read_mrc(str(tmp_path / "cat.mrc")).data, dtype=np.float64)
    truth = read_mrc(str(tmp_path / "cat_truth.mrc"))
    assert stack.shape == (5, 48, 48) and np.asarray(truth.data).shape == (48, 48, 48)
    np.testing.assert_array_equal(stack, np.round(stack))                    # whole electrons (gain 1, offset 0)
    assert 25.0 < float(np.median(stack)) < 35.0                             # mostly vacuum: about the dose
    assert np.allclose(truth.voxel_size, 2.5)                                # the catalyst's pixel size


def test_a_box_too_small_is_one_line_and_exit_code_2(tmp_path):
    small = ["data.phantom=cell", "data.width=32", "data.height=32", "data.thickness=16"]
    sim = subprocess.run([sys.executable, "-m", "fasttomo.cli.simulate", "out=x", *small], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=300)
    rec = cli([*small, "optim.steps=2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    for proc in (sim, rec):
        text = proc.stdout + proc.stderr
        assert proc.returncode == 2, text
        assert "data.pixel_size" in text and "Traceback" not in text
    assert not list(tmp_path.glob("x*"))                                     # nothing written
