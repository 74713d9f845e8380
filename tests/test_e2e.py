"""End to end on the CPU: a tiny real reconstruction through the same code path as the CLI, its
outputs read back (MRC voxel size, HDF5 attributes, TensorBoard scalars and images), the CLI
itself (exit codes, clear errors, no overwriting, multirun) and fasttomo-simulate round trips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mrcfile
import numpy as np
import pytest
from PIL import Image

from cli_helpers import TINY as TINY_BASE, TINY_LOGGED, TINY_RUN, _env, cli
from fasttomo.cli.reconstruct import compose_config, run

TINY = [*TINY_BASE, *TINY_LOGGED]
TINY_FILE = [*TINY_RUN, *TINY_LOGGED]  # for data=mrc: without the phantom's size


def _cli(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """The CLI as a real process on this checkout's sources (cli_helpers: an absolute PYTHONPATH,
    so a relative PYTHONPATH=src of the test command does not fall back to an installed copy)."""
    return cli(args, cwd, timeout)


def test_loss_drops_and_metrics_written(tiny_run):
    out, cfg, metrics = tiny_run
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["steps"] == cfg.optim.steps == 40
    assert saved["loss"]["last"] < 0.5 * saved["loss"]["first"]
    for key in ("wall_seconds", "train_seconds", "steps_per_second", "pearson_global", "pearson_foreground"):
        assert np.isfinite(saved[key]), key
    assert saved["pearson_global"] > 0.3  # 40 steps on a tiny phantom: well above chance
    assert metrics["steps"] == 40


def test_volume_files_read_back(tiny_run):
    out, cfg, _ = tiny_run
    with mrcfile.open(out / "volume.mrc", permissive=False) as m:
        assert m.data.dtype == np.float32
        assert m.data.shape == (12, 20, 24)  # (Z, Y, X): Z = the phantom's default thickness (W/2)
        vs = m.voxel_size
        assert (float(vs.x), float(vs.y), float(vs.z)) == pytest.approx((10.0, 10.0, 10.0))
        labels = b" ".join(bytes(l) for l in m.header.label[: int(m.header.nlabl)])
        assert b"fasttomo" in labels
        mrc_data = np.array(m.data)
    assert not (out / "volume.h5").exists()  # output.formats defaults to [mrc]; HDF5 on request
    assert mrc_data.shape == (12, 20, 24)


def test_slices_config_and_checkpoint(tiny_run):
    out, _, _ = tiny_run
    img = Image.open(out / "slices.png")
    assert img.size[0] > 24 and img.size[1] >= 20
    assert (out / "config.yaml").read_text().count("steps: 40") == 1
    assert (out / "checkpoints" / "last.pt").stat().st_size > 1000
    log_text = (out / "reconstruct.log").read_text()
    assert "finished." in log_text and f"run folder: {out}" in log_text and "done in" not in log_text


def test_tensorboard_events_read_back(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = tiny_run
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("loss/train", "loss/val", "lr/grids", "lr/decoder", "time/step_ms"):
        assert tag in tags["scalars"], tag
    train = acc.Scalars("loss/train")
    assert [e.step for e in train] == [10, 20, 30, 40]
    assert train[-1].value < train[0].value
    for tag in ("slices/xy", "slices/xz", "slices/yz"):
        assert tag in tags["images"], tag
    xy = acc.Images("slices/xy")
    assert [e.step for e in xy] == [20, 40]
    assert (xy[-1].width, xy[-1].height) == (24, 20)


def test_existing_results_never_overwritten(tiny_run):
    out, _, _ = tiny_run
    before = (out / "metrics.json").read_bytes()
    from fasttomo.run.pipeline import OutputExistsError

    with pytest.raises(OutputExistsError, match="output.overwrite=true"):
        run(compose_config([*TINY, f"output.dir={out}"]))
    assert (out / "metrics.json").read_bytes() == before


def test_cli_runs_and_refuses_existing_folder(tmp_path):
    args = [*TINY, "optim.steps=6", "logging.tensorboard=false", f"hydra.run.dir={tmp_path / 'cli'}"]
    first = _cli(args, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "cli" / "volume.mrc").is_file()
    second = _cli(args, tmp_path)
    assert second.returncode == 2
    assert "already holds results" in second.stdout + second.stderr
    assert "Traceback" not in second.stdout + second.stderr


def test_cli_default_output_dir_is_dated_under_outputs(tmp_path):
    res = _cli([*TINY, "optim.steps=3", "logging.tensorboard=false"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = list((tmp_path / "outputs").glob("*/*/metrics.json"))
    assert len(runs) == 1
    day, time_ = runs[0].parent.parent.name, runs[0].parent.name
    assert len(day) == 10 and day[4] == "-" and len(time_) == 8


def test_cli_bad_input_gets_one_clear_line(tmp_path):
    res = _cli([*TINY, "sampler.batch_size=-5", f"hydra.run.dir={tmp_path / 'bad'}"], tmp_path)
    assert res.returncode == 2
    text = res.stdout + res.stderr
    assert "sampler.batch_size" in text and "Traceback" not in text
    res = _cli(["model=nosuch"], tmp_path)
    assert res.returncode != 0 and "nosuch" in res.stderr + res.stdout


def test_multirun_sweep(tmp_path):
    res = _cli(["-m", *TINY, "optim.steps=3,4", "logging.tensorboard=false",
                f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    steps = sorted(json.loads(p.read_text())["steps"] for p in (tmp_path / "sweep").glob("*/metrics.json"))
    assert steps == [3, 4]


def test_simulate_then_reconstruct_from_files(tmp_path):
    env = _env()
    sim = subprocess.run([sys.executable, "-m", "fasttomo.cli.simulate", f"out={tmp_path / 'ph'}", "format=mrc",
                          "data.width=24", "data.height=20", "data.n_tilts=15"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    for name in ("ph.mrc", "ph.rawtlt", "ph_truth.mrc"):
        assert (tmp_path / name).is_file(), name
    angles = np.loadtxt(tmp_path / "ph.rawtlt")
    assert angles.shape == (15,) and angles[0] == pytest.approx(-60.0)
    again = subprocess.run([sys.executable, "-m", "fasttomo.cli.simulate", f"out={tmp_path / 'ph'}", "format=mrc",
                            "data.width=24", "data.height=20", "data.n_tilts=15"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "overwrite" in again.stdout + again.stderr
    out = tmp_path / "from_files"
    cfg = compose_config([*TINY_FILE, "data=mrc", f"data.path={tmp_path / 'ph.mrc'}",
                          f"data.angles={tmp_path / 'ph.rawtlt'}", "data.thickness=12", "data.normalize=none",
                          f"output.dir={out}"])
    metrics = run(cfg)
    assert metrics["pixel_size_A"] == pytest.approx(10.0)
    with mrcfile.open(out / "volume.mrc") as m:
        assert m.data.shape == (12, 20, 24)


def test_bf16_planes_run_trains_and_differs_from_fp32(tmp_path):
    """precision.planes=bf16: the run trains (the loss falls), says so in its log and config, and
    its volume is its own (the rounding reaches the fit), close to the fp32 planes' run."""
    import mrcfile
    import numpy as np

    vols = {}
    for planes in ("fp32", "bf16"):
        out = tmp_path / planes
        metrics = run(compose_config([*TINY, "optim.steps=30", "logging.tensorboard=false",
                                      f"precision.planes={planes}", f"output.dir={out}"]))
        assert metrics["loss"]["last"] < 0.7 * metrics["loss"]["first"]
        with mrcfile.open(out / "volume.mrc") as m:
            vols[planes] = np.asarray(m.data, dtype=np.float64)
    log_text = (tmp_path / "bf16" / "reconstruct.log").read_text()
    assert "samples the planes rounded to bf16" in log_text
    assert "planes: bf16" in (tmp_path / "bf16" / "config.yaml").read_text()
    a, b = vols["fp32"], vols["bf16"]
    assert not np.array_equal(a, b) and np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99


def test_overwrite_true_replaces_results(tmp_path):
    out = tmp_path / "again"
    base = [*TINY, "optim.steps=3", "logging.tensorboard=false", f"output.dir={out}"]
    run(compose_config(base))
    first_log = (out / "reconstruct.log").read_text()
    metrics = run(compose_config([*base, "optim.steps=4", "output.overwrite=true"]))
    assert metrics["steps"] == 4
    assert json.loads((out / "metrics.json").read_text())["steps"] == 4
    second_log = (out / "reconstruct.log").read_text()
    assert f"run folder: {out}" in second_log and second_log != first_log


def test_continuous_rotation_per_line_angles(tmp_path):
    """Continuous-rotation data: every image line has its own angle (a (n_tilts, H) table). The
    phantom is projected line by line with exact chords; the program's own projector (poses ->
    rays -> quadrature), fed the phantom's true density, reproduces those pixels with the per-line
    table and not with per-view angles; and the table read back from files reconstructs."""
    import torch

    from fasttomo.data.io import write_tiltseries
    from fasttomo.data.io.imod import write_tilt_file
    from fasttomo.data.load import load_tiltseries
    from fasttomo.data.phantom import default_phantom, project, voxelize
    from fasttomo.data.tiltseries import TiltSeries
    from fasttomo.geometry.poses import Poses
    from fasttomo.geometry.rays import Box
    from fasttomo.methods.field.projector import Projector

    n, h, w = 15, 20, 24
    base = np.linspace(-60.0, 60.0, n)
    per_line = base[:, None] + np.linspace(-10.0, 10.0, h)[None, :]  # the stage turns during the frame
    ph = default_phantom(w, h)
    stack = project(ph, per_line, h, w)
    truth = voxelize(ph)
    box = Box(truth.shape)
    half = torch.tensor([w / 2, h / 2, truth.shape[0] / 2], dtype=torch.float64)

    class TrueDensity(torch.nn.Module):
        def forward(self, p):  # normalized xyz -> the phantom's density
            return torch.from_numpy(ph.density((p.double() * half).numpy())).to(p.dtype)

    rng = np.random.default_rng(0)
    tilt, row, col = (torch.from_numpy(rng.integers(0, m, 400)) for m in (n, h, w))
    measured = torch.from_numpy(stack[tilt.numpy(), row.numpy(), col.numpy()]).double()
    errors = {}
    for name, angles in (("lines", per_line), ("views", base)):
        proj = Projector(TrueDensity(), Poses(angles, int(np.argmin(np.abs(base)))), box, (h, w), 4000)
        with torch.no_grad():
            pred = proj(tilt, row, col).double() * proj.length_unit
        errors[name] = float((pred - measured).norm() / measured.norm())
    assert errors["lines"] < 5e-3, errors
    assert errors["views"] > 10 * errors["lines"], errors

    write_tiltseries(tmp_path / "cr.mrc", TiltSeries(stack, base, pixel_size=10.0), "mrc")
    write_tilt_file(tmp_path / "cr.tlt", per_line)
    cfg = compose_config([*TINY_FILE, "data=mrc", f"data.path={tmp_path / 'cr.mrc'}", f"data.angles={tmp_path / 'cr.tlt'}",
                          f"data.thickness={truth.shape[0]}", "data.normalize=none", "optim.steps=150",
                          "logging.tensorboard=false", f"output.dir={tmp_path / 'run'}"])
    assert load_tiltseries(cfg.data).angles.shape == (n, h)
    run(cfg)
    from fasttomo.quality.metrics import pearson

    with mrcfile.open(tmp_path / "run" / "volume.mrc") as m:
        assert pearson(np.array(m.data), truth) > 0.8


def test_triton_backend_on_cpu_is_a_clear_config_error(tmp_path):
    from fasttomo.config import ConfigError

    with pytest.raises(ConfigError, match="kernels.backend=triton"):
        run(compose_config([*TINY, "kernels=triton", f"output.dir={tmp_path / 'k'}"]))


def test_shipped_sample_data_is_the_simulated_phantom():
    """data/phantom32.* is what fasttomo-simulate writes today (the README's recipe)."""
    from fasttomo.config import DataConfig
    from fasttomo.data.load import load_tiltseries
    from fasttomo.data.phantom import make_tiltseries

    repo = Path(__file__).resolve().parents[1]
    cfg = compose_config(["data=mrc", f"data.path={repo / 'data' / 'phantom32.mrc'}",
                          f"data.angles={repo / 'data' / 'phantom32.rawtlt'}", "data.normalize=none"])
    ts = load_tiltseries(cfg.data)
    ref = make_tiltseries(DataConfig(width=32, height=32, n_tilts=21))
    np.testing.assert_array_equal(ts.stack, ref.stack)
    np.testing.assert_allclose(ts.angles, ref.angles)
    assert ts.pixel_size == pytest.approx(10.0)
    with mrcfile.open(repo / "data" / "phantom32_truth.mrc") as m:
        np.testing.assert_array_equal(np.array(m.data), ref.ground_truth)
