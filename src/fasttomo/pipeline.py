"""One reconstruction, start to finish, from a typed Config (no Hydra here).

Order: join the process group (torchrun) -> check the output folder holds no earlier results ->
log file -> read/simulate the tilt series -> build -> (resume) -> train -> export volume (sharded
over ranks, gathered on rank 0) -> final checkpoint -> volume files, slices.png, metrics.json,
config.yaml (rank 0 only; the other ranks write nothing).

Resume (``resume=<checkpoint>``) continues the saved run exactly (same batches, RNG streams,
schedules and optimizer state) INTO A NEW RUN FOLDER: the output folder is checked like any
other (Hydra gives a fresh time-stamped one), so the old run's files are never touched. The new
folder holds the whole run: its metrics, loss curves and checkpoints include the steps before the
resume, and metrics.json names the checkpoint it resumed from. ``optim.steps`` is the TOTAL step
count, so resuming a run stopped at step N of optim.steps=T trains T-N more steps; raising
optim.steps extends a finished run (not bit-identical to a longer run from the start, since the
learning-rate schedule of the first part was laid out for the smaller total). Settings that differ
from the checkpoint's config are logged as a warning; the process count, data, sampler and model
must match (refused otherwise).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from fasttomo.config import Config, ConfigError, to_dict
from fasttomo.logging import add_file_log, to_uint8
from fasttomo.scoring import holdout_scores, predict_views

log = logging.getLogger("fasttomo")

RESULT_NAMES = ("metrics.json", "volume.mrc", "volume.h5", "volume.tif", "volume_xzy.mrc", "config.yaml",
                "slices.png", "loss.png", "fsc_truth.png", "fsc_halfsets.png", "volume_even.mrc", "volume_odd.mrc",
                "volume_even.h5", "volume_odd.h5", "volume_even.tif", "volume_odd.tif", "reconstruct.log",
                "checkpoints", "tb")


class OutputExistsError(FileExistsError):
    """The output folder already holds results of an earlier run."""


def check_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse a folder that already holds results (nothing a user made is silently overwritten)."""
    found = [n for n in RESULT_NAMES if (out_dir / n).exists()]
    if found and not overwrite:
        raise OutputExistsError(
            f"output folder {out_dir} already holds results of an earlier run ({', '.join(found)}); "
            "choose a new folder (e.g. hydra.run.dir=outputs/my_run2) or set output.overwrite=true to replace them."
        )
    out_dir.mkdir(parents=True, exist_ok=True)


def slices_png(path: Path, slices: dict[str, np.ndarray], truth: np.ndarray | None, overwrite: bool) -> None:
    """Orthogonal central slices side by side (XY | XZ | YZ); a second row shows the ground truth."""
    from PIL import Image

    from fasttomo.data.io.atomic import atomic_write

    rows = [[slices["xy"], slices["xz"], slices["yz"].T]]
    lo, hi = np.percentile(np.concatenate([s.ravel() for s in rows[0]]), [0.5, 99.5])
    if truth is not None:
        z, y, x = truth.shape
        rows.append([truth[z // 2], truth[:, y // 2], truth[:, :, x // 2].T])
    height = max(max(a.shape[0] for a in r) for r in rows)
    lines = []
    for r in rows:
        padded = [np.pad(to_uint8(a, lo, hi), ((0, height - a.shape[0]), (0, 2)), constant_values=0) for a in r]
        lines.append(np.concatenate(padded, axis=1))
    width = max(line.shape[1] for line in lines)
    img = np.concatenate([np.pad(line, ((0, 2), (0, width - line.shape[1]))) for line in lines], axis=0)
    atomic_write(path, lambda tmp: Image.fromarray(img).save(tmp, format="PNG"), overwrite=overwrite)


def _write_text(path: Path, text: str, overwrite: bool) -> None:
    from fasttomo.data.io.atomic import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), overwrite=overwrite)


def run_reconstruction(cfg: Config) -> dict:
    """Run one reconstruction described by ``cfg`` (cfg.output.dir must be set); returns metrics."""
    from fasttomo.data.load import load_tiltseries
    from fasttomo.evaluate import fsc_plot
    from fasttomo.scoring import attach_truth, split_holdout, truth_scores
    from fasttomo.train.distributed import (broadcast_object, destroy_distributed, dist_info, init_distributed,
                                            is_distributed)

    t0 = time.perf_counter()
    if not cfg.output.dir:
        raise ConfigError("output.dir: no output folder was given; set output.dir=<folder> (Hydra sets it).")
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    if cfg.runtime.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    wants_cuda = cfg.runtime.device.startswith("cuda") or (cfg.runtime.device == "auto" and torch.cuda.is_available())
    joined = not is_distributed() and init_distributed("cuda" if wants_cuda else "cpu")
    rank, world, local_rank = dist_info()
    out_dir = Path(broadcast_object(str(Path(cfg.output.dir).resolve())))
    main = rank == 0
    handler = None
    problem = None
    if main:
        try:
            check_output_dir(out_dir, cfg.output.overwrite)
        except OutputExistsError as exc:
            problem = str(exc)
    problem = broadcast_object(problem)
    if problem:
        raise OutputExistsError(problem)
    if main:
        handler = add_file_log(out_dir / "reconstruct.log", cfg.output.overwrite)
    try:
        ts = load_tiltseries(cfg.data)
        if cfg.evaluation.truth:
            attach_truth(ts, cfg.evaluation.truth, cfg.data.thickness)
        ts, hold = split_holdout(ts, cfg.evaluation.holdout_views)
        if cfg.model.kind == "sirt":
            metrics, volume = _run_sirt(cfg, ts, hold, out_dir, main, local_rank)
        else:
            metrics, volume = _run_field(cfg, ts, hold, out_dir, main, rank, world, local_rank)
        if cfg.evaluation.half_sets:
            halves = _half_sets(cfg, ts, out_dir if main else None, rank, world, local_rank)
            if main:
                metrics["half_sets"] = halves
        if main:
            if ts.ground_truth is not None and volume.shape == ts.ground_truth.shape:
                report, curves = truth_scores(volume, ts.ground_truth, ts.pixel_size, _tilt_range(ts))
                metrics.update(report)
                fsc_plot(out_dir / "fsc_truth.png", curves, "FSC of the reconstruction against the ground truth",
                         _tilt_range(ts), overwrite=cfg.output.overwrite)
            _loss_plot(out_dir / "loss.png", metrics, cfg.output.overwrite)
            _write_volumes(cfg, out_dir, "volume", volume, ts.pixel_size)
            z, y, x = volume.shape
            slices = {"xy": volume[z // 2], "xz": volume[:, y // 2], "yz": volume[:, :, x // 2]}
            slices_png(out_dir / "slices.png", slices, ts.ground_truth if metrics.get("pearson_global") else None,
                       cfg.output.overwrite)
            metrics["wall_seconds"] = time.perf_counter() - t0
            _write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2), True)
            log.info("done in %.1f s: %s", metrics["wall_seconds"],
                     ", ".join(f"{k}={metrics[k]:.4f}" for k in ("pearson_global", "pearson_foreground") if k in metrics))
        if joined:  # leave the process group we joined (after a successful run; on errors the process exits)
            destroy_distributed()
        return metrics
    finally:
        if handler is not None:
            logging.getLogger("fasttomo").removeHandler(handler)
            handler.close()


def _loss_plot(path: Path, metrics: dict, overwrite: bool) -> None:
    """loss.png: the training loss and the validation loss (held-out pixels) against the step."""
    from fasttomo.plots import Series, line_plot

    series = []
    for key, label in (("loss", "training loss (batch, with regularizers)"), ("val_loss", "validation loss (held-out pixels)")):
        curve = (metrics.get(key) or {}).get("curve") or []
        if curve:
            series.append(Series(label, [c[0] for c in curve], [c[1] for c in curve]))
    if "best_val" in metrics:
        series.append(Series(f"exported: step {metrics['best_val']['step']}", [metrics["best_val"]["step"]],
                             [metrics["best_val"]["loss"]], width=0, markers=True))
    if series:
        line_plot(path, series, "Loss curves", "step", "loss", log_y=True, legend="below", overwrite=overwrite)


def _tilt_range(ts) -> tuple[float, float]:
    a = np.asarray(ts.angles, dtype=np.float64)
    return float(a.min()), float(a.max())


def _write_volumes(cfg: Config, out_dir: Path, stem: str, volume: np.ndarray, pixel_size: float,
                   imod: bool | None = None) -> None:
    """``<stem>.<fmt>`` for every output.formats (and the XZY copy with output.imod_xzy)."""
    from fasttomo.data.io.volume import write_volume

    attrs = {"run": cfg.name, "config": to_dict(cfg), "units": "input stack units per voxel"}
    for fmt in cfg.output.formats:
        suffix = {"mrc": "mrc", "h5": "h5", "tiff": "tif"}[fmt]
        write_volume(out_dir / f"{stem}.{suffix}", volume, pixel_size, label=f"fasttomo run {cfg.name}",
                     attrs=attrs, fmt=fmt, overwrite=cfg.output.overwrite)
    if cfg.output.imod_xzy if imod is None else imod:
        write_volume(out_dir / f"{stem}_xzy.mrc", volume, pixel_size, label=f"fasttomo run {cfg.name}",
                     attrs=attrs, fmt="mrc", overwrite=cfg.output.overwrite, imod_xzy=True)


def _truth_probe(trainer, ts):
    """The quality-against-fit-time probe: the current field against the ground truth (Pearson
    only; collective under DDP, scores on rank 0)."""
    from fasttomo.metrics import volume_metrics

    def probe() -> dict:
        volume = trainer.export_volume()
        if volume is None:
            return {}
        return {k: v for k, v in volume_metrics(volume, ts.ground_truth).items() if k.startswith("pearson")}
    return probe


def _fit(cfg: Config, ts, out_dir: Path | None, rank: int, world: int, local_rank: int, resume: bool):
    """Build and train a field on ``ts``; returns (comps, trainer, volume, exported step, steps
    and seconds before the resume). ``out_dir`` None: no checkpoints, no TensorBoard."""
    from fasttomo.build import build
    from fasttomo.train.checkpoint import load_checkpoint
    from fasttomo.train.trainer import Trainer

    comps = build(cfg, ts, rank=rank, world_size=world, local_rank=local_rank)
    trainer = Trainer(comps, out_dir)
    if resume and cfg.resume:
        # every rank reads the file (to the CPU: RNG states must stay CPU tensors)
        trainer.load_state_dict(load_checkpoint(cfg.resume, map_location="cpu"), source=str(cfg.resume))
        log.info("resumed from %s at step %d of %d", cfg.resume, trainer.step, cfg.optim.steps)
    if ts.ground_truth is not None and cfg.evaluation.curve_every:
        trainer.probe = _truth_probe(trainer, ts)
    if out_dir is not None and rank == 0:
        _write_text(out_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False), cfg.output.overwrite)
    before = (trainer.step, trainer.train_seconds)
    trainer.fit()
    with trainer.exported_field() as exported_step:
        volume = trainer.export_volume(cfg.output.volume_shape)  # collective
    return comps, trainer, volume, exported_step, before


def _run_field(cfg: Config, ts, hold, out_dir: Path, main: bool, rank: int, world: int, local_rank: int):
    """Fit the field; (metrics, volume) on rank 0, ({}, None) elsewhere."""
    comps, trainer, volume, exported_step, (steps_before, seconds_before) = _fit(
        cfg, ts, out_dir, rank, world, local_rank, resume=True)
    trainer.save("last.pt")  # collective (gathers every rank's RNG states); rank 0 writes
    if not main:
        return {}, None
    metrics = _summarize(cfg, comps, trainer, steps_before, trainer.train_seconds - seconds_before, volume)
    metrics["exported_step"] = exported_step
    if trainer.best is not None:
        metrics["best_val"] = {"step": trainer.best["step"], "loss": trainer.best["val"]}
    if trainer.stopped_early:
        metrics["stopped_early_at"] = trainer.step
    if trainer.curve:
        metrics["curve"] = trainer.curve
    if cfg.resume:
        metrics["resumed_from"] = {"checkpoint": str(Path(cfg.resume).resolve()), "step": steps_before}
    if cfg.evaluation.true_poses and "poses" in metrics:
        metrics["pose_errors"] = _pose_errors(metrics["poses"], cfg.evaluation.true_poses, ts)
        log.info("poses against %s: shifts %.3f px RMS (%.3f without the z-translation gauge), rotations %.4f "
                 "degrees RMS", cfg.evaluation.true_poses, metrics["pose_errors"]["shift_rms_px"],
                 metrics["pose_errors"]["shift_rms_px_gauge_free"], metrics["pose_errors"]["rotation_rms_deg"])
    if hold is not None:
        with trainer.exported_field():
            pred = predict_views(comps.projector, hold.angles)
        bg = comps.projector.intensity.describe(comps.sampler.scale)["background"] if comps.projector.intensity else 0.0
        metrics["holdout"] = holdout_scores(hold, pred * comps.sampler.scale + bg)
        log.info("held-out views %s: reprojection Pearson %s", hold.view_numbers,
                 ", ".join(f"{v:.4f}" for v in metrics["holdout"]["pearson"]))
    return metrics, volume


def _pose_errors(learned: dict, path: str, ts) -> dict:
    """Learned poses against a poses file, matched by 1-based view number."""
    from fasttomo.data.io.poses import read_poses_json
    from fasttomo.geometry.alignment import pose_errors

    true = read_poses_json(path)
    n_file = len(true["tilt_deg"])
    numbers = list(ts.metadata.get("view_numbers") or range(1, ts.n_tilts + 1))
    if max(numbers) > n_file:
        raise ConfigError(f"evaluation.true_poses: {path} holds {n_file} views but the series has view {max(numbers)}; "
                          "give the poses file of this tilt series.")
    idx = [v - 1 for v in numbers]
    sub = {k: [true[k][i] for i in idx] for k in ("tilt_deg", "z1_deg", "z3_deg", "shift_u_px", "shift_v_px")}
    sub["reference_index"] = learned["reference_index"]
    return pose_errors(learned, sub)


def _run_sirt(cfg: Config, ts, hold, out_dir: Path, main: bool, local_rank: int):
    """The conventional baseline (model=sirt): SIRT on the background-subtracted stack."""
    from fasttomo.build import reconstruction_box, resolve_device
    from fasttomo.conventional.baseline import run_sirt

    device = resolve_device(cfg.runtime.device, local_rank)
    if not main:  # SIRT runs on rank 0 only; the other ranks wait at the end
        return {}, None
    if out_dir is not None:
        _write_text(out_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False), cfg.output.overwrite)
    box = reconstruction_box(cfg, ts)
    metrics, volume = run_sirt(cfg, ts, box, device, hold)
    return metrics, volume


def _half_sets(cfg: Config, ts, out_dir: Path | None, rank: int, world: int, local_rank: int) -> dict | None:
    """Even and odd views (in tilt order) reconstructed apart; their FSC. Each half gets its own
    seed, so the two fields share no initial noise that the data does not overwrite."""
    import dataclasses as dc

    from fasttomo.evaluate import fsc_plot
    from fasttomo.scoring import pair_fsc

    vols = {}
    for parity, name in ((0, "even"), (1, "odd")):
        keep = np.arange(parity, ts.n_tilts, 2)
        half = _subset(ts, keep)
        hcfg = dc.replace(cfg, resume=None, runtime=dc.replace(cfg.runtime, seed=cfg.runtime.seed + 1 + parity),
                          logging=dc.replace(cfg.logging, tensorboard=False, progress=False, checkpoint_every=0),
                          evaluation=dc.replace(cfg.evaluation, curve_every=0))
        log.info("half sets: reconstructing the %s views (%d of %d)", name, keep.size, ts.n_tilts)
        if cfg.model.kind == "sirt":
            if rank == 0:
                from fasttomo.build import reconstruction_box, resolve_device
                from fasttomo.conventional.baseline import run_sirt

                _, vols[name] = run_sirt(hcfg, half, reconstruction_box(hcfg, half),
                                         resolve_device(cfg.runtime.device, local_rank), None)
        else:
            _, _, vols[name], _, _ = _fit(hcfg, half, None, rank, world, local_rank, resume=False)
        if out_dir is not None and vols.get(name) is not None:
            _write_volumes(cfg, out_dir, f"volume_{name}", vols[name], ts.pixel_size, imod=False)
    if rank != 0:
        return None
    res, curves = pair_fsc(vols["even"], vols["odd"], ts.pixel_size, _tilt_range(ts))
    if out_dir is not None:
        fsc_plot(out_dir / "fsc_halfsets.png", curves, "FSC of the even-view and odd-view reconstructions",
                 _tilt_range(ts), overwrite=cfg.output.overwrite)
    log.info("half sets: FSC 0.143 at %s, 0.5 at %s", _res(res, "fsc0143"), _res(res, "fsc05"))
    return res


def _res(report: dict, key: str) -> str:
    """'12.3 A', or why there is no crossing (from the all-of-Fourier-space curve)."""
    fsc = report.get("fsc") or {}
    if fsc.get(f"{key}_A") is not None:
        return f"{fsc[f'{key}_A']:.3g} A"
    return {"never": f"none (above it up to Nyquist, {fsc.get('nyquist_A', 0):.3g} A)"}.get(
        fsc.get(f"{key}_status"), str(fsc.get(f"{key}_status")))


def _subset(ts, keep: np.ndarray):
    from fasttomo.data.tiltseries import TiltSeries

    sub = lambda a: None if a is None else np.ascontiguousarray(a[keep])  # noqa: E731
    return TiltSeries(stack=sub(ts.stack), angles=ts.angles[keep], pixel_size=ts.pixel_size, source=ts.source,
                      metadata=dict(ts.metadata), ground_truth=ts.ground_truth, valid=sub(ts.valid))


def _summarize(cfg: Config, comps, trainer, steps_before: int, seconds: float, volume: np.ndarray) -> dict:
    """Run summary. Speeds are of this process's training (after the resume, if any);
    ``train_seconds`` is the total over the whole run."""
    hist = trainer.history
    val = trainer.val_history
    steps_done = trainer.step - steps_before
    rays = steps_done * comps.cfg.sampler.batch_size * comps.world_size
    m = {
        "steps": trainer.step,
        "train_seconds": trainer.train_seconds,
        "steps_per_second": steps_done / seconds if seconds > 0 else None,
        "rays_per_second": rays / seconds if seconds > 0 else None,
        "loss": {
            "first": hist[0][1] if hist else None,
            "last": hist[-1][1] if hist else None,
            "min": min(h[1] for h in hist) if hist else None,
            "curve": hist,
        },
        "val_loss": {"last": val[-1][1] if val else None, "curve": val},
        "device": str(comps.device) if comps.device.type != "cuda" else torch.cuda.get_device_name(comps.device),
        "world_size": comps.world_size,
        "cuda_graph": comps.cuda_graph,
        "n_parameters": sum(p.numel() for p in comps.projector.parameters()),
        "box_zyx": list(comps.box.shape_zyx),
        "volume_shape_zyx": list(volume.shape),
        "pixel_size_A": comps.ts.pixel_size,
        "intensity_scale": comps.sampler.scale,
    }
    if comps.projector.intensity is not None:
        m["intensity"] = comps.projector.intensity.describe(comps.sampler.scale)
    if "background_estimate" in comps.ts.metadata:
        m["background_estimate"] = comps.ts.metadata["background_estimate"]
    if cfg.pose.learn:
        m["poses"] = comps.projector.poses.describe()
    return m
