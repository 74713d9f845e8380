"""One reconstruction, start to finish, from a typed Config (no Hydra here).

Order: join the process group (torchrun) -> (resume) read and verify the checkpoint, refuse
changes a continuation cannot make -> open the run folder (rank 0: lock, decide whether the folder
can be used, remove an earlier run's files when allowed, manifest; see runfolder.py) -> log file ->
read/simulate the tilt series -> build -> check the free disk space -> train (SIGINT/SIGTERM stop
after the current step, see stop.py) -> export the volume (sharded over ranks, gathered on rank 0)
-> volume files -> checkpoint -> slices.png -> metrics.json, last (rank 0 only; the other ranks
write nothing). Every file is written atomically. A failure to write one result keeps the others
and the error says what was saved where (outputs.py). An error at any point goes into
reconstruct.log and manifest.json (status failed, diverged or interrupted) before it propagates.

Resume (``resume=<checkpoint or run folder>``) continues the saved run exactly (same batches, RNG
streams, schedules and optimizer state), into a new run folder, or in place when the checkpoint
lies in the output folder of an unfinished (interrupted, killed, failed) run. The new folder
holds the whole run: its metrics, loss curves and checkpoints include the steps before the
resume, and metrics.json names the checkpoint it resumed from. ``optim.steps`` is the TOTAL step
count, so resuming a run stopped at step N of optim.steps=T trains T-N more steps; raising
optim.steps extends a finished run (not bit-identical to a longer run from the start, since the
learning-rate schedule of the first part was laid out for the smaller total). The entry point
takes the settings from the checkpoint (resume.py); here, settings that differ from the
checkpoint's config are logged as a warning, and the process count, data, sampler and model must
match (refused otherwise).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from fasttomo.config import Config, ConfigError, to_dict
from fasttomo.logging import add_file_log, to_uint8
from fasttomo.runfolder import OutputExistsError, OutputFolderError  # noqa: F401 - OutputExistsError: public here

log = logging.getLogger("fasttomo")


def planned_outputs(cfg: Config) -> list[str]:
    """What a run of ``cfg`` may write into its folder (names or glob patterns), recorded in the
    manifest before anything is written."""
    from fasttomo.outputs import volume_names

    names = ["reconstruct.log", "config.yaml", *volume_names(cfg), "checkpoints/last.pt", "checkpoints/step*.pt",
             "slices.png", "metrics.json"]
    if cfg.logging.tensorboard:
        names.append("tb/events.out.tfevents.*")
    return names


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
    from fasttomo.data.load import load_tiltseries
    from fasttomo.metrics import volume_metrics
    from fasttomo.outputs import dumps, save_checkpoint_file, write_volumes
    from fasttomo.preflight import check_free_space
    from fasttomo.resume import refuse_immutable
    from fasttomo.runfolder import RunFolder
    from fasttomo.stop import RunInterrupted, StopRequests, signal_name
    from fasttomo.train.checkpoint import find_checkpoint, load_checkpoint
    from fasttomo.train.distributed import (broadcast_object, destroy_distributed, dist_info, init_distributed,
                                            is_distributed)
    from fasttomo.train.guard import DivergenceError
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

    # a resumed run: read and verify the checkpoint before the folder is touched (every rank reads it)
    resume_path, resume_state = None, None
    if cfg.resume:
        resume_path = find_checkpoint(cfg.resume)
        resume_state = load_checkpoint(resume_path, map_location="cpu")
        if isinstance(resume_state.get("config"), dict):
            refuse_immutable(resume_state["config"], to_dict(cfg), str(resume_path))

    folder, problem = None, None
    if main:
        try:
            folder = RunFolder(out_dir, overwrite=cfg.output.overwrite, resume=resume_path,
                               outputs=planned_outputs(cfg)).open()
        except (OutputExistsError, OutputFolderError) as exc:
            problem = (isinstance(exc, OutputExistsError), str(exc))
    problem = broadcast_object(problem)
    if problem:
        raise (OutputExistsError if problem[0] else OutputFolderError)(problem[1])
    handler = None
    if main:
        try:
            handler = add_file_log(out_dir / "reconstruct.log", overwrite=True, append=folder.continuing)
        except OSError as exc:
            folder.finish("failed", error=f"cannot write the log: {exc}")
            raise OutputFolderError(f"cannot write {out_dir / 'reconstruct.log'} ({exc.strerror or exc}); choose a "
                                    "folder you can write to.") from None
        for note in folder.notes:
            log.info("%s", note)
    resume_cmd = f"fasttomo-reconstruct resume={out_dir} hydra.run.dir={out_dir}"
    stop = StopRequests(world_size=world)
    trainer = None
    try:
        with stop:
            ts = load_tiltseries(cfg.data)
            comps = build(cfg, ts, rank=rank, world_size=world, local_rank=local_rank)
            stop.device = comps.device
            trainer = Trainer(comps, out_dir)
            trainer.stop = stop
            if resume_state is not None:
                # every rank reads the file (to the CPU: RNG states must stay CPU tensors)
                trainer.load_state_dict(resume_state, source=str(resume_path))
                resume_state = None  # free the host copy
                log.info("resumed from %s at step %d of %d", resume_path, trainer.step, cfg.optim.steps)
            problem = None
            if main:
                try:
                    check_free_space(out_dir, cfg, comps, trainer.step)
                except OutputFolderError as exc:
                    problem = str(exc)
            problem = broadcast_object(problem)
            if problem:
                raise OutputFolderError(problem)
            if main:
                _write_text(out_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False), True)
            steps_before, seconds_before = trainer.step, trainer.train_seconds
            stop.phase = "training"
            log.info("training from step %d to %d (Ctrl-C or SIGTERM: stop after the current step and save)",
                     trainer.step, cfg.optim.steps)
            try:
                trainer.fit()
            except DivergenceError as exc:  # the guard rolled back to the last good state: keep it if it is new
                stop.phase = "saving"
                good = trainer.guard.rolled_back_to
                hint = " Nothing was learned before the divergence: run again with lower learning rates."
                if good is not None and good > steps_before:
                    state = trainer.state_dict()  # collective
                    saved = save_checkpoint_file(out_dir / "checkpoints" / "last.pt", state)[0] if main else None
                    if saved:
                        hint = (f" The last good state (step {good}) was saved to {saved}; continue from it with lower "
                                f"learning rates, e.g. fasttomo-reconstruct resume={saved} optim.lr_grids=<lower> "
                                "optim.steps=<more>.")
                raise DivergenceError(f"{exc}{hint}") from None
            stop.phase = "saving"
            interrupted = stop.signum is not None and trainer.step < cfg.optim.steps
            volume = trainer.export_volume(cfg.output.volume_shape)  # collective
            written, failed = {}, {}
            finite = True
            if main:
                finite = bool(np.isfinite(volume).all())
                attrs = {"run": cfg.name, "config": to_dict(cfg), "units": "input stack units per voxel"}
                if finite:
                    written, failed = write_volumes(out_dir, volume, cfg, ts.pixel_size, attrs)
                else:
                    log.error("the volume holds %d non-finite voxels (of %d); no volume file was written",
                              int((~np.isfinite(volume)).sum()), volume.size)
            state = trainer.state_dict()  # collective (gathers every rank's RNG states); rank 0 writes
            metrics: dict = {}
            if main:
                ckpt_path, ckpt_err = save_checkpoint_file(out_dir / "checkpoints" / "last.pt", state)
                if ckpt_err:
                    failed["checkpoints/last.pt"] = ckpt_err
                else:
                    written["checkpoints/last.pt"] = ckpt_path
                metrics = _summarize(cfg, comps, trainer, steps_before, trainer.train_seconds - seconds_before, volume)
                metrics["status"] = ("interrupted" if interrupted else "finished") if finite else "diverged"
                metrics["guard"] = trainer.guard.summary()
                if cfg.resume:
                    metrics["resumed_from"] = {"checkpoint": str(resume_path), "step": steps_before}
                if finite and ts.ground_truth is not None and volume.shape == ts.ground_truth.shape:
                    metrics.update(volume_metrics(volume, ts.ground_truth))
                if finite:
                    z, y, x = volume.shape
                    slices = {"xy": volume[z // 2], "xz": volume[:, y // 2], "yz": volume[:, :, x // 2]}
                    try:
                        slices_png(out_dir / "slices.png", slices,
                                   ts.ground_truth if metrics.get("pearson_global") else None, True)
                    except OSError as exc:
                        failed["slices.png"] = exc.strerror or str(exc)
                metrics["wall_seconds"] = time.perf_counter() - t0
                try:
                    _write_text(out_dir / "metrics.json", dumps(metrics), True)
                except OSError as exc:
                    failed["metrics.json"] = exc.strerror or str(exc)
            problem = broadcast_object(_write_problem(out_dir, cfg, failed, written, volume, state, ts, finite,
                                                      resume_cmd) if main else None)
            if problem:
                raise problem[0](problem[1])
            if main and not interrupted:
                log.info("done in %.1f s: %s", metrics["wall_seconds"],
                         ", ".join(f"{k}={metrics[k]:.4f}" for k in ("pearson_global", "pearson_foreground")
                                   if isinstance(metrics.get(k), float)))
        if interrupted:
            name = signal_name(stop.signum)
            raise RunInterrupted(stop.signum, f"stopped at step {trainer.step} of {cfg.optim.steps} ({name}); the "
                                 f"volume so far and a checkpoint are in {out_dir}; resume with: {resume_cmd}")
        if stop.signum is not None:
            log.info("%s arrived after the last step; the run finished", signal_name(stop.signum))
        if main:
            folder.finish("finished", step=trainer.step)
        if joined:  # leave the process group we joined (after a successful run; on errors the process exits)
            destroy_distributed()
        return metrics
    except BaseException as exc:
        if main:
            status = ("interrupted" if isinstance(exc, (RunInterrupted, KeyboardInterrupt))
                      else "diverged" if isinstance(exc, DivergenceError) else "failed")
            _log_failure(exc, handler)
            folder.finish(status, error=_one_line(exc), step=trainer.step if trainer is not None else None)
        raise
    finally:
        if handler is not None:
            logging.getLogger("fasttomo").removeHandler(handler)
            handler.close()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if not text or type(exc).__module__ == "builtins" else text


def _log_failure(exc: BaseException, handler: logging.Handler | None) -> None:
    """The run's error into reconstruct.log (and the console): one line for the errors fasttomo
    explains (the entry point then does not repeat it), the traceback -- into the file only, the
    entry point prints it -- for anything else."""
    from fasttomo.outputs import OutputWriteError
    from fasttomo.stop import RunInterrupted
    from fasttomo.train.guard import DivergenceError

    try:
        from fasttomo.reconstruct import user_errors

        known = (*user_errors(), DivergenceError, OutputWriteError, RunInterrupted)
    except ImportError:  # pragma: no cover - hydra missing: the API is used without the CLI
        known = (ConfigError, DivergenceError, OutputWriteError, RunInterrupted)
    if isinstance(exc, known):
        (log.warning if isinstance(exc, RunInterrupted) else log.error)("%s", exc)
        exc.fasttomo_logged = True
    elif isinstance(exc, KeyboardInterrupt):
        log.warning("interrupted")
    elif handler is not None:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "run failed with an unexpected error: %s",
                                (_one_line(exc),), (type(exc), exc, exc.__traceback__))
        handler.handle(record)


def _write_problem(out_dir: Path, cfg: Config, failed: dict, written: dict, volume, state, ts, finite: bool,
                   resume_cmd: str):
    """(error class, message) when results are missing (rank 0), else None: a non-finite volume is a
    divergence; failed writes are rescued where possible and reported with what was saved where."""
    from fasttomo.outputs import OutputWriteError, rescue, write_failure_message
    from fasttomo.train.guard import DivergenceError

    if not finite:
        where = written.get("checkpoints/last.pt")
        return (DivergenceError, "the reconstructed volume holds non-finite values (the field diverged); no volume "
                "file was written" + (f"; the checkpoint is {where}" if where else "") + ". Lower the learning rates "
                "(optim.lr_*) and run again.")
    if not failed:
        return None
    no_volume = not any(k.startswith("volume") for k in written) and any(k.startswith("volume") for k in failed)
    rescued = rescue(volume, state, cfg, ts.pixel_size, no_volume, "checkpoints/last.pt" in failed)
    ckpt = written.get("checkpoints/last.pt") or rescued.get("checkpoint")
    hint = f"fasttomo-reconstruct resume={ckpt} hydra.run.dir=<a writable folder>" if ckpt else None
    return (OutputWriteError, write_failure_message(out_dir, failed, written, rescued, hint))


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
