"""Checks before training: what a run will write (and whether the disk has room for it), how
much memory it needs, and the dry run (``dry_run=true``) that reports all of it without
training or writing anything.

The estimates are arithmetic on the built run (parameter count, volume shape, batch shape):

* files: each volume file is Z*Y*X*4 bytes; a checkpoint is 4 bytes per parameter plus 8 per
  trainable parameter (Adam's moments); one extra checkpoint is counted for the temporary file
  of an atomic replace; TensorBoard and the small files are bounded generously;
* memory: parameters, gradients, Adam's moments, the divergence guard's two snapshots, and the
  activations of one step (points per step x floats kept per point, a rough figure: the pure
  torch path keeps about four copies of each point's features for the backward, the fused
  kernels fewer). On CUDA the dry run also measures one forward and backward pass.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from pathlib import Path

import torch

from fasttomo.config import Config

log = logging.getLogger("fasttomo")

MARGIN_BYTES = 16 << 20


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000.0
    return f"{n:.3g} TB"


def _counts(comps) -> tuple[int, int]:
    params = list(comps.projector.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def estimate_output_bytes(cfg: Config, comps, start_step: int = 0) -> dict[str, int]:
    """Bytes the run writes into its folder, by kind (see the module doc)."""
    shape = tuple(cfg.output.volume_shape) if cfg.output.volume_shape is not None else tuple(comps.box.shape_zyx)
    voxels = math.prod(int(v) for v in shape)
    n_vol = len(cfg.output.formats) + (1 if cfg.output.imod_xzy else 0)
    total, trainable = _counts(comps)
    ckpt = 4 * total + 8 * trainable + (1 << 20)
    steps_left = max(0, cfg.optim.steps - start_step)
    every = cfg.logging.checkpoint_every
    n_ckpt = 1 + (steps_left // every if every else 0) + 1  # periodic + last + one temporary during a replace
    lg = cfg.logging
    tb = 0
    if lg.tensorboard:
        n_scalars = 16
        tb = (steps_left // lg.log_every + 2) * n_scalars * 64
        if lg.image_every:
            z, y, x = comps.box.shape_zyx
            tb += (steps_left // lg.image_every + 1) * (x * y + x * z + y * z) * 2
    return {"volumes": n_vol * (voxels * 4 + 4096), "checkpoints": n_ckpt * ckpt, "tensorboard": tb,
            "other": 4 << 20}


def check_free_space(folder: Path, cfg: Config, comps, start_step: int = 0) -> dict[str, int]:
    """Raise :class:`~fasttomo.run.folder.OutputFolderError` when ``folder``'s file system has less
    free space than the run will write (plus a small margin); returns the estimate."""
    from fasttomo.run.folder import OutputFolderError

    need = estimate_output_bytes(cfg, comps, start_step)
    total = sum(need.values())
    free = shutil.disk_usage(folder).free
    log.info("this run writes about %s into %s (%s); %s free there", human(total), folder,
             ", ".join(f"{k} {human(v)}" for k, v in need.items() if v), human(free))
    if free < total + MARGIN_BYTES:
        raise OutputFolderError(
            f"output folder {folder} has {human(free)} free but this run writes about {human(total)} "
            f"({', '.join(f'{k} {human(v)}' for k, v in need.items() if v)}); free some space or choose another "
            "folder (hydra.run.dir=<folder>), or write less (e.g. output.formats=[mrc], logging.checkpoint_every=0, "
            "logging.tensorboard=false).")
    return need


def estimate_memory_bytes(cfg: Config, comps) -> dict[str, int]:
    """Device memory of one training step, by kind (see the module doc; activations are rough)."""
    total, trainable = _counts(comps)
    n_feat = int(getattr(comps.projector.field, "n_features", 1))
    hidden = cfg.model.hidden if cfg.model.kind != "voxel" else 0
    points = comps.sampler.batch_size * comps.projector.samples_per_ray
    per_point = 3 * 4 + 4 * n_feat + 4 * hidden + 16  # floats kept per sample point for the backward
    out = {"parameters": 4 * total, "gradients": 4 * trainable, "optimizer": 8 * trainable,
           "activations": points * per_point * 4,
           "data": int(comps.ts.stack.nbytes * (2 if comps.ts.valid is not None else 1))}
    if cfg.guard.enabled:
        out["guard snapshots"] = 2 * 12 * trainable
    return out


def _measured_step_peak(comps) -> int | None:
    """Peak CUDA memory of one forward and backward pass (no update); None off CUDA."""
    if comps.device.type != "cuda":
        return None
    torch.cuda.synchronize(comps.device)
    torch.cuda.reset_peak_memory_stats(comps.device)
    batch = comps.sampler.next_batch()
    with comps.precision.autocast():
        pred = comps.model(batch.tilt, batch.row, batch.col)
        reg, _ = comps.projector.regularization(comps.reg_generator, None)
    loss = ((pred - batch.target).square() * batch.weight).sum() + reg.float()
    loss.backward()
    comps.optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(comps.device)
    return int(torch.cuda.max_memory_allocated(comps.device))


def dry_run(cfg: Config) -> dict:
    """Validate config and data, build the run, print the estimates and the folder's state; write
    nothing. Returns the report (also printed)."""
    from fasttomo.run.build import build, sizing_lines
    from fasttomo.data.load import load_tiltseries
    from fasttomo.run.folder import inspect_folder
    from fasttomo.train.checkpoint import find_checkpoint, load_checkpoint

    start = 0
    if cfg.resume:
        path = find_checkpoint(cfg.resume)
        start = int(load_checkpoint(path)["step"])
        log.info("dry run: would resume from %s at step %d", path, start)
    ts = load_tiltseries(cfg.data)
    if cfg.model.kind == "sirt":
        return _dry_run_sirt(cfg, ts)
    comps = build(cfg, ts)
    sizing = sizing_lines(cfg, comps)  # what was sized from the data, and why
    cfg = dataclasses.replace(cfg, optim=comps.cfg.optim)  # optim.steps=None resolved by build
    mem = estimate_memory_bytes(cfg, comps)
    files = estimate_output_bytes(cfg, comps, start)
    report = {
        "device": str(comps.device),
        "tilt_series": {"n_tilts": ts.n_tilts, "height": ts.height, "width": ts.width, "pixel_size_A": ts.pixel_size,
                        "angles_deg": [float(ts.angles.min()), float(ts.angles.max())]},
        "box_zyx": list(comps.box.shape_zyx),
        "n_parameters": _counts(comps)[0],
        "memory_bytes": mem,
        "memory_total_bytes": sum(mem.values()),
        "files_bytes": files,
        "files_total_bytes": sum(files.values()),
    }
    lines = [f"dry run: config and data are valid; nothing was trained or written.",
             f"  data: {ts.n_tilts} tilts of {ts.height} x {ts.width} pixels, {ts.pixel_size:.4g} A/pixel, angles "
             f"{ts.angles.min():.2f}..{ts.angles.max():.2f} degrees",
             f"  model: {report['n_parameters']} parameters, box (Z, Y, X) = {tuple(comps.box.shape_zyx)}, "
             f"{cfg.optim.steps - start} steps of {comps.sampler.batch_size} rays x "
             f"{comps.projector.samples_per_ray} samples",
             "  sizes:", *sizing,
             f"  memory on {comps.device} (estimate): {human(sum(mem.values()))} = "
             + ", ".join(f"{k} {human(v)}" for k, v in mem.items())]
    peak = _measured_step_peak(comps)
    if peak is not None:
        free, total = torch.cuda.mem_get_info(comps.device)
        report["memory_measured_step_peak_bytes"] = peak
        report["device_free_bytes"] = int(free)
        lines.append(f"  measured on {torch.cuda.get_device_name(comps.device)}: one step peaks at {human(peak)}; "
                     f"{human(free)} of {human(total)} free")
        if peak + mem.get("guard snapshots", 0) + mem["optimizer"] > free:
            lines.append("  WARNING: this may not fit in the free device memory; lower sampler.batch_size or "
                         "projector.samples_per_ray, or use precision=bf16.")
    lines.append(f"  files: about {human(sum(files.values()))} = "
                 + ", ".join(f"{k} {human(v)}" for k, v in files.items() if v))
    if cfg.output.dir:
        folder = Path(cfg.output.dir)
        state = inspect_folder(folder, overwrite=cfg.output.overwrite, resume=cfg.resume)
        report["output_folder"] = {"path": str(folder.resolve()), "state": state}
        probe = folder if folder.exists() else next((p for p in folder.resolve().parents if p.exists()), Path("/"))
        free = shutil.disk_usage(probe).free
        report["disk_free_bytes"] = int(free)
        lines.append(f"  output folder {folder.resolve()}: {state}; {human(free)} free on its disk"
                     + ("" if free >= sum(files.values()) + MARGIN_BYTES else " -- NOT ENOUGH for this run"))
    for line in lines:
        log.info("%s", line)
    return report


def _dry_run_sirt(cfg: Config, ts) -> dict:
    """The dry run of model=sirt: data, box, a memory estimate (the volume, its weights and update,
    the stack, its residual and ray weights, fp32) and the folder's state; nothing is written."""
    from fasttomo.run.build import reconstruction_box, resolve_device
    from fasttomo.run.folder import inspect_folder

    box = reconstruction_box(cfg, ts)
    device = resolve_device(cfg.runtime.device)
    vol = 4 * math.prod(box.shape_zyx)
    stack = 4 * int(ts.stack.size)
    mem = {"volume, C weights, update": 3 * vol, "stack, R weights, residual": 3 * stack}
    report = {"device": str(device), "model": "sirt", "box_zyx": list(box.shape_zyx), "iterations": cfg.model.iterations,
              "memory_bytes": mem, "memory_total_bytes": sum(mem.values())}
    lines = ["dry run: config and data are valid; nothing was reconstructed or written.",
             f"  data: {ts.n_tilts} tilts of {ts.height} x {ts.width} pixels, {ts.pixel_size:.4g} A/pixel",
             f"  model: SIRT, {cfg.model.iterations} iterations, box (Z, Y, X) = {tuple(box.shape_zyx)}",
             f"  memory on {device} (estimate): {human(sum(mem.values()))}"]
    if cfg.output.dir:
        folder = Path(cfg.output.dir)
        state = inspect_folder(folder, overwrite=cfg.output.overwrite, resume=cfg.resume)
        report["output_folder"] = {"path": str(folder.resolve()), "state": state}
        lines.append(f"  output folder {folder.resolve()}: {state}")
    for line in lines:
        log.info("%s", line)
    return report
