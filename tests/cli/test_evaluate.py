"""fasttomo-evaluate on real files written by fasttomo's own writers: the command line (exit codes,
metrics.json numbers, plots, refusing an earlier result folder, a shape mismatch naming both
shapes) and the tilt-series mode through a stand-in forward projector."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fasttomo.config import ConfigError, DataConfig
from fasttomo.data.io.volume import read_volume, write_volume
from fasttomo.cli.evaluate import EvaluateConfig, EvaluateError, evaluate
from fasttomo.quality.metrics import pearson


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run the command in a fresh interpreter on the same fasttomo as this test (cwd may be anywhere)."""
    import fasttomo

    src = str(Path(fasttomo.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "fasttomo.cli.evaluate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _projector_available() -> bool:
    try:
        from fasttomo.methods.sirt.projectors import forward_project  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """fasttomo-simulate's phantom (stack, .rawtlt, truth MRC at 10 A) and a noisy 'reconstruction'."""
    from fasttomo.cli.simulate import simulate

    d = tmp_path_factory.mktemp("eval")
    simulate(DataConfig(width=24, height=20, n_tilts=9, tilt_min=-60.0, tilt_max=60.0), str(d / "ph"), "mrc")
    truth, vx, _ = read_volume(d / "ph_truth.mrc")
    recon = truth + 0.05 * np.random.default_rng(0).standard_normal(truth.shape).astype(np.float32)
    write_volume(d / "recon.mrc", recon, vx, label="test", attrs={}, fmt="mrc")
    return d, truth, recon


def standin_forward_project(volume, poses, box, image_hw, views=None, step=0.5):
    """Test double with the signature of fasttomo.methods.sirt.projectors.forward_project:
    voxel-driven, each voxel's density split linearly between the two columns nearest to
    u = x cos(theta) + z sin(theta) of its row v = y (README convention); the sums approximate
    the line integrals in voxel-length units."""
    z_n, y_n, x_n = volume.shape
    h, w = image_hw
    assert h == y_n and tuple(box.shape_zyx) == tuple(volume.shape)
    theta = poses.theta.double().cpu()
    zc = torch.arange(z_n, dtype=torch.float64) - (z_n - 1) / 2
    xc = torch.arange(x_n, dtype=torch.float64) - (x_n - 1) / 2
    flat = volume.permute(1, 0, 2).reshape(y_n, z_n * x_n).double().cpu()
    out = torch.zeros(theta.shape[0], h, w, dtype=torch.float64)
    for i, t in enumerate(theta):
        col = (xc[None, :] * torch.cos(t) + zc[:, None] * torch.sin(t)).reshape(-1) + (w - 1) / 2
        j0 = torch.floor(col)
        frac = col - j0
        for j, wt in ((j0, 1 - frac), (j0 + 1, frac)):
            ok = (j >= 0) & (j < w)
            out[i].index_add_(1, j[ok].long(), flat[:, ok] * wt[ok])
    return out.float()


def test_cli_scores_against_truth_and_refuses_an_earlier_result(files):
    d, truth, recon = files
    res = _cli(["volume=recon.mrc", "truth=ph_truth.mrc", "tilt_range=[-60,60]"], d)
    assert res.returncode == 0, res.stdout + res.stderr
    out = d / "recon_eval"                                     # <volume stem>_eval next to the volume
    m = json.loads((out / "metrics.json").read_text())
    t = m["truth"]
    assert m["voxel_size_A"] == pytest.approx(10.0) and "header" in m["voxel_size_source"]
    assert m["shape_zyx"] == list(truth.shape)
    assert t["pearson_global"] == pytest.approx(pearson(recon, truth), abs=1e-6)
    span = float(truth.max() - truth.min())
    assert t["data_range"] == pytest.approx(span) and t["data_range_source"] == "truth max - min"
    mse = float(np.mean((recon.astype(np.float64) - truth) ** 2))
    assert t["mse"] == pytest.approx(mse, rel=1e-5)
    assert t["psnr_dB"] == pytest.approx(10 * math.log10(span ** 2 / mse), rel=1e-5)
    f = t["fsc"]
    assert f["freq_inv_A"][-1] == pytest.approx(0.05)            # Nyquist of 10 A voxels
    assert len(f["fsc"]) == len(f["n_voxels"]) == max(truth.shape) // 2
    assert f["fsc"][0] > 0.9                                     # low frequencies survive the noise
    for region in ("fsc_measured", "fsc_wedge"):
        assert len(t[region]["fsc"]) == len(f["fsc"])
    assert np.sum(t["fsc_measured"]["n_voxels"]) + np.sum(t["fsc_wedge"]["n_voxels"]) == np.sum(f["n_voxels"])
    assert t["tilt_range_deg"] == [-60.0, 60.0]
    assert Image.open(out / "fsc.png").size[0] == 760
    assert "Pearson" in res.stdout and "FSC" in res.stdout
    before = (out / "metrics.json").read_bytes()
    again = _cli(["volume=recon.mrc", "truth=ph_truth.mrc"], d)
    assert again.returncode == 2
    text = again.stdout + again.stderr
    assert "already holds results" in text and "overwrite=true" in text and "Traceback" not in text
    assert (out / "metrics.json").read_bytes() == before


def test_cli_shape_mismatch_names_both_shapes(files, tmp_path):
    d, truth, _ = files
    write_volume(tmp_path / "small.mrc", truth[:, :, :22], 10.0, label="x", attrs={}, fmt="mrc")
    res = _cli([f"volume={tmp_path / 'small.mrc'}", f"truth={d / 'ph_truth.mrc'}"], tmp_path)
    assert res.returncode == 2
    text = res.stdout + res.stderr
    assert str(truth.shape) in text and str(truth[:, :, :22].shape) in text and "Traceback" not in text
    assert not (tmp_path / "small_eval" / "metrics.json").exists()


def test_identical_volume_override_voxel_size_and_overwrite(files, tmp_path):
    d, truth, _ = files
    out = tmp_path / "ev"
    m = evaluate(EvaluateConfig(volume=str(d / "ph_truth.mrc"), truth=str(d / "ph_truth.mrc"), voxel_size=5.0,
                                data_range=2.0, out=str(out)))
    t = m["truth"]
    assert m["voxel_size_source"] == "voxel_size=" and t["fsc"]["nyquist_A"] == pytest.approx(10.0)
    assert t["pearson_global"] == pytest.approx(1.0) and t["mse"] == 0.0 and t["psnr_dB"] == math.inf
    assert t["fsc"]["fsc05_status"] == "never" and "fsc_wedge" not in t
    saved = json.loads((out / "metrics.json").read_text())       # strict JSON: inf written as null
    assert saved["truth"]["psnr_dB"] is None and saved["truth"]["data_range_source"] == "data_range="
    with pytest.raises(EvaluateError, match="already holds results"):
        evaluate(EvaluateConfig(volume=str(d / "ph_truth.mrc"), truth=str(d / "ph_truth.mrc"), out=str(out)))
    evaluate(EvaluateConfig(volume=str(d / "ph_truth.mrc"), truth=str(d / "ph_truth.mrc"), out=str(out),
                            overwrite=True))
    assert json.loads((out / "metrics.json").read_text())["voxel_size_A"] == pytest.approx(10.0)


def test_a_reconstructions_metrics_json_is_never_replaced(files, tmp_path):
    d, _, _ = files
    run = tmp_path / "run"
    run.mkdir()
    mine = json.dumps({"status": "finished", "pearson_global": 0.99, "steps": 1500})  # a run's metrics.json
    (run / "metrics.json").write_text(mine)
    for overwrite in (False, True):
        with pytest.raises(EvaluateError, match=r"holds a metrics\.json that is not an evaluation's \(a "
                                                r"reconstruction's run folder\?\), which fasttomo-evaluate never "
                                                r"replaces; choose another folder with out=<folder>"):
            evaluate(EvaluateConfig(volume=str(d / "ph_truth.mrc"), truth=str(d / "ph_truth.mrc"), out=str(run),
                                    overwrite=overwrite))
    assert (run / "metrics.json").read_text() == mine and sorted(p.name for p in run.iterdir()) == ["metrics.json"]


def test_tiltseries_mode_with_a_standin_projector(files, tmp_path):
    d, _, _ = files
    out = tmp_path / "ts"
    cfg = EvaluateConfig(volume=str(d / "ph_truth.mrc"), truth=str(d / "ph_truth.mrc"), tiltseries=str(d / "ph.mrc"),
                         angles=str(d / "ph.rawtlt"), held_out_views=[1, 5], out=str(out), device="cpu")
    m = evaluate(cfg, projector=standin_forward_project)
    ts = m["tiltseries"]
    assert ts["n_views"] == 9 and ts["angles_deg"][0] == pytest.approx(-60.0) and ts["fit"] == "global"
    assert min(ts["pearson"]) > 0.95                     # the truth re-projected matches the measured views
    assert ts["scale"][0] == pytest.approx(1.0, abs=0.1)  # both are line integrals in voxel units
    assert ts["summary"]["n_views"] == 9 and 1 <= ts["summary"]["pearson_worst_view"] <= 9
    assert ts["held_out"]["n_views"] == 2 and ts["used"]["n_views"] == 7
    assert m["truth"]["tilt_range_deg"] == [-60.0, 60.0]   # taken from the tilt series' angles
    assert "angles of" in m["truth"]["tilt_range_source"]
    for name in ("metrics.json", "fsc.png", "views_pearson.png", "views_residual.png"):
        assert (out / name).is_file(), name
    # a mirrored volume (x -> -x) does not explain the views as well: the geometry is really used
    vol, vx, _ = read_volume(d / "ph_truth.mrc")
    write_volume(tmp_path / "mirror.mrc", vol[:, :, ::-1], vx, label="m", attrs={}, fmt="mrc")
    mm = evaluate(EvaluateConfig(volume=str(tmp_path / "mirror.mrc"), tiltseries=str(d / "ph.mrc"),
                                 angles=str(d / "ph.rawtlt"), out=str(tmp_path / "mi"), device="cpu"),
                  projector=standin_forward_project)
    assert mm["tiltseries"]["summary"]["pearson_mean"] < ts["summary"]["pearson_mean"] - 0.02


def test_tiltseries_shape_and_views_are_checked_before_writing(files, tmp_path):
    d, truth, _ = files
    write_volume(tmp_path / "cropped.mrc", truth[:, :, 1:], 10.0, label="c", attrs={}, fmt="mrc")
    with pytest.raises(EvaluateError, match=r"\(H, W\) = \(20, 24\).*\(Z, Y, X\) = \(\d+, 20, 23\)"):
        evaluate(EvaluateConfig(volume=str(tmp_path / "cropped.mrc"), truth=str(tmp_path / "cropped.mrc"),
                                tiltseries=str(d / "ph.mrc"), angles=str(d / "ph.rawtlt"), out=str(tmp_path / "o"),
                                device="cpu"),
                 projector=standin_forward_project)
    assert not (tmp_path / "o").exists()                      # refused before anything was written
    with pytest.raises(EvaluateError, match="only 9 views"):
        evaluate(EvaluateConfig(volume=str(d / "ph_truth.mrc"), tiltseries=str(d / "ph.mrc"),
                                angles=str(d / "ph.rawtlt"), held_out_views=[10], out=str(tmp_path / "o")),
                 projector=standin_forward_project)


@pytest.mark.parametrize("angles, message", [
    ("radians", r"these look like radians, but fasttomo reads degrees. Convert them to degrees \(x 57.2958\) where they "
                r"are stored, or give angles=<a file in degrees>\.$"),
    ("duplicate", r"duplicate tilt angles \(angle: 1-based views\) \{-30.0: \[3, 4\]\}; each view needs its own angle. "
                  r"Fix the angle file or drop the repeats\.$"),
    ("beyond 90", r"tilt angle 96 degrees for view 9 is not within \(-90, 90\).*Fix the angle file\.$"),
])
def test_the_tilt_series_angles_are_checked_as_reconstruct_checks_them(files, tmp_path, angles, message):
    """Scores on angles fasttomo-reconstruct would refuse (radians, a repeat, past 90 degrees) are
    refused too, with the fix for this command (it has no data.exclude_views to offer)."""
    d, _, _ = files
    values = np.linspace(-60.0, 60.0, 9)
    values = {"radians": np.deg2rad(values), "duplicate": np.where(np.arange(9) == 3, -30.0, values),
              "beyond 90": np.where(np.arange(9) == 8, 96.0, values)}[angles]
    (tmp_path / "a.rawtlt").write_text("\n".join(f"{v:.5f}" for v in values) + "\n")
    with pytest.raises(EvaluateError, match=message):
        evaluate(EvaluateConfig(volume=str(d / "ph_truth.mrc"), tiltseries=str(d / "ph.mrc"),
                                angles=str(tmp_path / "a.rawtlt"), out=str(tmp_path / "o")),
                 projector=standin_forward_project)
    assert not (tmp_path / "o").exists()


def test_cli_tiltseries_uses_the_conventional_projector(files, tmp_path):
    """With fasttomo.methods.sirt.projectors present the command projects and scores; without it,
    it says so in one line (exit 2) before computing or writing anything."""
    d, _, _ = files
    res = _cli([f"volume={d / 'ph_truth.mrc'}", f"tiltseries={d / 'ph.mrc'}", f"angles={d / 'ph.rawtlt'}",
                f"out={tmp_path / 'cli'}", "device=cpu"], tmp_path)
    text = res.stdout + res.stderr
    if _projector_available():
        assert res.returncode == 0, text
        m = json.loads((tmp_path / "cli" / "metrics.json").read_text())
        assert m["tiltseries"]["summary"]["pearson_mean"] > 0.9
    else:
        assert res.returncode == 2 and "fasttomo.methods.sirt.projectors" in text and "Traceback" not in text
        assert not (tmp_path / "cli" / "metrics.json").exists()


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="fit"):
        EvaluateConfig(volume="v.mrc", fit="affine")
    with pytest.raises(ConfigError, match="tilt_range"):
        EvaluateConfig(volume="v.mrc", tilt_range=[60, -60])
    with pytest.raises(ConfigError, match="held_out_views"):
        EvaluateConfig(volume="v.mrc", held_out_views=[0])
    with pytest.raises(ConfigError, match="nothing to score against"):
        evaluate(EvaluateConfig(volume="v.mrc"))
    with pytest.raises(ConfigError, match="volume"):
        evaluate(EvaluateConfig(truth="t.mrc"))


def test_the_loaders_warnings_name_this_commands_keys(tmp_path, caplog):
    """read_raw's warnings (a pixel size far out, few views) named fasttomo-reconstruct's
    data.pixel_size and data.exclude_views, which fasttomo-evaluate does not have."""
    import logging

    import mrcfile

    from fasttomo.cli.evaluate import read_tiltseries

    stack = tmp_path / "few.mrc"
    with mrcfile.new(str(stack)) as m:
        m.set_data(np.random.default_rng(0).random((4, 12, 16), dtype=np.float32))
        m.voxel_size = 1e7
    (tmp_path / "few.rawtlt").write_text("-45\n-15\n15\n45\n")
    caplog.set_level(logging.INFO, logger="fasttomo.data")
    read_tiltseries(str(stack), str(tmp_path / "few.rawtlt"))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("pixel size 1e+07 A (from the file header) is outside 0.01..1e+06 A, where tomograms' pixel sizes "
               "lie." in w for w in warned), warned
    assert any(w.endswith("only 4 views; a tomogram from so few is mostly streaks (a tilt series usually has 40 or "
                          "more). Check that the whole series was given.") for w in warned), warned
    assert not any("data." in w for w in warned), warned
    unset = tmp_path / "unset.mrc"  # no pixel size at all: the common case
    with mrcfile.new(str(unset)) as m:
        m.set_data(np.random.default_rng(1).random((4, 12, 16), dtype=np.float32))
    caplog.clear()
    read_tiltseries(str(unset), str(tmp_path / "few.rawtlt"))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.endswith("no pixel size in the file or config; assuming 1.0 A per pixel.") for w in warned), warned
    assert not any("data." in w for w in warned), warned
    assert not logging.getLogger("fasttomo.data").filters  # the words are this command's only while it reads
