"""The training loop: one Trainer that owns precision, schedules, validation, logging and
checkpoints. It takes explicit parts (the projector, its optimizer, sampler, schedule, precision)
and its own small :class:`TrainerConfig`; it knows nothing about config files or how the parts
were built (fasttomo.run.build makes them and the Trainer: :func:`fasttomo.run.build.make_trainer`).

The step is sync-free: no ``.item()``, printing or host branching on device values except at log,
validation, image and checkpoint steps, and the divergence guard's check every guard.check_every
steps (train/guard.py: bad steps are skipped on the device, rollbacks happen at those checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch

from fasttomo.config import Config, GuardConfig
from fasttomo.logging import PROGRESS_LOGGER, RunLogger, progress_line
from fasttomo.train import checkpoint as ckpt
from fasttomo.train.distributed import all_reduce_mean
from fasttomo.train.guard import Guard

log = logging.getLogger("fasttomo.train")
progress_log = logging.getLogger(PROGRESS_LOGGER)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What the loop itself reads (from the optim, pose, logging, evaluation and guard groups)."""

    steps: int
    """optim.steps: the total step count."""
    grad_clip: float | None = None
    keep_best: bool = False
    early_stop: int = 0
    pose_start_step: int = 0
    """pose.start_step: the pose groups' learning rate is 0 before it."""
    log_every: int = 25
    val_every: int = 100
    image_every: int = 200
    tensorboard: bool = True
    progress: bool = True
    checkpoint_every: int = 0
    curve_every: int = 0
    """evaluation.curve_every: how often the probe (when set) scores the field."""
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)

    @classmethod
    def from_config(cls, cfg: Config) -> "TrainerConfig":
        o, lg = cfg.optim, cfg.logging
        return cls(steps=o.steps, grad_clip=o.grad_clip, keep_best=o.keep_best, early_stop=o.early_stop,
                   pose_start_step=getattr(cfg.pose, "start_step", 0), log_every=lg.log_every,
                   val_every=lg.val_every or auto_val_every(o.steps), image_every=lg.image_every,
                   tensorboard=lg.tensorboard,
                   progress=lg.progress, checkpoint_every=lg.checkpoint_every,
                   curve_every=cfg.evaluation.curve_every, guard=cfg.guard)


def auto_val_every(steps: int) -> int:
    """logging.val_every=null: a check every max(100, 50 x ceil(steps / 1250)) steps, so at most
    about 25 checks however long the run (at 2048^2 x 121 a check costs 3.3 training steps)."""
    return max(100, 50 * -(-int(steps) // 1250))


VAL_CHUNK_FLOATS = 1 << 28
"""Validation chunks hold at most this many decoder-input floats (1 GiB in fp32)."""
VAL_BUDGET_BATCHES = 8
"""A validation evaluates at most this many training batches of rays (Trainer.val_budget_rays)."""


class Trainer:
    def __init__(self, cfg: TrainerConfig, *, projector, sampler, optimizer: torch.optim.Optimizer,
                 base_lrs: list[float], schedule, precision, reg_generator: torch.Generator,
                 device: torch.device, model: torch.nn.Module | None = None, plateau=None,
                 out_dir: Path | None = None, rank: int = 0, world_size: int = 1, cuda_graph: bool = False,
                 run_config: dict | None = None, stop=None, probe=None, plane_tv_schedule=None):
        """``model``: the projector or its DDP wrapper (default: the projector); ``run_config``: the
        run's resolved config, stored in every checkpoint (a resume reads it); ``stop``: an object
        with ``should_stop(step) -> bool`` (fasttomo.run.stop.StopRequests), checked after every
        step; ``probe``: a callable (trainer) -> dict scoring the current field (e.g. against a
        ground truth), run every ``curve_every`` steps, its time not counted as fit time;
        ``plane_tv_schedule``: an object with ``factor(step, total) -> float`` multiplying the plane
        TV weight at each step (fasttomo.models.regularizers.PlaneTVSchedule; None: constant)."""
        self.cfg = cfg
        self.projector = projector
        self.model = model if model is not None else projector
        self.sampler = sampler
        self.optimizer = optimizer
        self.base_lrs = list(base_lrs)
        self.schedule = schedule
        self.plateau = plateau
        self.precision = precision
        self.reg_generator = reg_generator
        self.device = device
        self.rank, self.world_size = rank, world_size
        self.cuda_graph = cuda_graph
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.main = rank == 0
        self.step = 0
        self.history: list[list[float]] = []  # [step, train loss] at log steps
        self.val_history: list[list[float]] = []
        self.train_seconds = 0.0
        self.graphed = None  # GraphedStep, made at the first step when cuda_graph
        self.plane_tv_schedule = plane_tv_schedule
        self._plane_tv_scale = torch.ones((), device=device) if plane_tv_schedule is not None else None
        """The schedule's factor of the step, filled in place (a captured graph reads it)."""
        self._plane_tv_factor = 1.0
        self._slices: dict[str, torch.Tensor] | None = None  # central-plane points, see _slice_points
        self._subgrid_noise, self._s3im_noise = projector.noise_sizes(sampler.batch_size)
        self._plane_tv_in_forward = projector.plane_tv_in_forward()
        self.best: dict | None = None
        """keep_best: {"step", "val", "model"} of the lowest validation loss so far (model: a copy of
        the projector's state on its device)."""
        self._since_best = 0
        self.stopped_early = False
        self.probe = probe
        """Optional callable (trainer) -> dict scoring the current field (e.g. against a ground
        truth); with curve_every = N it runs every N steps and its time is not counted as fit time."""
        self.curve: list[dict] = []
        """The probe's results: {"step", "fit_seconds", **scores} (the quality-against-time curve)."""
        self.guard = Guard(cfg.guard, optimizer, device, world_size,
                           check_grads=not precision.scaler.is_enabled(),
                           base_lrs={g["name"]: b for g, b in zip(optimizer.param_groups, self.base_lrs)},
                           scaler=precision.scaler)
        self.stop = stop  # an object with should_stop(step) -> bool (fasttomo.run.stop.StopRequests), checked per step
        self.timing = {"first_step_done": None, "validation_seconds": 0.0, "image_seconds": 0.0}
        """Fixed costs inside fit (perf_counter of the first step's end, synchronized once; seconds
        spent validating and rendering TensorBoard images), reported in metrics.json's timeline."""
        self.phase_mark = None
        """Optional callable(name) called inside the step body at 'forward', 'backward', 'optimizer'
        and 'done' (scripts/bench_step.py times the phases with CUDA events; eager steps only)."""
        self.checkpointer = ckpt.Checkpointer(
            {"model": projector, "optimizer": ckpt.PortableOptimizer(optimizer), "scaler": precision.scaler,
             "plateau": plateau, "sampler": sampler, "rng": ckpt.RankRNG(device, reg_generator, rank),
             "guard": self.guard},
            optional=("plateau", "guard"), extra={"config": run_config} if run_config is not None else None)

    # ------------------------------------------------------------------ one step
    def _set_lr(self, step: int) -> None:
        f = self.schedule.factor(step, self.plateau) * self.guard.lr_scale  # lowered by guard rollbacks
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            g = f
            if group["name"].startswith("pose_") and step < self.cfg.pose_start_step:
                g = 0.0
            if torch.is_tensor(group["lr"]):  # captured step: the graph reads this tensor
                group["lr"].fill_(base * g)
            else:
                group["lr"] = base * g
        if self._plane_tv_scale is not None:
            f = self.plane_tv_schedule.factor(step, self.cfg.steps)
            if f != self._plane_tv_factor:  # no fill (a kernel on a GPU) while the factor holds
                self._plane_tv_scale.fill_(f)
                self._plane_tv_factor = f

    def train_step(self, batch) -> tuple[torch.Tensor, dict]:
        """One optimizer step on ``batch``; returns (loss, parts) as device tensors (no sync)."""
        # drawn here, outside a captured graph, from the one regularizer stream (eager and graph alike):
        # the volume-TV sub-grid's numbers, then S3IM's random orders
        n = self._subgrid_noise + self._s3im_noise
        noise = torch.rand(n, generator=self.reg_generator, device=self.device) if n else None
        if self.cuda_graph:
            if self.graphed is None:
                from fasttomo.train.cuda_graph import GraphedStep

                self.graphed = GraphedStep(self._step_body, self.optimizer, self.device)
            return self.graphed(batch, noise)
        return self._step_body(batch, noise)

    def _step_body(self, batch, noise) -> tuple[torch.Tensor, dict]:
        """Forward, backward and update: the eager step, and what a CUDA graph captures."""
        mark = self.phase_mark
        if mark:
            mark("forward")
        self.optimizer.zero_grad(set_to_none=True)
        k = self._subgrid_noise
        # the volume TV's sub-grid rides along with the rays: one field evaluation per step
        tv_points = self.projector.tv_points(self.reg_generator, noise[:k] if k else None)
        with self.precision.autocast():
            if tv_points is None and not self._plane_tv_in_forward:
                pred, tv_density, plane_tv = self.model(batch.tilt, batch.row, batch.col), None, None
            else:
                pred, tv_density, plane_tv = self.model(batch.tilt, batch.row, batch.col, tv_points,
                                                        plane_tv=self._plane_tv_in_forward)
        data_parts = self.projector.data_loss(pred, batch, noise[k:] if self._s3im_noise else None)
        with self.precision.autocast():
            reg, parts = self.projector.regularization(self.reg_generator, noise[:k] if k else None, tv_density,
                                                       self._plane_tv_scale, plane_tv)
        loss = reg.float()
        for v in data_parts.values():  # no python sum(): its start value 0 would cost a kernel
            loss = v + loss
        if mark:
            mark("backward")
        self.precision.backward(loss)
        if mark:
            mark("optimizer")
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        skip = self.guard.inspect(loss, params)  # device flag: a non-finite or exploding step changes nothing
        self.precision.step(self.optimizer, params, self.cfg.grad_clip, skip=skip,
                         grad_norm=self.guard.grad_norm if skip is not None and self.guard.check_grads else None)
        if mark:
            mark("done")
        return loss.detach(), {**{k: v.detach() for k, v in data_parts.items()},
                               **{k: v.detach() for k, v in parts.items()}}

    # ------------------------------------------------------------------ evaluation
    def val_chunk_rays(self) -> int:
        """Rays per validation chunk: the training batch times k (1 to 16), the most whose
        decoder inputs (rays x samples x field features, fp32, no autograd) stay within
        VAL_CHUNK_FLOATS. At 128^3 on an H200 a validation takes 11.9 ms in training-batch chunks
        and 3.6 ms in 16x bigger ones, the same loss to float rounding (benchmarks/README.md); the
        flagship (1152 features) keeps its training-batch chunks."""
        feats = max(1, int(getattr(self.projector.field, "n_features", 1)))
        per_batch = self.sampler.batch_size * max(1, int(getattr(self.projector, "samples_per_ray", 1))) * feats
        return self.sampler.batch_size * max(1, min(16, VAL_CHUNK_FLOATS // per_batch))

    def val_budget_rays(self) -> int:
        """Rays one validation evaluates at most: VAL_BUDGET_BATCHES training batches. At 2048^2 on
        an H200 a check of 16 batches (fp32, no autograd) cost about 6.3 bf16 training steps, 6.4 %
        of the training time at one check every logging.val_every (100) steps; 8 batches halve
        that, whatever the series' size;
        a larger validation set is evaluated on an even sample of it (data/sampler.py
        ``val_sample``). The embedded phantom's and the 128^3 cases' sets are smaller than that,
        so they are still evaluated whole."""
        return VAL_BUDGET_BATCHES * self.sampler.batch_size

    @torch.no_grad()
    def validate(self) -> float:
        """Mean validation loss in fp32 (no autocast) over the validation set (an even sample of
        at most :meth:`val_budget_rays` of it)."""
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        weight = torch.zeros((), device=self.device, dtype=torch.float64)
        for batch in self.sampler.val_batches(self.val_chunk_rays(), self.val_budget_rays()):
            pred = self.projector(batch.tilt, batch.row, batch.col)
            total += self.projector.pixel_errors(pred, batch).sum().double()
            weight += batch.weight.sum().double()
        return float(total / weight.clamp_min(1.0)) if self.sampler.n_val else float("nan")

    def _track_best(self, v: float) -> bool:
        """Keep the field of the lowest validation loss (optim.keep_best) and count the checks
        since it (optim.early_stop); returns True when the run should stop early. The loss is
        averaged over the ranks first, so every rank decides alike."""
        o = self.cfg
        if not (o.keep_best or o.early_stop) or not math.isfinite(v):
            return False
        v = float(all_reduce_mean(torch.tensor(v, dtype=torch.float64, device=self.device)))
        if self.best is None or v < self.best["val"]:
            model = ({k: t.detach().clone() for k, t in self.projector.state_dict().items()}
                     if o.keep_best else None)
            self.best = {"step": self.step, "val": v, "model": model}
            self._since_best = 0
            return False
        self._since_best += 1
        return bool(o.early_stop) and self._since_best >= o.early_stop

    @contextlib.contextmanager
    def exported_field(self):
        """Within the block the projector holds the field to export: the best-validation one with
        optim.keep_best (the last step's is put back afterwards), else the current one."""
        if not (self.cfg.keep_best and self.best is not None and self.best["model"] is not None):
            yield self.step
            return
        current = {k: t.detach().clone() for k, t in self.projector.state_dict().items()}
        self.projector.load_state_dict(self.best["model"])
        try:
            yield self.best["step"]
        finally:
            self.projector.load_state_dict(current)

    @torch.no_grad()
    def central_slices(self) -> dict[str, np.ndarray]:
        """XY (central Z), XZ (central Y) and YZ (central X) slices of the density, physical units."""
        planes = self._slice_points()
        out = {}
        for name, pts in planes.items():
            d = self.projector.density(pts.reshape(-1, 3)).reshape(pts.shape[:2])
            out[name] = d.cpu().numpy() * self.sampler.scale
        return out

    def _slice_points(self) -> dict[str, torch.Tensor]:
        """The normalized points of the three central planes, on the device; built once, plane by
        plane (the whole voxel grid would be Z*Y*X*3 floats: 25.8 GB for a 2048^2 x 512 box)."""
        if self._slices is None:
            from fasttomo.geometry.rays import voxel_plane

            box = self.projector.box
            dev = next(self.projector.parameters()).device
            self._slices = {name: voxel_plane(box, axis, n // 2, dev).contiguous()
                            for name, axis, n in zip(("xy", "xz", "yz"), range(3), box.shape_zyx)}
        return self._slices

    @torch.no_grad()
    def export_volume(self, shape_zyx=None) -> np.ndarray | None:
        """The reconstructed density (Z, Y, X) float32 in the units of the input stack per voxel.
        Under DDP each rank evaluates a slab of Z planes and rank 0 gathers them; other ranks get None."""
        shape = tuple(shape_zyx) if shape_zyx is not None else self.projector.box.shape_zyx
        if self.world_size == 1:
            return (self.projector.volume(shape) * self.sampler.scale).cpu().numpy()
        import torch.distributed as dist

        per = -(-shape[0] // self.world_size)
        lo, hi = min(self.rank * per, shape[0]), min((self.rank + 1) * per, shape[0])
        slab = torch.zeros((per, shape[1], shape[2]), device=self.device, dtype=torch.float32)
        if hi > lo:
            slab[: hi - lo] = self.projector.volume(shape, z_range=(lo, hi))
        gathered = torch.empty((per * self.world_size, shape[1], shape[2]), device=self.device, dtype=torch.float32)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch renamed it
        gather(gathered, slab)
        if not self.main:
            return None
        return (gathered[: shape[0]] * self.sampler.scale).cpu().numpy()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything an exact resume needs, as tensors and plain values (weights_only safe): the
        parts (:attr:`checkpointer`: projector, optimizer, scaler, plateau, sampler, every rank's
        RNG streams, guard, and the run's config) and the loop's own state.

        Collective under DDP (every rank must call it): each rank's RNG states are gathered, so
        every rank resumes its own streams (the regularizer generator is seeded per rank). The
        model is the unwrapped Projector: field and poses, without DDP's ``module.`` prefix."""
        return {
            "step": self.step,
            "world_size": self.world_size,
            **self.checkpointer.state_dict(),
            "history": self.history,
            "val_history": self.val_history,
            "train_seconds": self.train_seconds,
            "best": self.best,
            "curve": self.curve,
            "since_best": self._since_best,
        }

    def load_state_dict(self, state: dict, source: str = "checkpoint") -> None:
        """Restore :meth:`state_dict` (every rank loads the same file and takes its own RNG
        states). Refuses, with a :class:`CheckpointError` naming the fix, a checkpoint of another
        world size, model or sampler, or one already past ``steps`` (the total)."""
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.world_size:
            raise ckpt.CheckpointError(
                f"{source} was written by a run with {saved_world} process(es) but this run has {self.world_size}; "
                f"resume with the same number of processes (--nproc-per-node={saved_world}).")
        step = int(state["step"])
        if step > self.cfg.steps:
            raise ckpt.CheckpointError(
                f"{source} is at step {step} but optim.steps={self.cfg.steps}; optim.steps is the total "
                f"number of steps (including those before the resume): set optim.steps >= {step}.")
        self.checkpointer.load_state_dict(state, source)
        self.step = step
        self.history = [list(h) for h in state.get("history", [])]
        self.val_history = [list(h) for h in state.get("val_history", [])]
        self.train_seconds = float(state.get("train_seconds", 0.0))
        best = state.get("best")
        if best is not None and best.get("model") is not None:
            best = {**best, "model": {k: t.to(self.device) for k, t in best["model"].items()}}
        self.best = best
        self._since_best = int(state.get("since_best", 0))
        self.curve = [dict(r) for r in state.get("curve", [])]

    def save(self, name: str = "last.pt") -> Path | None:
        """Write ``checkpoints/<name>`` (rank 0). Collective under DDP: every rank must call it."""
        state = self.state_dict()
        if not self.main or self.out_dir is None:
            return None
        return self.checkpointer.save(self.out_dir / "checkpoints" / name, state)

    # ------------------------------------------------------------------ the loop
    def fit(self, steps: int | None = None) -> None:
        """Train until ``steps`` (default optim.steps) total steps are done.

        Stopping early (``steps`` < cfg.steps) is exactly a pause: the end-of-run extras (a log
        and a validation at the final step) happen at cfg.steps only, so stopping at N, saving
        and resuming gives the same run as going straight through."""
        cfg = self.cfg
        end = cfg.steps if steps is None else min(steps, cfg.steps)
        run_log = RunLogger(self.out_dir, main=self.main, tensorboard=cfg.tensorboard, progress=cfg.progress,
                            total=end, initial=self.step)
        clock = _FitClock(self.step, cfg.steps)
        self.guard.start(self.step)
        try:
            while self.step < end:
                if self._one_step(run_log, clock, end):
                    break
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.train_seconds += time.perf_counter() - clock.start - clock.paused
            run_log.close()

    def _one_step(self, run_log: RunLogger, clock: "_FitClock", end: int) -> bool:
        """One step of :meth:`fit` and what falls due after it (log, validation, images, guard
        check, probe, periodic checkpoint); returns True when the loop stops here."""
        cfg = self.cfg
        step = self.step
        self._set_lr(step)
        batch = self.sampler.next_batch()
        loss, parts = self.train_step(batch)
        self.step = step + 1
        if self.timing["first_step_done"] is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timing["first_step_done"] = time.perf_counter()
        run_log.progress(1)
        last = self.step == cfg.steps
        if self.step % cfg.log_every == 0 or last:
            self._log_step(run_log, clock, loss, parts, last)
        if (self.step % cfg.val_every == 0 or last) and self._validate_step(run_log, last):
            return True
        image_step = cfg.image_every > 0 and self.step % cfg.image_every == 0
        if (image_step or last) and self.main and cfg.tensorboard:
            t_img = time.perf_counter()
            for name, img in self.central_slices().items():
                run_log.image(self.step, f"slices/{name}", img)
            self.timing["image_seconds"] += time.perf_counter() - t_img
        if self.guard.due(self.step) or self.step == end:
            self.guard.check(self.step, final=last)  # may roll back, or raise DivergenceError
        if self.probe is not None and cfg.curve_every and (self.step % cfg.curve_every == 0 or last):
            self._probe_step(clock)
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and not last:
            try:
                self.save(f"step{self.step:07d}.pt")  # the README's checkpoints/step<N>.pt
            except OSError as exc:  # a full disk must not end the training: the end still tries
                log.error("could not write the checkpoint of step %d (%s); training goes on", self.step,
                          exc.strerror or exc)
        return self.stop is not None and self.stop.should_stop(self.step)

    def _log_step(self, run_log: RunLogger, clock: "_FitClock", loss, parts: dict, last: bool) -> None:
        """The scalars of a log step (losses, step time, learning rates, guard), the bar's loss and,
        every tenth of the run, a progress line."""
        vals = {"loss/train": all_reduce_mean(loss).item()}
        vals.update({f"loss/{k}": all_reduce_mean(v).item() for k, v in parts.items()})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        vals["time/step_ms"] = 1000.0 * (now - clock.mark) / max(1, self.step - clock.step_mark)
        clock.mark, clock.step_mark = now, self.step
        for g in self.optimizer.param_groups:
            vals[f"lr/{g['name']}"] = float(g["lr"])
        vals.update(self.guard.scalars())
        self.history.append([self.step, vals["loss/train"]])
        run_log.scalars(self.step, vals)
        if run_log.bar is not None:
            run_log.bar.set_postfix(loss=f"{vals['loss/train']:.3e}", refresh=False)
        if self.main and (self.step >= clock.next_progress or last):
            clock.next_progress = (self.step // clock.progress_every + 1) * clock.progress_every
            progress_log.info("%s", progress_line(
                self.step, self.cfg.steps, vals["loss/train"], now - clock.start - clock.paused,
                self.step - clock.step_start, self.val_history[-1][1] if self.val_history else None))

    def _validate_step(self, run_log: RunLogger, last: bool) -> bool:
        """A validation step: the loss, the plateau schedule, keep-best; True on an early stop."""
        t_val = time.perf_counter()
        v = self.validate()
        self.timing["validation_seconds"] += time.perf_counter() - t_val
        self.val_history.append([self.step, v])
        run_log.scalars(self.step, {"loss/val": v})
        if self.plateau is not None:
            self.plateau.update(v)
        if self._track_best(v) and not last:
            self.stopped_early = True
            log.info("early stop at step %d: no lower validation loss in %d checks since step %d "
                     "(optim.early_stop=%d)", self.step, self._since_best, self.best["step"], self.cfg.early_stop)
            return True
        return False

    def _probe_step(self, clock: "_FitClock") -> None:
        """The probe's scores into :attr:`curve`, its time taken out of the fit time and step time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t_probe = time.perf_counter()
        fit = self.train_seconds + (t_probe - clock.start - clock.paused)
        self.curve.append({"step": self.step, "fit_seconds": fit, **self.probe(self)})
        clock.paused += time.perf_counter() - t_probe
        clock.mark += time.perf_counter() - t_probe  # keep time/step_ms a measure of steps


class _FitClock:
    """The timekeeping of one :meth:`Trainer.fit` call: its start, the probe's paused seconds, the
    last log step's time and step, and the next progress line's step."""

    def __init__(self, step: int, total: int):
        self.start = time.perf_counter()
        self.mark, self.step_mark = self.start, step
        self.paused = 0.0  # seconds spent in the probe, not fit time
        self.step_start = step
        # a progress line every tenth of the run (at a log step): reconstruct.log always, the
        # console when no bar is drawn (a redirected output)
        self.progress_every = max(1, total // 10)
        self.next_progress = (step // self.progress_every + 1) * self.progress_every
