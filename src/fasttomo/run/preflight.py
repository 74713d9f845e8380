"""Checks before training: what a run will write (and whether the disk has room for it), how
much memory it needs, and the dry run (``dry_run=true``) that reports all of it without
training or writing anything.

The estimates are arithmetic on the built run (parameter count, volume shape, batch shape):

* files: each volume file is Z*Y*X*4 bytes (the half volumes of output.half_volumes too); a
  checkpoint is 4 bytes per parameter plus 8 per trainable parameter (Adam's moments); one extra
  checkpoint is counted for the temporary file of an atomic replace; TensorBoard and the small
  files are bounded generously;
* memory: what the run holds at its peak (:func:`estimate_memory_bytes`): on the CPU the resident
  memory of the process (Python and torch, the data and the model, measured where the estimate
  is made) plus gradients, Adam's moments, the divergence guard's two snapshots, a training
  step, and the larger of the largest chunk of the other passes that evaluate the field (a
  validation chunk, a chunk of rendered views, an export chunk; bytes per sample point x points
  per chunk) and the final volume with its scores; on CUDA the same from parameters and data up,
  the passes one after another. On CUDA the dry run also measures one forward and backward pass.
  A run that cannot fit in the free memory is refused before it trains (:func:`check_memory`),
  with the fix (data.thickness that fits, fewer rays or samples).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from fasttomo.config import Config, ConfigError

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
    from fasttomo.quality.scoring import WHOLE_VOLUME_MAX_VOXELS

    shape = tuple(cfg.output.volume_shape) if cfg.output.volume_shape is not None else tuple(comps.box.shape_zyx)
    voxels = math.prod(int(v) for v in shape)
    n_vol = len(cfg.output.formats) + (1 if cfg.output.imod_xzy else 0)
    if cfg.output.half_volumes:  # volume_even.* and volume_odd.*: the formats, and MRC always
        n_vol += 2 * len(set(cfg.output.formats) | {"mrc"})
    elif cfg.evaluation.half_sets and voxels > WHOLE_VOLUME_MAX_VOXELS and comps.device.type != "cuda":
        n_vol += 2  # held as MRC files where no GPU holds them (run.results._half_volume)
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
            f"({', '.join(f'{k} {human(v)}' for k, v in need.items() if v)}) and leaves {human(MARGIN_BYTES)} free "
            "beside it; free some space or choose another "
            "folder (hydra.run.dir=<folder>), or write less (e.g. output.formats=[mrc], logging.checkpoint_every=0, "
            "logging.tensorboard=false).")
    return need


def train_point_bytes(n_features: int, hidden: int, fused: bool = False) -> int:
    """Bytes a training step keeps per sample point for the backward (measured about 1,000-1,100 B
    at 32 features and 32 hidden units on the CPU's aten path). ``fused`` (the GPU's Triton
    interpolation or the CPU's native kernels, which recompute the plane features in their
    backward): the point, the decoder's input and its two hidden layers, about 480 B at 48
    features and 32 hidden units (an H200's dry run measured about 500 B a point of a 4096^2 x 121
    series' step)."""
    if fused:
        return 4 * (3 + n_features + 2 * hidden + 4)
    return 4 * (3 * 4 + 4 * n_features + 4 * hidden + 16)


EXPORT_DEVICE_BYTES_PER_VOXEL = 20
"""GPU bytes a voxel of an export slab costs: its grid point (12), its density (4) and the slab
before it, still held while this one is evaluated (4): camera2k's and camera4k's measured peaks
are their persistent memory plus 21 B for each voxel of a 2^28-voxel slab."""


def _fused(device: torch.device) -> bool:
    """Whether a training step on ``device`` runs an interpolation that recomputes the plane
    features in its backward instead of saving them: the fused Triton kernels (CUDA, triton
    installed) or the native C kernels of the CPU (a C compiler on PATH), kernels.backend not
    forced to torch."""
    import importlib.util

    from fasttomo.kernels import dispatch

    if dispatch.backend() == "torch":
        return False
    if device.type == "cpu":
        return bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


@dataclass
class RunShape:
    """What a run's memory depends on: known before the model is built (:func:`planned_shape`)
    or read from the built run (:func:`built_shape`)."""

    device: torch.device
    batch: int
    samples_per_ray: int
    n_features: int
    hidden: int
    n_val: int
    """Validation pixels."""
    pixels: int
    """Pixels of the training views (n_tilts x H x W)."""
    stack_bytes: int
    parameters: int
    voxels: int
    """Voxels of the exported volume."""
    built: bool = False
    """The model exists already (its parameters are part of what the process holds)."""
    plane_voxels: int = 0
    """Voxels of one Z plane of the exported volume (its export slabs are whole planes)."""
    planes_bf16: bool = False
    """precision.planes=bf16: every pass that evaluates the field holds a bf16 copy of the planes."""


def _voxels(cfg: Config, box) -> int:
    return math.prod(_volume_shape(cfg, box))


def _volume_shape(cfg: Config, box) -> tuple[int, ...]:
    shape = tuple(cfg.output.volume_shape) if cfg.output.volume_shape is not None else tuple(box.shape_zyx)
    return tuple(int(v) for v in shape)


def _planned_field(cfg: Config, box) -> tuple[int, int]:
    """(parameters, features per point) of the field ``cfg.model`` would build on ``box``,
    counted without building it."""
    from fasttomo.kernels.layout import PlaneLayout
    from fasttomo.models import auto_resolutions

    m = cfg.model
    if m.kind == "voxel":
        shape = tuple(m.voxel_shape) if m.voxel_shape is not None else box.shape_zyx
        return math.prod(int(v) for v in shape), 1
    res = m.resolutions if m.resolutions is not None else auto_resolutions(box)
    triples = tuple((r, r, r) if isinstance(r, int) else tuple(r) for r in res)
    layout = PlaneLayout(n_rot=m.n_rotations, channels=m.channels, resolutions=triples)
    f, h = layout.n_features, m.hidden
    decoder = f + 1 if m.decoder == "linear" else f * h + h + h * h + h + h + 1
    return layout.numel + decoder + 16 * m.n_rotations, f


def planned_world_size() -> int:
    """The ranks the run will have: the process group's size, else torchrun's WORLD_SIZE (a dry
    run under torchrun plans before any group exists), else 1."""
    import os

    from fasttomo.train.distributed import dist_info

    try:
        env = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        env = 1
    return max(1, dist_info()[1], env)


def planned_shape(cfg: Config, ts, local_rank: int = 0) -> RunShape:
    """The :class:`RunShape` of the run ``cfg`` would build on ``ts`` (nothing is allocated)."""
    from fasttomo.data.sampler import split_size
    from fasttomo.geometry.rays import auto_samples_per_ray
    from fasttomo.run.build import auto_batch_size, reconstruction_box, resolve_device

    box = reconstruction_box(cfg, ts)
    spr = cfg.projector.samples_per_ray or auto_samples_per_ray(box, ts.angles)
    params, feats = _planned_field(cfg, box)
    pixels = ts.n_tilts * ts.height * ts.width
    batch = cfg.sampler.batch_size or auto_batch_size(ts, cfg.sampler, planned_world_size())
    return RunShape(resolve_device(cfg.runtime.device, local_rank), int(batch), int(spr), feats,
                    cfg.model.hidden if cfg.model.kind != "voxel" else 0, split_size(pixels, cfg.sampler.val_fraction),
                    pixels, int(ts.stack.nbytes * (2 if ts.valid is not None else 1)), params, _voxels(cfg, box),
                    plane_voxels=math.prod(_volume_shape(cfg, box)[1:]), planes_bf16=cfg.precision.planes == "bf16")


def built_shape(cfg: Config, comps) -> RunShape:
    """The :class:`RunShape` of a built run."""
    ts = comps.ts
    return RunShape(comps.device, int(comps.sampler.batch_size), int(comps.projector.samples_per_ray),
                    int(getattr(comps.projector.field, "n_features", 1)),
                    cfg.model.hidden if cfg.model.kind != "voxel" else 0, int(comps.sampler.n_val),
                    ts.n_tilts * ts.height * ts.width, int(ts.stack.nbytes * (2 if ts.valid is not None else 1)),
                    _counts(comps)[1], _voxels(cfg, comps.box), built=True,
                    plane_voxels=math.prod(_volume_shape(cfg, comps.box)[1:]), planes_bf16=cfg.precision.planes == "bf16")


def pass_bytes(shape: RunShape) -> dict[str, int]:
    """Bytes of the largest chunk of each pass that evaluates the field: a training step (on the
    CPU's native kernels with its backward's per-thread plane gradients), a validation chunk, a
    rendering chunk (per-view residuals, held-out views), an export chunk; each with the planes'
    bf16 copy under precision.planes=bf16."""
    from fasttomo.quality.scoring import (VIEW_RESIDUAL_RAYS, free_memory_bytes, nograd_point_bytes,
                                          render_chunk_rays)
    from fasttomo.methods.field.projector import volume_chunk
    from fasttomo.train.trainer import VAL_CHUNK_FLOATS

    spr, batch = shape.samples_per_ray, shape.batch
    nograd = nograd_point_bytes(shape.n_features, shape.hidden, shape.device.type == "cpu" and _fused(shape.device))
    val_rays = min(batch * max(1, min(16, VAL_CHUNK_FLOATS // max(1, batch * spr * shape.n_features))), shape.n_val)
    view_rays = min(shape.pixels, VIEW_RESIDUAL_RAYS * 2,
                    render_chunk_rays(spr, nograd, free_memory_bytes(shape.device)))
    step = batch * spr * train_point_bytes(shape.n_features, shape.hidden, _fused(shape.device))
    if shape.device.type == "cpu" and shape.hidden and _fused(shape.device):  # the native backward's
        from fasttomo.kernels.cpu_native import backward_threads  # per-thread plane gradients

        plane_bytes = 4 * shape.parameters  # the planes and the few other parameters
        step += (backward_threads(plane_bytes) - 1) * plane_bytes
    # the planes' bf16 copy (on the CPU their rounded values in fp32; the few other parameters
    # counted with them)
    copy = (4 if shape.device.type == "cpu" else 2) * shape.parameters if shape.planes_bf16 else 0
    return {"training step": step + copy,
            "validation": val_rays * spr * nograd + copy, "rendering views": view_rays * spr * nograd + copy,
            "export": volume_chunk(shape.device) * nograd + copy}


def rss_bytes() -> int | None:
    """This process's resident memory now (VmRSS), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_bytes(shape: RunShape, guard: bool) -> dict[str, int]:
    """Peak memory of the run on its device, by kind. On the CPU (peak resident memory, RSS): what
    this process holds now (Python, torch, the data, and the model once built, measured), the
    parameters (before the build), gradients, Adam's moments and the guard's snapshots, a training
    step's activations plus the larger of the largest chunk of the other passes (:func:`pass_bytes`;
    the allocator keeps the step's freed blocks, so they add up) and the final volume with its
    scores (:func:`cpu_final_bytes`), which follows the passes in the memory they freed: camera1k's
    peak is its whole-volume FSC's, camera2k's its export slab's (benchmarks/README.md). On CUDA:
    parameters, data, gradients, optimizer and snapshots, plus the largest of the passes that come
    one after another (a training step, the largest other chunk, an export slab
    of at most 1 GiB of float32 at :data:`EXPORT_DEVICE_BYTES_PER_VOXEL` with its evaluation's
    chunk): the measured peaks of the
    camera cases are that sum (benchmarks/README.md). A volume exported whole (DDP, no mrc among
    the formats) needs more than the slab counted here."""
    passes = pass_bytes(shape)
    step = passes.pop("training step")
    largest = max(passes, key=passes.get)
    here = rss_bytes() if shape.device.type == "cpu" else None
    if here is None:
        out = {"parameters": 4 * shape.parameters, "data": shape.stack_bytes}
    elif shape.built:
        out = {"python, torch, data and model (measured)": here}
    else:
        out = {"python, torch and data (measured)": here, "parameters": 4 * shape.parameters}
    n = shape.parameters
    out.update({"gradients": 4 * n, "optimizer": 8 * n})
    if guard:
        out["guard snapshots"] = 2 * 12 * n
    if here is None:  # CUDA: the passes follow one another, each in the memory the last one freed
        from fasttomo.run.outputs import EXPORT_SLAB_MAX_BYTES

        slab = min(shape.voxels, EXPORT_SLAB_MAX_BYTES // 4) * EXPORT_DEVICE_BYTES_PER_VOXEL
        other = max((k for k in passes if k != "export"), key=passes.get)
        phases = {"training step": step, other: passes[other], "export slab": slab + passes["export"]}
        name = max(phases, key=phases.get)
        out[f"largest pass ({name})"] = phases[name]
        return out
    out["training step"] = step  # its blocks stay with the process (the allocator keeps them) ...
    from fasttomo.quality.scoring import free_memory_bytes

    free = free_memory_bytes(shape.device)  # the export sizes its slabs from what training leaves free
    free = None if free is None else max(0, free - (sum(out.values()) - here))  # less what is still to come
    later = {f"largest other pass ({largest})": passes[largest],  # ... while the other passes run, and the
             "final volume and scores": cpu_final_bytes(shape.voxels, shape.plane_voxels, free)}  # final reuses theirs
    name = max(later, key=later.get)
    out[name] = later[name]
    return out


CPU_WHOLE_VOLUME_BYTES_PER_VOXEL = 36
"""Host bytes a voxel of a volume scored whole costs at the end of a CPU run, beyond the training's
memory: the volume, the truth and the transforms of its FSC (camera1k, 2^28 voxels: a 12.59 GB
peak over 3.17 GB of process, data, model and training step, 35 B a voxel)."""


def cpu_final_bytes(voxels: int, plane_voxels: int = 0, free_bytes: int | None = None) -> int:
    """The CPU's final volume and its scores: up to ``quality.scoring.WHOLE_VOLUME_MAX_VOXELS`` the
    volume scored whole (:data:`CPU_WHOLE_VOLUME_BYTES_PER_VOXEL`); above it the export goes slab by
    slab into its file and the scores stream over the files' maps, so what counts is one export slab
    at ``EXPORT_BYTES_PER_VOXEL``: at most ``run.outputs.EXPORT_SLAB_MAX_BYTES`` of float32, and,
    given the Z plane's voxels and the memory free then, the slab ``run.outputs.slab_planes`` sizes."""
    from fasttomo.quality.scoring import WHOLE_VOLUME_MAX_VOXELS
    from fasttomo.run.outputs import EXPORT_BYTES_PER_VOXEL, EXPORT_SLAB_MAX_BYTES, slab_planes

    if voxels <= WHOLE_VOLUME_MAX_VOXELS:
        return voxels * CPU_WHOLE_VOLUME_BYTES_PER_VOXEL
    slab = min(voxels, EXPORT_SLAB_MAX_BYTES // 4)
    if plane_voxels and free_bytes is not None:
        slab = min(slab, slab_planes((voxels // plane_voxels, plane_voxels, 1), free_bytes) * plane_voxels)
    return slab * EXPORT_BYTES_PER_VOXEL


def estimate_memory_bytes(cfg: Config, comps) -> dict[str, int]:
    """:func:`memory_bytes` of the built run."""
    return memory_bytes(built_shape(cfg, comps), cfg.guard.enabled)


def half_sets_bytes(shape: RunShape, guard: bool, files: bool, free: int | None) -> dict[str, int]:
    """CUDA peak of the half sets, which come after the main fit is let go (``Run.score``): a
    half's fit (:func:`memory_bytes` with half the views' pixels and data) and, where the even half
    is held on the device for the FSC (``run.results._half_on_device``: no ``files``, i.e.
    output.half_volumes=false, and ``free`` bytes, the device's free memory with the main fit let
    go, hold 16 bytes a voxel beside the fit), that half beside the odd one evaluated into its
    own tensor while the odd fit still exists. Otherwise the halves go through files and the fit
    with its export slab is all."""
    half = dataclasses.replace(shape, stack_bytes=-(-shape.stack_bytes // 2), pixels=-(-shape.pixels // 2),
                               n_val=-(-shape.n_val // 2), built=False)
    fit = memory_bytes(half, guard)
    out = {f"a half's {k}": v for k, v in fit.items()}
    if not files and free is not None and free >= 16 * shape.voxels + sum(fit.values()):
        out.update({"the even half, held": 4 * shape.voxels, "the odd half, evaluated": 4 * shape.voxels})
    return out


def _need_and_free(shape: RunShape, guard: bool) -> tuple[int, int | None, dict[str, int]]:
    """(bytes still to allocate, free bytes or None, the estimate): what the process holds
    already is not free any more, so it counts as used, not as still needed."""
    from fasttomo.quality.scoring import free_memory_bytes

    mem = memory_bytes(shape, guard)
    if shape.device.type == "cpu":
        held = rss_bytes() or 0
    else:
        held = torch.cuda.memory_allocated(shape.device) if shape.built else 0
    return sum(mem.values()) - held, free_memory_bytes(shape.device), mem


def _thickness_that_fits(cfg: Config, ts, free: int) -> int | None:
    """The largest data.thickness (>= 2) whose run needs at most 80 % of ``free``, or None."""
    import dataclasses

    def fits(t: int) -> bool:
        c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, thickness=t))
        return _need_and_free(planned_shape(c, ts), cfg.guard.enabled)[0] <= 0.8 * free

    lo, hi = 2, int(cfg.data.thickness)
    if not fits(lo):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def memory_problem(cfg: Config, ts, local_rank: int = 0) -> str | None:
    """Why the run ``cfg`` would build on ``ts`` cannot fit in the device's free memory (the fix
    in the message: a thinner box, fewer rays or samples a step), or None when it fits. Checked
    before the model is built: nothing is allocated."""
    shape = planned_shape(cfg, ts, local_rank)
    need, free, mem = _need_and_free(shape, cfg.guard.enabled)
    if free is None or need <= free:
        return None
    fixes = []
    if cfg.data.thickness is not None:
        t = _thickness_that_fits(cfg, ts, free)
        fixes.append(f"a thinner box (data.thickness={cfg.data.thickness} makes rays of {shape.samples_per_ray} "
                     "samples" + (f"; about data.thickness={t} or less fits)" if t else ")"))
    fixes.append(f"fewer rays a step (sampler.batch_size, now {shape.batch}) or samples (projector.samples_per_ray, "
                 f"now {shape.samples_per_ray})")
    return (f"this run needs about {human(need)} more memory on {shape.device} but {human(free)} is free "
            f"({', '.join(f'{k} {human(v)}' for k, v in mem.items())}); use {' or '.join(fixes)}.")


def check_memory(cfg: Config, ts, local_rank: int = 0) -> None:
    """Raise ConfigError with :func:`memory_problem`'s message when the run cannot fit."""
    problem = memory_problem(cfg, ts, local_rank)
    if problem:
        raise ConfigError(problem)


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
    from fasttomo.run.folder import STOPS_AT
    from fasttomo.run.inputs import load_inputs
    from fasttomo.train.checkpoint import find_checkpoint, load_checkpoint

    start = 0
    if cfg.resume:
        path = find_checkpoint(cfg.resume)
        start = int(load_checkpoint(path)["step"])
        log.info("dry run: would resume from %s at step %d", path, start)
        if cfg.optim.steps is not None and start > cfg.optim.steps:  # as the trainer refuses it
            raise ConfigError(f"{path} is at step {start} but optim.steps={cfg.optim.steps}; optim.steps is the "
                              f"total number of steps (including those before the resume): set optim.steps >= {start}.")
    dry = {"sirt": dry_run_sirt}.get(cfg.model.kind, dry_run_field)  # as run/methods.py picks the method
    ts, _ = load_inputs(cfg)  # the truth, the held-out views and the half sets checked as the run checks them
    report = dry(cfg, ts, start)
    folder = report.get("output_folder") or {}
    state = str(folder.get("state", ""))
    if state.startswith("REFUSED: "):  # the refusal names its own fixes
        raise ConfigError(f"dry run: the run would be refused: {state[len('REFUSED: '):]}")
    if state.startswith(STOPS_AT):
        raise ConfigError(f"dry run: the run would stop at its output folder {folder.get('path')}: {state}. Choose "
                          "another folder with hydra.run.dir=<dir>.")
    if report.get("disk_short"):
        need = sum(report["files_bytes"].values())
        raise ConfigError(f"dry run: the run would stop at its output folder {folder.get('path')}: its disk has "
                          f"{human(report['disk_free_bytes'])} free, and the run writes about {human(need)} and "
                          f"leaves {human(MARGIN_BYTES)} free beside it. Free space, or choose a folder on another "
                          "disk with hydra.run.dir=<dir>.")
    return report


def dry_run_field(cfg: Config, ts, start: int = 0) -> dict:
    """The dry run of a field: data, box, parameters, memory and file estimates, the folder's
    state and its free space; nothing is written."""
    from fasttomo.run.build import build, sizing_lines
    from fasttomo.run.folder import inspect_folder

    check_memory(cfg, ts)  # before the build: a model too big for the memory is never allocated
    comps = build(cfg, ts)
    sizing = sizing_lines(cfg, comps)  # what was sized from the data, and why
    cfg = dataclasses.replace(cfg, optim=comps.cfg.optim)  # optim.steps=None resolved by build
    shape = built_shape(cfg, comps)
    mem = memory_bytes(shape, cfg.guard.enabled)
    halves = None
    if comps.device.type == "cuda" and (cfg.evaluation.half_sets or cfg.output.half_volumes):
        free = torch.cuda.mem_get_info(comps.device)[0] + torch.cuda.memory_allocated(comps.device)  # fit let go
        halves = half_sets_bytes(shape, cfg.guard.enabled, cfg.output.half_volumes, free)
    files = estimate_output_bytes(cfg, comps, start)
    report = {
        "device": str(comps.device),
        "tilt_series": {"n_tilts": ts.n_tilts, "height": ts.height, "width": ts.width, "pixel_size_A": ts.pixel_size,
                        "angles_deg": [float(ts.angles.min()), float(ts.angles.max())]},
        "box_zyx": list(comps.box.shape_zyx),
        "n_parameters": _counts(comps)[0],
        "memory_bytes": mem,
        "memory_total_bytes": max(sum(mem.values()), sum(halves.values()) if halves else 0),
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
             f"  memory on {comps.device} (estimate): {human(report['memory_total_bytes'])}"
             + (" (the half sets')" if halves and sum(halves.values()) > sum(mem.values()) else "")
             + f"; the fit: {human(sum(mem.values()))} = " + ", ".join(f"{k} {human(v)}" for k, v in mem.items())]
    if halves:
        report["memory_half_sets_bytes"] = halves
        lines.append(f"  half sets, after the fit is let go: {human(sum(halves.values()))} = "
                     + ", ".join(f"{k} {human(v)}" for k, v in halves.items()))
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
        report["disk_short"] = free < sum(files.values()) + MARGIN_BYTES
        lines.append(f"  output folder {folder.resolve()}: {state.rstrip('.')}; {human(free)} free on its disk"
                     + (" -- NOT ENOUGH for this run" if report["disk_short"] else ""))
    for line in lines:
        log.info("%s", line)
    return report


def dry_run_sirt(cfg: Config, ts, start: int = 0) -> dict:
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
    if cfg.evaluation.half_sets or cfg.output.half_volumes:  # after the main fit, whose volume is let go
        half = {"the even half, held": vol, "volume, C weights, update": 3 * vol,
                "half stack, R weights, residual": 3 * (stack // 2 + stack % 2)}
        report["memory_half_sets_bytes"] = half
        report["memory_total_bytes"] = max(report["memory_total_bytes"], sum(half.values()))
        lines[-1] = (f"  memory on {device} (estimate): {human(report['memory_total_bytes'])}; the fit: "
                     f"{human(sum(mem.values()))}, the half sets: {human(sum(half.values()))} (the odd half fitted "
                     "beside the even one)")
    if cfg.output.dir:
        folder = Path(cfg.output.dir)
        state = inspect_folder(folder, overwrite=cfg.output.overwrite, resume=cfg.resume)
        report["output_folder"] = {"path": str(folder.resolve()), "state": state}
        lines.append(f"  output folder {folder.resolve()}: {state}")
    for line in lines:
        log.info("%s", line)
    return report
