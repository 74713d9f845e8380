"""The neural field behind the run's method interface (fasttomo.methods.base.Method): its parts
built from the config (run/build.py), the Trainer with the run's stop requests and the quality
probe as hooks, the divergence hint, its summary and evaluation entries of metrics.json."""

from __future__ import annotations

import contextlib

import dataclasses
import gc
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fasttomo import timeline
from fasttomo.config import Config, ConfigError
from fasttomo.data.io.alignment import view_poses
from fasttomo.data.io.poses import read_poses_json
from fasttomo.geometry.alignment import pose_errors
from fasttomo.kernels import dispatch
from fasttomo.methods.field.projector import predict_views
from fasttomo.quality.metrics import volume_metrics
from fasttomo.quality.report import number_text
from fasttomo.quality.scoring import holdout_scores, view_residuals
from fasttomo.run.build import build, make_trainer
from fasttomo.run.outputs import VolumeFiles, export_field, field_slabs, save_checkpoint_file
from fasttomo.run.place import Place
from fasttomo.run.preflight import check_free_space, memory_problem
from fasttomo.train.distributed import broadcast_object
from fasttomo.train.guard import DivergenceError

log = logging.getLogger("fasttomo")


class FieldMethod:
    """A field (kplanes_tilted, voxel) fitted by the Trainer. ``stop`` (the run's StopRequests)
    marks the run's own fit: it gets the phases, the log line and the divergence hint; a half set's
    fit (no ``stop``) trains quietly."""

    label = ""

    def __init__(self, cfg: Config, ts, hold, place: Place, stop=None):
        self.cfg, self.ts, self.hold, self.place, self.stop = cfg, ts, hold, place, stop
        if stop is not None:  # the run's own fit: a model too big for the memory is never allocated
            problem = broadcast_object(memory_problem(cfg, ts, place.local_rank) if place.main else None)
            if problem:
                raise ConfigError(problem)
        self.comps = build(cfg, ts, rank=place.rank, world_size=place.world, local_rank=place.local_rank)
        # optim.steps=None and loss.plane_tv=None: chosen by build
        self.cfg = cfg = dataclasses.replace(cfg, optim=self.comps.cfg.optim, loss=self.comps.cfg.loss)
        probe = truth_probe(ts) if ts.ground_truth is not None and cfg.evaluation.curve_every else None
        if stop is not None:
            stop.device = self.comps.device
        self.trainer = make_trainer(self.comps, place.out_dir, stop=stop, probe=probe)
        self.steps_before, self.seconds_before = 0, 0.0
        self.resumed_from: dict | None = None
        self._t_fit = time.perf_counter()
        self._export_s = 0.0
        self.volume_on_device = None
        """The exported volume on the GPU for the scoring against a truth (export_files), or None."""
        self._peak_rss: dict[str, int | None] = {}  # the process's peak resident memory at phase borders

    @property
    def step(self) -> int:
        return self.trainer.step if self.trainer is not None else self._released_step

    def release(self) -> None:
        """After the export, the checkpoint's state and the scores: the trainer and the built parts
        go (the data, the guard's snapshots and the step's buffers on the device: the half sets'
        fits need that memory); the step count stays. The run's checkpoint state keeps the
        parameters and the optimizer's moments for the rescue of a failed write."""
        self._released_step = self.trainer.step
        self.trainer = self.comps = None
        gc.collect()  # the trainer's reference cycles, so that its device tensors go now

    def load(self, state: dict, source: str) -> None:
        self.trainer.load_state_dict(state, source=source)
        self.resumed_from = {"checkpoint": source, "step": self.trainer.step}
        log.info("resumed from %s at step %d of %d", source, self.trainer.step, self.cfg.optim.steps)

    def check_space(self, out_dir) -> None:
        check_free_space(out_dir, self.cfg, self.comps, self.trainer.step)

    def fit(self) -> None:
        trainer, stop = self.trainer, self.stop
        self.steps_before, self.seconds_before = trainer.step, trainer.train_seconds
        if stop is None:
            trainer.fit()
            return
        stop.phase = "training"
        log.info("training from step %d to %d, validation every %d steps (Ctrl-C or SIGTERM: stop after the current "
                 "step and save)", trainer.step, self.cfg.optim.steps, trainer.cfg.val_every)
        self._t_fit = time.perf_counter()
        self._peak_rss["training_start"] = timeline.peak_rss_bytes()
        try:
            trainer.fit()
        except DivergenceError as exc:  # the guard rolled back to the last good state: keep it if it is new
            stop.phase = "saving"
            raise DivergenceError(f"{exc}{self._divergence_hint()}") from None
        stop.phase = "saving"

    def _divergence_hint(self) -> str:
        """Saves the last good state when it is newer than the start; says how to continue."""

        good = self.trainer.guard.rolled_back_to
        hint = " Nothing was learned before the divergence: run again with lower learning rates."
        if good is not None and good > self.steps_before:
            self.trainer.guard.reset_for_continuation()  # the continuation's rates are the user's, its rollbacks new
            state = self.trainer.state_dict()  # collective
            main = self.place.rank == 0
            saved = save_checkpoint_file(self.place.out_dir / "checkpoints" / "last.pt", state)[0] if main else None
            if saved:
                hint = (f" The last good state (step {good}) was saved to {saved}; continue from it with lower "
                        f"learning rates, e.g. fasttomo-reconstruct resume={saved} optim.lr_grids=<lower> "
                        "optim.steps=<more>.")
        return hint

    def export(self) -> tuple[np.ndarray | None, int]:
        with self.trainer.exported_field() as exported_step:
            return self.trainer.export_volume(self.cfg.output.volume_shape), exported_step  # collective

    @contextlib.contextmanager
    def volume_slabs(self, planes_of):
        """(shape, Z planes a slab, slabs) of the exported field's volume, slab by slab on the
        device (fasttomo.run.outputs.field_slabs); ``planes_of(shape, device)`` sizes the slabs.
        One process."""
        t = self.trainer
        shape = tuple(self.cfg.output.volume_shape or t.projector.box.shape_zyx)
        planes = planes_of(shape, t.device)
        with t.exported_field():
            yield shape, planes, field_slabs(t.projector, t.sampler.scale, shape, planes)

    def export_files(self, out_dir: Path, files: VolumeFiles):
        """(volume, step, written, failed, finite): the volume evaluated and written as it goes
        (slab by slab into volume.mrc, fasttomo.run.outputs.export_field). Collective."""
        t_export = time.perf_counter()
        self._peak_rss["export_start"] = timeline.peak_rss_bytes()
        halves = self.cfg.evaluation.half_sets or self.cfg.output.half_volumes  # trained before the scoring
        with self.trainer.exported_field() as exported_step:
            volume, written, failed, finite, self.volume_on_device = export_field(
                self.trainer, self.cfg, out_dir, files,
                None if halves else self.ts.ground_truth)
        self._export_s = time.perf_counter() - t_export
        self._peak_rss["export_end"] = timeline.peak_rss_bytes()
        return volume, exported_step, written, failed, finite

    def state(self) -> dict | None:
        return self.trainer.state_dict()  # collective (gathers every rank's RNG states)

    def summary(self, volume: np.ndarray) -> dict:
        """Speeds are of this process's training (after the resume, if any); ``train_seconds`` is
        the total over the whole run."""
        m = _summarize(self, volume)
        m["timeline"] = {**_timeline(self.place.t0, self._t_fit, self.trainer), "export_s": round(self._export_s, 3),
                         "peak_host_bytes_at": dict(self._peak_rss)}
        m["guard"] = self.trainer.guard.summary()
        if self.resumed_from is not None:
            m["resumed_from"] = {"checkpoint": self.resumed_from["checkpoint"], "step": self.steps_before}
        return m

    def scores(self, metrics: dict, exported_step: int) -> None:
        """The field's evaluation entries of metrics.json (rank 0): exported step, best validation,
        early stop, the quality curve, learned poses against a truth file, held-out views, the
        training views' residuals."""
        trainer, cfg = self.trainer, self.cfg
        metrics["exported_step"] = exported_step
        if trainer.best is not None:
            metrics["best_val"] = {"step": trainer.best["step"], "loss": trainer.best["val"]}
        if trainer.stopped_early:
            metrics["stopped_early_at"] = trainer.step
        if trainer.curve:
            metrics["curve"] = trainer.curve
        if cfg.evaluation.true_poses and "poses" in metrics:
            metrics["pose_errors"] = _pose_errors(metrics["poses"], cfg.evaluation.true_poses, self.ts)
            pe = metrics["pose_errors"]
            log.info("poses against %s: shifts %s px RMS (%s without the z-translation gauge), rotations %s "
                     "degrees RMS", cfg.evaluation.true_poses, number_text(pe["shift_rms_px"], ".3f"),
                     number_text(pe["shift_rms_px_gauge_free"], ".3f"), number_text(pe["rotation_rms_deg"], ".4f"))
        if self.hold is not None:
            metrics["holdout"] = self._holdout()
        if cfg.evaluation.view_residuals:
            metrics["view_residuals"] = self._view_residuals()

    def _holdout(self) -> dict:
        comps, hold = self.comps, self.hold
        with self.trainer.exported_field():
            pred = predict_views(comps.projector, hold.angles, initial=view_poses(self.ts.metadata, hold.view_numbers))
        bg = comps.projector.intensity.describe(comps.sampler.scale)["background"] if comps.projector.intensity else 0.0
        scores = holdout_scores(hold, pred * comps.sampler.scale + bg)
        log.info("held-out views %s: reprojection Pearson %s", hold.view_numbers,
                 ", ".join(number_text(v) for v in scores["pearson"]))
        return scores

    def _view_residuals(self) -> dict:
        with self.trainer.exported_field():
            vr = view_residuals(self.comps.projector, self.ts, self.comps.sampler.scale)
        worst = ", ".join(f"{v} ({number_text(vr['pearson'][vr['view_numbers'].index(v)])})"
                          for v in vr["worst_views"])
        log.info("training views explained by the fit: Pearson %s on average, worst views %s",
                 number_text(vr["pearson_mean"]), worst)
        return vr


def truth_probe(ts):
    """The Trainer's probe: the current field against the ground truth (Pearson only; collective
    under DDP, scores on rank 0)."""

    def probe(trainer) -> dict:
        volume = trainer.export_volume()
        if volume is None:
            return {}
        return {k: v for k, v in volume_metrics(volume, ts.ground_truth).items() if k.startswith("pearson")}
    return probe


def _pose_errors(learned: dict, path: str, ts) -> dict:
    """Learned poses against a poses file, matched by 1-based view number."""

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


def _timeline(t0: float, t_fit: float, trainer) -> dict:
    """Where a run's time goes outside the steps (seconds; ``process_to_*`` count from the moment
    the process started, interpreter and imports included): run start, training start, the end of
    the first step (compilation, autotuning, CUDA-graph capture), validation and image time inside
    training; ``process_to_end_s`` (added when metrics.json is written) closes it."""
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
        "compile_ahead": dispatch.compile_ahead_summary(),
        "process_start_exact": timeline.EXACT,
        "torch_dynamo_imported": "torch._dynamo" in sys.modules,  # seconds of start-up when true
    }


def _summarize(method: FieldMethod, volume: np.ndarray) -> dict:
    """The fit's entries of metrics.json: steps, time, speeds, losses, device, sizes, intensity,
    background estimate, learned poses."""
    comps, trainer = method.comps, method.trainer
    hist, val = trainer.history, trainer.val_history
    steps_done = trainer.step - method.steps_before
    seconds = trainer.train_seconds - method.seconds_before
    rays = steps_done * comps.cfg.sampler.batch_size * comps.world_size
    m = {
        "steps": trainer.step,
        "steps_planned": method.cfg.optim.steps,
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
        "precision": comps.precision.name + (" (decoder layers in training)" if comps.precision.decoder_only else ""),
        "world_size": comps.world_size,
        "cuda_graph": comps.cuda_graph,
        "n_parameters": sum(p.numel() for p in comps.projector.parameters()),
        "box_zyx": list(comps.box.shape_zyx),
        "volume_shape_zyx": list(volume.shape),
        "pixel_size_A": comps.ts.pixel_size,
        "intensity_scale": comps.sampler.scale,
        "plane_tv": comps.cfg.loss.plane_tv,  # as given, or as chosen from the data (loss.plane_tv=null)
    }
    if comps.projector.intensity is not None:
        m["intensity"] = comps.projector.intensity.describe(comps.sampler.scale)
    if "background_estimate" in comps.ts.metadata:
        m["background_estimate"] = comps.ts.metadata["background_estimate"]
    if method.cfg.pose.learn:
        m["poses"] = comps.projector.poses.describe()
    return m
