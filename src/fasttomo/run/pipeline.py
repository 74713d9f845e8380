"""One reconstruction, start to finish, from a typed Config (no Hydra here).

Order: join the process group (torchrun) -> (resume) read and verify the checkpoint, refuse
changes a continuation cannot make -> open the run folder (rank 0: lock, decide whether the folder
can be used, remove an earlier run's files when allowed, manifest; see runfolder.py) -> log file ->
read/simulate the tilt series (evaluation.truth attached, evaluation.holdout_views set aside) ->
build -> check the free disk space -> train (SIGINT/SIGTERM stop after the current step, see
stop.py) -> export the volume (the best-validation field with optim.keep_best; sharded over ranks,
gathered on rank 0) -> volume files -> checkpoint -> (pose=refine: poses.xf/.tlt/.aln) ->
(evaluation.half_sets or output.half_volumes: the even and the odd views fitted apart, their
volumes and FSC) -> slices.png, loss.png, fsc_*.png -> metrics.json,
last (rank 0 only; the other ranks write nothing). model=sirt replaces build/train/checkpoint by
the SIRT baseline (conventional/baseline.py). Every file is written atomically. A failure to write one result keeps the others
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
import sys
import time
from dataclasses import replace as dc_replace
from pathlib import Path

import numpy as np
import torch
import yaml

from fasttomo.config import Config, ConfigError, to_dict, upgrade
from fasttomo.logging import add_file_log, quiet_other_ranks, restore_ranks
from fasttomo.run.folder import OutputExistsError, OutputFolderError  # noqa: F401 - OutputExistsError: public here

log = logging.getLogger("fasttomo")


def planned_outputs(cfg: Config) -> list[str]:
    """What a run of ``cfg`` may write into its folder (names or glob patterns), recorded in the
    manifest before anything is written."""
    from fasttomo.run.outputs import half_volume_names, volume_names

    names = ["reconstruct.log", "config.yaml", *volume_names(cfg), "checkpoints/last.pt", "checkpoints/step*.pt",
             "slices.png", "loss.png", "fsc_truth.png", "report.png", "metrics.json"]
    if cfg.evaluation.half_sets or cfg.output.half_volumes:
        names += [*half_volume_names(cfg, "volume_even"), *half_volume_names(cfg, "volume_odd"), "fsc_halfsets.png"]
    if cfg.pose.learn:
        names += ["poses.xf", "poses.tlt", "poses.aln"]
    if cfg.logging.tensorboard:
        names.append("tb/events.out.tfevents.*")
    return names


def slices_png(path: Path, volume: np.ndarray, pixel_size: float, truth: np.ndarray | None, overwrite: bool):
    """slices.png: the central slices in three planes with a scale bar and a colour bar; a second
    row shows the ground truth (report.slice_panel). Returns the image."""
    from fasttomo.quality.report import save_png, slice_panel

    img = slice_panel(volume, pixel_size, truth)
    save_png(path, img, overwrite=overwrite)
    return img


def _write_text(path: Path, text: str, overwrite: bool) -> None:
    from fasttomo.data.io.atomic import atomic_write

    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), overwrite=overwrite)


def run_reconstruction(cfg: Config) -> dict:
    """Run one reconstruction described by ``cfg`` (cfg.output.dir must be set); returns metrics."""
    from fasttomo.data.load import load_tiltseries
    from fasttomo.run.outputs import export_field, save_checkpoint_file, write_pose_files
    from fasttomo.quality.scoring import attach_truth, split_holdout
    from fasttomo.run.preflight import check_free_space, memory_problem
    from fasttomo.run.resume import refuse_immutable, warn_changes
    from fasttomo.run.folder import RunFolder
    from fasttomo.run.stop import RunInterrupted, StopRequests, signal_name
    from fasttomo.train.checkpoint import find_checkpoint, load_checkpoint
    from fasttomo.train.distributed import (broadcast_object, destroy_distributed, dist_info, init_distributed,
                                            is_distributed)
    from fasttomo.train.guard import DivergenceError

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
    if wants_cuda and torch.cuda.is_available():  # (no CUDA: build reports runtime.device=cuda)
        from fasttomo.run.build import resolve_device
        from fasttomo.kernels import prewarm

        device = resolve_device(cfg.runtime.device, local_rank)
        prewarm.warm_device(device.index if device.index is not None else torch.cuda.current_device())
    out_dir = Path(broadcast_object(str(Path(cfg.output.dir).resolve())))
    main = rank == 0

    # a resumed run: read and verify the checkpoint before the folder is touched (every rank reads it)
    resume_path, resume_state = None, None
    if cfg.resume:
        resume_path = find_checkpoint(cfg.resume)
        resume_state = load_checkpoint(resume_path, map_location="cpu")
        if isinstance(resume_state.get("config"), dict):
            resume_state["config"] = upgrade(resume_state["config"])  # an older fasttomo's keys, today's names
            refuse_immutable(resume_state["config"], to_dict(cfg), str(resume_path))
            warn_changes(resume_state["config"], to_dict(cfg), str(resume_path))

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
    ranks = quiet_other_ranks(rank, cfg.logging.all_ranks) if world > 1 else None
    try:
        with stop:
            ts = load_tiltseries(cfg.data)
            if cfg.evaluation.truth:
                attach_truth(ts, cfg.evaluation.truth, cfg.data.thickness)
            ts, hold = split_holdout(ts, cfg.evaluation.holdout_views)
            if cfg.model.kind == "sirt":
                return _sirt_run(cfg, ts, hold, out_dir, folder, main, rank, world, local_rank, t0, joined)
            problem = broadcast_object(memory_problem(cfg, ts, local_rank) if main else None)  # too big: refused
            if problem:
                raise ConfigError(problem)
            comps, trainer = _build_trainer(cfg, ts, out_dir, rank, world, local_rank)
            cfg = dc_replace(cfg, optim=comps.cfg.optim)  # optim.steps=None resolved from the data (build.py)
            stop.device = comps.device
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
            t_fit = time.perf_counter()
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
            attrs = {"run": cfg.name, "config": to_dict(cfg), "units": "input stack units per voxel"}
            t_export = time.perf_counter()
            with trainer.exported_field() as exported_step:  # slab by slab into volume.mrc (outputs.py)
                volume, written, failed, finite = export_field(trainer, cfg, out_dir, ts.pixel_size, attrs)
            t_export = time.perf_counter() - t_export
            finite = broadcast_object(finite)  # every rank takes the same branches (half sets are collective)
            state = trainer.state_dict()  # collective (gathers every rank's RNG states); rank 0 writes
            metrics: dict = {}
            if main:
                ckpt_path, ckpt_err = save_checkpoint_file(out_dir / "checkpoints" / "last.pt", state)
                if ckpt_err:
                    failed["checkpoints/last.pt"] = ckpt_err
                else:
                    written["checkpoints/last.pt"] = ckpt_path
                metrics = _summarize(cfg, comps, trainer, steps_before, trainer.train_seconds - seconds_before, volume)
                metrics["timeline"] = {**_timeline(t0, t_fit, trainer), "export_s": round(t_export, 3)}
                metrics["status"] = ("interrupted" if interrupted else "finished") if finite else "diverged"
                metrics["guard"] = trainer.guard.summary()
                if cfg.resume:
                    metrics["resumed_from"] = {"checkpoint": str(resume_path), "step": steps_before}
                _field_scores(cfg, comps, trainer, ts, hold, exported_step, metrics)
                if "poses" in metrics:
                    write_pose_files(out_dir, metrics["poses"], ts, written, failed)
            _finish(cfg, ts, out_dir, volume, metrics, written, failed, t0, rank, world, local_rank,
                    half_sets=finite and not interrupted, pictures=finite)
            problem = broadcast_object(_write_problem(out_dir, cfg, failed, written, volume, state, ts, finite,
                                                      resume_cmd) if main else None)
            if problem:
                raise problem[0](problem[1])
        if interrupted:
            name = signal_name(stop.signum)
            raise RunInterrupted(stop.signum, f"stopped at step {trainer.step} of {cfg.optim.steps} ({name}); the "
                                 f"volume so far and a checkpoint are in {out_dir}; resume with: {resume_cmd}")
        if stop.signum is not None:
            log.info("%s arrived after the last step; the run finished", signal_name(stop.signum))
        if main:
            folder.finish("finished", step=trainer.step)
            _closing_summary(cfg, out_dir, metrics)
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
        if ranks is not None:
            restore_ranks(ranks)
        if handler is not None:
            logging.getLogger("fasttomo").removeHandler(handler)
            handler.close()


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by input, config, the output folder or a checkpoint: reported as one clear
    line (exit code 2), no traceback."""
    from fasttomo.data.specimen import PhantomError
    from fasttomo.data.tiltseries import TiltSeriesError
    from fasttomo.kernels.dispatch import KernelUnavailableError
    from fasttomo.train.checkpoint import CheckpointError

    return (ConfigError, TiltSeriesError, OutputExistsError, OutputFolderError, CheckpointError,
            KernelUnavailableError, FileNotFoundError, PhantomError)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if not text or type(exc).__module__ == "builtins" else text


def _log_failure(exc: BaseException, handler: logging.Handler | None) -> None:
    """The run's error into reconstruct.log (and the console): one line for the errors fasttomo
    explains (the entry point then does not repeat it), the traceback -- into the file only, the
    entry point prints it -- for anything else."""
    from fasttomo.run.outputs import OutputWriteError
    from fasttomo.run.stop import RunInterrupted
    from fasttomo.train.guard import DivergenceError

    known = (*user_errors(), DivergenceError, OutputWriteError, RunInterrupted)
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
    from fasttomo.run.outputs import OutputWriteError, rescue, write_failure_message
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


# --------------------------------------------------------------------------------------- field
def _build_trainer(cfg: Config, ts, out_dir: Path | None, rank: int, world: int, local_rank: int):
    """(Components, Trainer) for a field on ``ts``; with a ground truth and evaluation.curve_every
    the trainer scores the field against it along the way (the quality-against-fit-time curve)."""
    from fasttomo.run.build import build, make_trainer

    comps = build(cfg, ts, rank=rank, world_size=world, local_rank=local_rank)
    trainer = make_trainer(comps, out_dir)
    if ts.ground_truth is not None and cfg.evaluation.curve_every:
        trainer.probe = _truth_probe(trainer, ts)
    return comps, trainer


def _truth_probe(trainer, ts):
    """The current field against the ground truth (Pearson only; collective under DDP, scores on
    rank 0)."""
    from fasttomo.quality.metrics import volume_metrics

    def probe() -> dict:
        volume = trainer.export_volume()
        if volume is None:
            return {}
        return {k: v for k, v in volume_metrics(volume, ts.ground_truth).items() if k.startswith("pearson")}
    return probe


def _field_scores(cfg: Config, comps, trainer, ts, hold, exported_step: int, metrics: dict) -> None:
    """The field's evaluation entries of metrics.json (rank 0): exported step, best validation,
    early stop, the quality curve, learned poses against a truth file, held-out views."""
    from fasttomo.data.io.alignment import view_poses
    from fasttomo.methods.field.projector import predict_views
    from fasttomo.quality.scoring import holdout_scores, view_residuals

    metrics["exported_step"] = exported_step
    if trainer.best is not None:
        metrics["best_val"] = {"step": trainer.best["step"], "loss": trainer.best["val"]}
    if trainer.stopped_early:
        metrics["stopped_early_at"] = trainer.step
    if trainer.curve:
        metrics["curve"] = trainer.curve
    if cfg.evaluation.true_poses and "poses" in metrics:
        metrics["pose_errors"] = _pose_errors(metrics["poses"], cfg.evaluation.true_poses, ts)
        log.info("poses against %s: shifts %.3f px RMS (%.3f without the z-translation gauge), rotations %.4f "
                 "degrees RMS", cfg.evaluation.true_poses, metrics["pose_errors"]["shift_rms_px"],
                 metrics["pose_errors"]["shift_rms_px_gauge_free"], metrics["pose_errors"]["rotation_rms_deg"])
    if hold is not None:
        with trainer.exported_field():
            pred = predict_views(comps.projector, hold.angles, initial=view_poses(ts.metadata, hold.view_numbers))
        bg = comps.projector.intensity.describe(comps.sampler.scale)["background"] if comps.projector.intensity else 0.0
        metrics["holdout"] = holdout_scores(hold, pred * comps.sampler.scale + bg)
        log.info("held-out views %s: reprojection Pearson %s", hold.view_numbers,
                 ", ".join(f"{v:.4f}" for v in metrics["holdout"]["pearson"]))
    if cfg.evaluation.view_residuals:
        with trainer.exported_field():
            vr = view_residuals(comps.projector, ts, comps.sampler.scale)
        metrics["view_residuals"] = vr
        worst = ", ".join(f"{v} ({vr['pearson'][vr['view_numbers'].index(v)]:.4f})" for v in vr["worst_views"])
        log.info("training views explained by the fit: Pearson %.4f on average, worst views %s", vr["pearson_mean"],
                 worst)


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


# --------------------------------------------------------------------------------------- the end of a run
def _finish(cfg: Config, ts, out_dir: Path, volume, metrics: dict, written: dict, failed: dict, t0: float,
            rank: int, world: int, local_rank: int, half_sets: bool = True, pictures: bool = True) -> None:
    """After the volume (and checkpoint): the half sets (collective, when asked and ``half_sets``),
    then on rank 0 the pictures (``pictures``), the wall time and metrics.json; what cannot be
    written is recorded in ``failed``."""
    from fasttomo.run.outputs import dumps

    half_curves = None
    if half_sets and (cfg.evaluation.half_sets or cfg.output.half_volumes):
        halves, half_curves = _half_sets(cfg, ts, out_dir, rank, world, local_rank, written, failed)
        if rank == 0:
            metrics["half_sets"] = halves
    if rank != 0:
        return
    metrics["wall_seconds"] = time.perf_counter() - t0  # again below, with the pictures
    if pictures:
        _pictures(cfg, out_dir, volume, ts, metrics, failed, half_curves)
    metrics["wall_seconds"] = time.perf_counter() - t0
    if "timeline" in metrics:
        from fasttomo import timeline

        metrics["timeline"]["process_to_end_s"] = round(timeline.since_start(), 3)
        metrics["timeline"]["peak_gpu_bytes"] = (torch.cuda.max_memory_allocated() if torch.cuda.is_initialized()
                                                 else None)
    try:
        _write_text(out_dir / "metrics.json", dumps(metrics), True)
    except OSError as exc:
        failed["metrics.json"] = exc.strerror or str(exc)


# --------------------------------------------------------------------------------------- pictures
def _pictures(cfg: Config, out_dir: Path, volume: np.ndarray, ts, metrics: dict, failed: dict,
              half_curves: dict | None = None) -> None:
    """Scores against a ground truth (into ``metrics``), slices.png, fsc_truth.png, loss.png and
    report.png, which holds them all (and the half-set FSC, the quality curve and the learned
    poses when they exist) and goes into TensorBoard too (rank 0); a picture that cannot be
    written is recorded in ``failed``."""
    from fasttomo.quality.plots import fsc_plot
    from fasttomo.quality.report import add_to_tensorboard, report_image, save_png
    from fasttomo.quality.scoring import truth_scores

    curves = None
    if ts.ground_truth is not None and volume.shape == ts.ground_truth.shape:
        t_score = time.perf_counter()
        report, curves = truth_scores(volume, ts.ground_truth, ts.pixel_size, _tilt_range(ts))
        metrics.update(report)
        metrics.setdefault("timeline", {})["scoring_s"] = round(time.perf_counter() - t_score, 3)
    truth = ts.ground_truth if metrics.get("pearson_global") else None
    jobs = [("slices.png", lambda: slices_png(out_dir / "slices.png", volume, ts.pixel_size, truth, True)),
            ("loss.png", lambda: _loss_plot(out_dir / "loss.png", metrics, True))]
    if curves is not None:
        jobs.append(("fsc_truth.png", lambda: fsc_plot(out_dir / "fsc_truth.png", curves, "FSC of the reconstruction "
                                                       "against the ground truth", _tilt_range(ts), overwrite=True)))
    for name, job in jobs:
        try:
            job()
        except OSError as exc:
            failed[name] = exc.strerror or str(exc)
    title = (f"fasttomo{'' if cfg.name == 'fasttomo' else ' ' + cfg.name}: {_shown_path(out_dir)}"
             + (" (SIRT)" if cfg.model.kind == "sirt" else ""))
    try:
        img = report_image(volume, ts.pixel_size, metrics, title, truth, curves, half_curves, _tilt_range(ts))
    except Exception as exc:  # noqa: BLE001 - a picture must never cost the run its results
        log.warning("could not draw report.png (%s: %s); the other results are written", type(exc).__name__, exc)
        return
    try:
        save_png(out_dir / "report.png", img)
    except OSError as exc:
        failed["report.png"] = exc.strerror or str(exc)
    if cfg.logging.tensorboard:
        try:
            add_to_tensorboard(out_dir / "tb", "report", img, int(metrics.get("steps") or 0))
        except OSError as exc:
            log.warning("could not add report.png to TensorBoard (%s)", exc.strerror or exc)


def _shown_path(path: Path) -> str:
    """``path`` relative to the working folder when it lies inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _loss_plot(path: Path, metrics: dict, overwrite: bool) -> None:
    """loss.png: the training loss and the validation loss (held-out pixels) against the step."""
    from fasttomo.quality.plots import line_plot
    from fasttomo.quality.report import loss_series

    series = loss_series(metrics)
    if series:
        line_plot(path, series, "Loss curves", "step", "loss", log_y=True, legend="below", overwrite=overwrite)


def _closing_summary(cfg: Config, out_dir: Path, metrics: dict) -> None:
    """The last lines of a finished run: folder, files and sizes, time, speed, quality, how to look."""
    from fasttomo.quality.report import summary_lines

    try:
        lines = summary_lines(out_dir, metrics, cfg.logging.tensorboard)
    except OSError as exc:  # the folder vanished or cannot be listed: say so, the run itself is done
        lines = [f"run folder: {out_dir} (cannot be listed: {exc.strerror or exc})"]
    log.info("finished.\n%s", "\n".join(lines))


def _tilt_range(ts) -> tuple[float, float]:
    a = np.asarray(ts.angles, dtype=np.float64)
    return float(a.min()), float(a.max())


# --------------------------------------------------------------------------------------- SIRT
def _sirt_run(cfg: Config, ts, hold, out_dir: Path, folder, main: bool, rank: int, world: int, local_rank: int,
              t0: float, joined: bool) -> dict:
    """model=sirt: the conventional baseline on rank 0 (the other ranks wait), then the same
    files as a field's run, without a checkpoint."""
    from fasttomo.run.build import reconstruction_box, resolve_device
    from fasttomo.methods.sirt.method import run_sirt
    from fasttomo.run.outputs import OutputWriteError, write_volumes
    from fasttomo.train.distributed import broadcast_object, destroy_distributed

    metrics, volume, written, failed = {}, None, {}, {}
    if main:
        _write_text(out_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False), True)
        metrics, volume = run_sirt(cfg, ts, reconstruction_box(cfg, ts), resolve_device(cfg.runtime.device, local_rank),
                                   hold)
        attrs = {"run": cfg.name, "config": to_dict(cfg), "units": "input stack units per voxel"}
        written, failed = write_volumes(out_dir, volume, cfg, ts.pixel_size, attrs)
        metrics["status"] = "finished"
    _finish(cfg, ts, out_dir, volume, metrics, written, failed, t0, rank, world, local_rank)
    problem = broadcast_object(f"could not write {', '.join(f'{k} ({v})' for k, v in failed.items())} in {out_dir}; "
                               f"written: {', '.join(written) or 'nothing'}" if main and failed else None)
    if problem:
        raise OutputWriteError(problem)
    if main:
        folder.finish("finished", step=cfg.model.iterations)
        _closing_summary(cfg, out_dir, metrics)
    if joined:
        destroy_distributed()
    return metrics


# --------------------------------------------------------------------------------------- half sets
def _half_sets(cfg: Config, ts, out_dir: Path, rank: int, world: int, local_rank: int, written: dict,
               failed: dict) -> tuple[dict | None, dict | None]:
    """(FSC report, FSC curves) of the even and the odd views (in tilt order) reconstructed apart, their volumes written as
    volume_even.* / volume_odd.*, and their FSC (rank 0). Each half gets its own seed, so the two
    share no initial noise that the data does not overwrite. Collective under DDP."""
    import dataclasses as dc

    from fasttomo.quality.plots import fsc_plot
    from fasttomo.run.outputs import write_half_volume
    from fasttomo.quality.scoring import pair_fsc

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
                from fasttomo.run.build import reconstruction_box, resolve_device
                from fasttomo.methods.sirt.method import run_sirt

                _, vols[name] = run_sirt(hcfg, half, reconstruction_box(hcfg, half),
                                         resolve_device(cfg.runtime.device, local_rank), None)
        else:
            _, trainer = _build_trainer(hcfg, half, None, rank, world, local_rank)
            trainer.fit()
            with trainer.exported_field():
                vols[name] = trainer.export_volume(cfg.output.volume_shape)  # collective
        if rank == 0:
            w, f = write_half_volume(out_dir, vols[name], cfg, ts.pixel_size, name)
            written.update(w)
            failed.update(f)
    if rank != 0:
        return None, None
    res, curves = pair_fsc(vols["even"], vols["odd"], ts.pixel_size, _tilt_range(ts))
    try:
        fsc_plot(out_dir / "fsc_halfsets.png", curves, "FSC of the even-view and odd-view reconstructions",
                 _tilt_range(ts), overwrite=True)
    except OSError as exc:
        failed["fsc_halfsets.png"] = exc.strerror or str(exc)
    log.info("half sets: FSC 0.143 at %s, 0.5 at %s", _res(res, "fsc0143"), _res(res, "fsc05"))
    return res, curves


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
    numbers = list(ts.metadata.get("view_numbers") or range(1, ts.n_tilts + 1))
    meta = {**ts.metadata, "view_numbers": [numbers[i] for i in keep]}  # a file alignment follows its views
    return TiltSeries(stack=sub(ts.stack), angles=ts.angles[keep], pixel_size=ts.pixel_size, source=ts.source,
                      metadata=meta, ground_truth=ts.ground_truth, valid=sub(ts.valid))


def _timeline(t0: float, t_fit: float, trainer) -> dict:
    """Where a run's time goes outside the steps (seconds; ``process_to_*`` count from the moment
    the process started, interpreter and imports included): run start, training start, the end of
    the first step (compilation, autotuning, CUDA-graph capture), validation and image time inside
    training; ``process_to_end_s`` (added when metrics.json is written) closes it."""
    from fasttomo import timeline

    tm = trainer.timing
    first = tm["first_step_done"]
    return {
        "process_to_run_start_s": round(timeline.since_start(t0), 3),
        "process_to_training_start_s": round(timeline.since_start(t_fit), 3),
        "process_to_first_step_s": round(timeline.since_start(first), 3) if first else None,
        "first_step_s": round(first - t_fit, 3) if first else None,
        "validation_s": round(tm["validation_seconds"], 3),
        "images_s": round(tm["image_seconds"], 3),
        "graph_capture_s": round(trainer.graphed.capture_seconds, 3) if trainer.graphed is not None else None,
        "process_start_exact": timeline.EXACT,
        "torch_dynamo_imported": "torch._dynamo" in sys.modules,  # seconds of start-up when true
    }


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
