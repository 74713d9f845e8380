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

log = logging.getLogger("fasttomo")

RESULT_NAMES = ("metrics.json", "volume.mrc", "volume.h5", "volume.tif", "volume_xzy.mrc", "config.yaml",
                "slices.png", "reconstruct.log", "checkpoints", "tb")


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
    from fasttomo.build import build
    from fasttomo.data.io.volume import write_volume
    from fasttomo.data.load import load_tiltseries
    from fasttomo.metrics import volume_metrics
    from fasttomo.train.checkpoint import load_checkpoint
    from fasttomo.train.distributed import (broadcast_object, destroy_distributed, dist_info, init_distributed,
                                            is_distributed)
    from fasttomo.train.trainer import Trainer

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
        comps = build(cfg, ts, rank=rank, world_size=world, local_rank=local_rank)
        trainer = Trainer(comps, out_dir)
        if cfg.resume:
            # every rank reads the file (to the CPU: RNG states must stay CPU tensors)
            trainer.load_state_dict(load_checkpoint(cfg.resume, map_location="cpu"), source=str(cfg.resume))
            log.info("resumed from %s at step %d of %d", cfg.resume, trainer.step, cfg.optim.steps)
        if main:
            _write_text(out_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False), cfg.output.overwrite)
        steps_before, seconds_before = trainer.step, trainer.train_seconds
        trainer.fit()
        volume = trainer.export_volume(cfg.output.volume_shape)  # collective
        trainer.save("last.pt")  # collective (gathers every rank's RNG states); rank 0 writes
        metrics: dict = {}
        if main:
            metrics = _summarize(cfg, comps, trainer, steps_before, trainer.train_seconds - seconds_before, volume)
            if cfg.resume:
                metrics["resumed_from"] = {"checkpoint": str(Path(cfg.resume).resolve()), "step": steps_before}
            if ts.ground_truth is not None and volume.shape == ts.ground_truth.shape:
                metrics.update(volume_metrics(volume, ts.ground_truth))
            attrs = {"run": cfg.name, "config": to_dict(cfg), "units": "input stack units per voxel"}
            for fmt in cfg.output.formats:
                suffix = {"mrc": "mrc", "h5": "h5", "tiff": "tif"}[fmt]
                write_volume(out_dir / f"volume.{suffix}", volume, ts.pixel_size, label=f"fasttomo run {cfg.name}",
                             attrs=attrs, fmt=fmt, overwrite=cfg.output.overwrite)
            if cfg.output.imod_xzy:
                write_volume(out_dir / "volume_xzy.mrc", volume, ts.pixel_size, label=f"fasttomo run {cfg.name}",
                             attrs=attrs, fmt="mrc", overwrite=cfg.output.overwrite, imod_xzy=True)
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


def _summarize(cfg: Config, comps, trainer, steps_before: int, seconds: float, volume: np.ndarray) -> dict:
    """Run summary. Speeds are of this process's training (after the resume, if any);
    ``train_seconds`` is the total over the whole run."""
    hist = trainer.history
    val = trainer.val_history
    steps_done = trainer.step - steps_before
    rays = steps_done * cfg.sampler.batch_size * comps.world_size
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
    if cfg.pose.learn:
        m["poses"] = comps.projector.poses.describe()
    return m
