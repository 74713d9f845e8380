"""Scoring inside a run: held-out views, half sets, a truth from a file, the quality curve,
keep-best, pose scoring, and the SIRT baseline through the CLI (tiny real runs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttomo.config import DataConfig
from fasttomo.data.phantom import make_tiltseries
from fasttomo.data.tiltseries import TiltSeriesError
from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.quality.scoring import attach_truth, split_holdout

TINY_RUN = ["experiment=quick", "logging=quiet", "runtime=cpu", "runtime.threads=1", "sampler.batch_size=256",
            "projector.samples_per_ray=16", "optim.steps=30", "logging.val_every=10"]
TINY = [*TINY_RUN, "data.width=16", "data.height=16", "data.n_tilts=9"]


def _run(tmp: Path, *extra: str) -> tuple[dict, Path]:
    out = tmp / "run"
    base = TINY_RUN if "data=mrc" in extra else TINY  # file data: without the phantom's size
    run(compose_config([*base, f"output.dir={out}", *extra]))
    return json.loads((out / "metrics.json").read_text()), out


def test_split_holdout_maps_file_view_numbers():
    ts = make_tiltseries(DataConfig(width=16, height=16, n_tilts=9))
    ts.metadata["view_numbers"] = [1, 2, 3, 5, 6, 7, 8, 9, 10]  # view 4 was excluded from the file
    train, hold = split_holdout(ts, [5, 10])
    assert hold.view_numbers == [5, 10] and list(hold.index) == [3, 8]
    assert train.n_tilts == 7 and train.metadata["view_numbers"] == [1, 2, 3, 6, 7, 8, 9]
    np.testing.assert_array_equal(hold.stack, ts.stack[[3, 8]])
    with pytest.raises(TiltSeriesError, match=r"\[4\] are not views of this series \(\[4\] was left out of the series "
                                              r"before training \(by data.exclude_views, or dropped as dark\)\)"):
        split_holdout(ts, [4])
    with pytest.raises(TiltSeriesError, match=r"\[12\] are not views of this series \(the series' views are 1..10"):
        split_holdout(ts, [12])
    assert split_holdout(ts, []) == (ts, None)


def test_truth_file_of_the_wrong_shape_is_refused(tmp_path):
    from fasttomo.data.io.volume import write_volume

    ts = make_tiltseries(DataConfig(width=16, height=16, n_tilts=9))
    path = tmp_path / "t.mrc"
    write_volume(path, np.zeros((8, 16, 12), np.float32), 10.0, label="t", attrs={}, fmt="mrc")
    with pytest.raises(TiltSeriesError, match=r"shape \(8, 16, 12\).*\(Z, Y, X\) = \(8, 16, 16\)"):
        attach_truth(ts, str(path), 8)


def test_a_float32_mrc_truth_is_mapped_and_others_are_read(tmp_path):
    """A float32 MRC truth becomes a read-only map of its file (pages read as scoring uses them);
    an int16 MRC, an XZY-oriented MRC and an HDF5 truth are read whole, with the same voxels."""
    import mrcfile

    from fasttomo.data.io.volume import write_volume

    ts = make_tiltseries(DataConfig(width=16, height=16, n_tilts=9))
    vol = np.random.default_rng(0).normal(size=(6, 16, 16)).astype(np.float32)
    paths = {"f32": tmp_path / "t.mrc", "h5": tmp_path / "t.h5", "xzy": tmp_path / "t_xzy.mrc"}
    write_volume(paths["f32"], vol, 10.0, label="t", attrs={}, fmt="mrc")
    write_volume(paths["h5"], vol, 10.0, label="t", attrs={}, fmt="h5")
    write_volume(paths["xzy"], vol, 10.0, label="t", attrs={}, fmt="mrc", imod_xzy=True)
    ints = np.round(vol * 100).astype(np.int16)
    with mrcfile.new(tmp_path / "i.mrc") as m:  # mode 1, as a microscope program may write it
        m.set_data(ints)
        m.voxel_size = 10.0
    for name, path in paths.items():
        attach_truth(ts, str(path), 6)
        assert isinstance(ts.ground_truth, np.memmap) == (name == "f32"), name
        np.testing.assert_array_equal(ts.ground_truth, vol)
    attach_truth(ts, str(paths["f32"]), 6)
    assert not ts.ground_truth.flags.writeable
    attach_truth(ts, str(tmp_path / "i.mrc"), 6)
    assert not isinstance(ts.ground_truth, np.memmap) and ts.ground_truth.dtype == np.float32
    np.testing.assert_array_equal(ts.ground_truth, ints.astype(np.float32))


def test_a_mapped_truth_scores_like_the_one_in_memory(tmp_path):
    """SIRT's quality curve and the final scores against a truth given as a file (mapped) are the
    ones against the same truth held in memory."""
    from fasttomo.data.io.volume import write_volume

    m0, _ = _run(tmp_path / "a", "model=sirt", "model.iterations=6", "evaluation.curve_every=3")
    truth = make_tiltseries(compose_config(TINY).data).ground_truth
    write_volume(tmp_path / "truth.mrc", truth, 1.0, label="t", attrs={}, fmt="mrc")
    m1, _ = _run(tmp_path / "b", "model=sirt", "model.iterations=6", "evaluation.curve_every=3",
                 f"evaluation.truth={tmp_path / 'truth.mrc'}", f"data.thickness={truth.shape[0]}")
    assert [c["pearson_global"] for c in m1["curve"]] == [c["pearson_global"] for c in m0["curve"]]
    for key in ("pearson_global", "pearson_foreground", "mse", "fsc", "fsc_measured", "fsc_wedge"):
        assert m1[key] == m0[key], key


def test_field_run_scores_holdout_half_sets_curve_and_keeps_the_best(tmp_path):
    m, out = _run(tmp_path, "evaluation.holdout_views=[3,7]", "evaluation.half_sets=true",
                  "evaluation.curve_every=10", "optim.keep_best=true")
    assert m["holdout"]["view_numbers"] == [3, 7] and len(m["holdout"]["pearson"]) == 2
    assert all(0.5 < r <= 1 for r in m["holdout"]["pearson"])  # the field predicts unseen views
    assert set(m["half_sets"]) >= {"fsc", "fsc_measured", "fsc_wedge"}
    assert [c["step"] for c in m["curve"]] == [10, 20, 30]
    assert all(c["fit_seconds"] <= m["train_seconds"] + 1e-9 for c in m["curve"])
    assert m["exported_step"] == m["best_val"]["step"]
    assert m["best_val"]["loss"] == min(v for _, v in m["val_loss"]["curve"])
    for name in ("fsc_halfsets.png", "fsc_truth.png", "loss.png"):
        assert (out / name).is_file(), name
    assert not list(out.glob("volume_*"))  # the halves are scored, not written (output.half_volumes writes them)
    assert m["fsc"]["fsc05_status"] == "crossed" and m["fsc05_A"] == m["fsc"]["fsc05_A"]
    assert {"fsc_measured", "fsc_wedge"} <= set(m)


def test_sirt_baseline_through_the_config(tmp_path):
    m, out = _run(tmp_path, "model=sirt", "model.iterations=20", "evaluation.curve_every=5",
                  "evaluation.holdout_views=[5]")
    curve = [c["pearson_global"] for c in m["curve"]]
    assert [c["step"] for c in m["curve"]] == [5, 10, 15, 20]
    assert curve[-1] > curve[0] and m["pearson_global"] == pytest.approx(curve[-1], abs=1e-4)
    assert m["model"] == "sirt" and m["steps"] == 20 and m["train_seconds"] > 0
    assert 0.5 < m["holdout"]["pearson"][0] <= 1
    assert (out / "volume.mrc").is_file() and not (out / "checkpoints").exists()


def test_learned_poses_are_scored_against_a_poses_file(tmp_path):
    from fasttomo.data.io import write_tiltseries
    from fasttomo.data.io.poses import write_poses_json

    ts = make_tiltseries(DataConfig(width=16, height=16, n_tilts=9, pose_error_shift=2.0, pose_error_rotation=0.5))
    write_tiltseries(tmp_path / "p.mrc", ts, "mrc")
    write_poses_json(tmp_path / "p_poses.json", ts.metadata["true_poses"])
    m, _ = _run(tmp_path, "data=mrc", f"data.path={tmp_path / 'p.mrc'}", f"data.angles={tmp_path / 'p.rawtlt'}",
                "data.thickness=8", "pose=refine", "pose.start_step=0",
                f"evaluation.true_poses={tmp_path / 'p_poses.json'}")
    pe = m["pose_errors"]
    assert pe["n_compared"] == 8 and pe["shift_rms_px"] > 0 and pe["rotation_rms_deg"] > 0


def test_sirt_dry_run_checks_and_writes_nothing(tmp_path):
    out = tmp_path / "dry"
    report = run(compose_config([*TINY, "model=sirt", "dry_run=true", f"output.dir={out}"]))
    assert report["model"] == "sirt" and report["box_zyx"] == [8, 16, 16] and report["memory_total_bytes"] > 0
    assert not out.exists()
    halves = run(compose_config([*TINY, "model=sirt", "dry_run=true", "evaluation.half_sets=true", f"output.dir={out}"]))
    vol = 4 * 8 * 16 * 16  # the odd half's fit beside the held even half: one volume more than the fit's three
    assert halves["memory_half_sets_bytes"]["the even half, held"] == vol
    assert halves["memory_total_bytes"] == max(report["memory_total_bytes"], sum(halves["memory_half_sets_bytes"].values()))
    assert not out.exists()


def test_view_residuals_point_at_the_view_that_jumped(tmp_path):
    """A series written to MRC with one view shifted by 4 px (a stage jump the poses are not asked
    to fix): after a short fit, that view is the worst explained one, and every view has a score."""
    from fasttomo.data.io import write_tiltseries

    ts = make_tiltseries(DataConfig(width=32, height=32, n_tilts=15, thickness=16, phantom_seed=3))
    bad = 6                                                   # 0-based; file view number 7
    ts.stack[bad] = np.roll(ts.stack[bad], 4, axis=1)
    stack = tmp_path / "jump.mrc"
    write_tiltseries(stack, ts, "mrc")
    m, _ = _run(tmp_path, "data=mrc", f"data.path={stack}", f"data.angles={stack.with_suffix('.rawtlt')}",
                "data.thickness=16", "optim.steps=150", "projector.samples_per_ray=24")
    vr = m["view_residuals"]
    assert vr["view_numbers"] == list(range(1, 16)) and len(vr["pearson"]) == len(vr["rms_residual"]) == 15
    assert vr["worst_views"][0] == bad + 1
    others = [r for i, r in enumerate(vr["pearson"]) if i != bad]
    assert vr["pearson"][bad] < min(others) - 0.05 and min(others) > 0.8


def test_view_residuals_can_be_turned_off(tmp_path):
    m, _ = _run(tmp_path, "evaluation.view_residuals=false")
    assert "view_residuals" not in m


@pytest.mark.parametrize("n, h, w, budget, expected", [
    (61, 64, 64, 1 << 16, 2),      # the embedded default: about 1,000 pixels per view
    (15, 32, 32, 1 << 16, 1),      # small series: every pixel
    (61, 4096, 4096, 1 << 16, 128),  # 125..127 still give 33 x 33 pixels per view: 66,429 > 65,536
    (3, 37, 23, 100, 6),           # odd sizes: stride 5 gives 3 x 8 x 5 = 120 pixels, 6 gives 3 x 7 x 4 = 84
])
def test_residual_stride_is_the_smallest_that_fits_the_budget(n, h, w, budget, expected):
    from fasttomo.quality.scoring import residual_stride

    s = residual_stride(n, h, w, budget)
    rays = lambda k: n * (-(-h // k)) * (-(-w // k))  # noqa: E731
    assert s == expected and rays(s) <= budget and (s == 1 or rays(s - 1) > budget)


def test_strided_render_is_the_full_render_subsampled():
    """The view residuals' pixel grid predicts exactly the pixels the full render gives there."""
    import torch

    from fasttomo.run.build import build
    from fasttomo.data.load import load_tiltseries
    from fasttomo.quality.scoring import render_views

    cfg = compose_config([*TINY, "data.width=21", "data.height=17", "output.dir=unused"])
    comps = build(cfg, load_tiltseries(cfg.data))
    torch.manual_seed(0)
    full = render_views(comps.projector, 9, 1000)
    for s in (2, 3):
        np.testing.assert_allclose(render_views(comps.projector, 9, 777, s), full[:, ::s, ::s], rtol=1e-5, atol=1e-6)


def test_held_out_views_are_predicted_with_the_learned_tilt_axis_rotation():
    """A tilt-axis error turns every view, the ones set aside too: predict_views applies the
    learned common rotation (and nothing else of the learned poses) to the held-out angles."""
    import torch

    from fasttomo.geometry.poses import Poses
    from fasttomo.geometry.rays import Box
    from fasttomo.methods.field.projector import Projector
    from fasttomo.methods.field.projector import predict_views

    class Blob(torch.nn.Module):          # an off-centre, elongated blob: a rotation shows
        def __init__(self, box):
            super().__init__()
            self.box = box
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, pts):
            p = self.box.denormalize(pts)
            return self.w * torch.exp(-((p[:, 0] - 3.0) ** 2 / 8.0 + (p[:, 1] + 1.0) ** 2 / 2.0 + p[:, 2] ** 2 / 4.0))

    box = Box((12, 16, 16))
    angles = np.array([-40.0, 0.0, 35.0])
    poses = Poses(angles, 1, learn_rotations=True, learn_z1=False, learn_tilt_axis=True)
    with torch.no_grad():
        poses.axis.fill_(np.deg2rad(4.0))
    src = Projector(Blob(box), poses, box, (16, 16), samples_per_ray=48)
    held = predict_views(src, angles)
    tilt = torch.arange(3).repeat_interleave(256)
    row = torch.arange(16).repeat_interleave(16).repeat(3)
    col = torch.arange(16).repeat(48)
    with torch.no_grad():
        same = src(tilt, row, col).reshape(3, 16, 16).numpy()
        poses.axis.zero_()
        unturned = src(tilt, row, col).reshape(3, 16, 16).numpy()
    np.testing.assert_allclose(held, same, atol=1e-6)
    assert np.abs(held - unturned).max() > 0.05 * np.abs(same).max()


def test_scores_of_a_volume_above_the_size_threshold_are_streamed_and_agree(monkeypatch):
    """Above WHOLE_VOLUME_MAX_VOXELS (lowered here to 1000) Pearson and MSE come from slab sums and
    the FSC from crops; on a volume the 256-voxel crop covers, the numbers are the whole-volume ones."""
    import fasttomo.quality.scoring as scoring

    rng = np.random.default_rng(1)
    truth = rng.normal(size=(12, 20, 24)).astype(np.float32) + 2.0
    vol = (truth + 0.5 * rng.normal(size=truth.shape)).astype(np.float32)
    whole, _ = scoring.score_against_truth(vol, truth, 2.0, tilt_range=(-60, 60))
    monkeypatch.setattr(scoring, "WHOLE_VOLUME_MAX_VOXELS", 1000)
    streamed, curves = scoring.score_against_truth(vol, truth, 2.0, tilt_range=(-60, 60))
    assert "fsc_crops" in streamed and "fsc_crops" not in whole and set(curves) == {"all", "measured", "wedge"}
    for key in ("pearson_global", "pearson_foreground", "foreground_fraction", "mse", "psnr_dB"):
        assert streamed[key] == pytest.approx(whole[key], rel=1e-9), key
    for region in ("fsc", "fsc_measured", "fsc_wedge"):
        assert streamed[region]["fsc"] == whole[region]["fsc"]


def test_moments_stream_before_the_fsc_does(monkeypatch):
    """Between STREAMED_MOMENTS_ABOVE and WHOLE_VOLUME_MAX_VOXELS (lowered here to 1000 and 10^6)
    Pearson and MSE come from slab sums, equal to numpy's to float64 rounding, and the FSC is
    still the whole-volume transform, bit for bit."""
    import fasttomo.quality.metrics as metrics
    import fasttomo.quality.scoring as scoring

    rng = np.random.default_rng(2)
    truth = rng.normal(size=(12, 20, 24)).astype(np.float32) + 2.0
    vol = (truth + 0.5 * rng.normal(size=truth.shape)).astype(np.float32)
    whole, _ = scoring.score_against_truth(vol, truth, 2.0, tilt_range=(-60, 60))
    calls = []
    real = metrics.streamed_volume_metrics
    monkeypatch.setattr(metrics, "streamed_volume_metrics", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(scoring, "STREAMED_MOMENTS_ABOVE", 1000)
    monkeypatch.setattr(scoring, "WHOLE_VOLUME_MAX_VOXELS", 10 ** 6)
    mixed, _ = scoring.score_against_truth(vol, truth, 2.0, tilt_range=(-60, 60))
    assert calls == [1] and "fsc_crops" not in mixed
    for key in ("pearson_global", "pearson_foreground", "foreground_fraction", "mse", "psnr_dB", "data_range"):
        assert mixed[key] == pytest.approx(whole[key], rel=1e-9), key
    for region in ("fsc", "fsc_measured", "fsc_wedge"):
        assert mixed[region] == whole[region]


@pytest.mark.parametrize("headroom, given", [(2.0, False), (2.0, True), (1e12, False)])
def test_a_large_pair_scored_from_the_scoring_device_agrees_with_the_host(monkeypatch, headroom, given):
    """Above WHOLE_VOLUME_MAX_VOXELS the pair is copied to the scoring device once when it has room
    (here the CPU stands in for the GPU; a headroom of 1e12 leaves it on the host), or only the
    truth when the volume is given there already (the export's copy), and the moments and the FSC
    crops read it there: the scores of the host's numpy path, the FSC to float32 rounding. The
    volumes given are memory maps and stay unchanged."""
    import fasttomo.quality.metrics as metrics
    import fasttomo.quality.scoring as scoring
    from fasttomo.data.io.mrc import mrc_memmap, write_mrc

    rng = np.random.default_rng(4)
    truth = rng.normal(size=(12, 20, 24)).astype(np.float32) + 2.0
    vol = (truth + 0.5 * rng.normal(size=truth.shape)).astype(np.float32)
    monkeypatch.setattr(scoring, "WHOLE_VOLUME_MAX_VOXELS", 1000)
    monkeypatch.setattr(scoring, "STREAMED_MOMENTS_ABOVE", 1000)
    host, _ = scoring.score_against_truth(vol, truth, 2.0, tilt_range=(-60, 60))
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        mv, mt = (mrc_memmap(write_mrc(Path(d) / f"{n}.mrc", a, 2.0)) for n, a in (("v", vol), ("t", truth)))
        monkeypatch.setattr(metrics, "scoring_device", lambda: "cpu")
        monkeypatch.setattr(scoring, "SCORING_DEVICE_HEADROOM", headroom)
        kept = torch.from_numpy(vol.copy()) if given else None
        assert (scoring.on_scoring_device(mv, mt, kept) is None) == (headroom > 2)
        if given:
            assert scoring.on_scoring_device(mv, mt, kept)[0] is kept
        dev, _ = scoring.score_against_truth(mv, mt, 2.0, tilt_range=(-60, 60), vol_on_device=kept)
        np.testing.assert_array_equal(mv, vol)
    for key in ("pearson_global", "pearson_foreground", "foreground_fraction", "mse", "psnr_dB", "data_range"):
        assert dev[key] == pytest.approx(host[key], rel=1e-9), key
    for region in ("fsc", "fsc_measured", "fsc_wedge"):
        np.testing.assert_allclose(np.array(dev[region]["fsc"], dtype=float), np.array(host[region]["fsc"], dtype=float),
                                   rtol=0, atol=1e-5)
