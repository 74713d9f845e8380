"""One reconstruction as an object: :class:`Run` owns what the phases hand each other (the
process's place, the stop requests, the tilt series, the method, the folder, the volume, the
files written and those that failed, the metrics) and runs them in order:

prepare (every input check: the resume checkpoint and what it refuses, the data read and
validated, the method made and the checkpoint loaded into it; nothing is written yet) -> open
(rank 0: the run folder, the log file with what ``prepare`` logged, the free-space check,
config.yaml) -> fit -> export (the volume, its files, the checkpoint) -> score (the fit's summary,
the status, the method's scores, the half sets) -> report (the pictures, metrics.json, what
failed, the manifest's end, the closing summary). Under torchrun every rank runs every phase; the
collective steps happen on all ranks in the same order, rank 0 alone writes.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from fasttomo import timeline
from fasttomo.config import Config, ConfigError, to_dict, upgrade
from fasttomo.logging import add_file_log, quiet_other_ranks, restore_ranks
from fasttomo.run import results
from fasttomo.run.folder import OutputExistsError, OutputFolderError, RunFolder
from fasttomo.run.inputs import load_inputs
from fasttomo.run.methods import make_method
from fasttomo.run.outputs import VolumeFiles, export_slabs, slab_planes_of, volume_names
from fasttomo.run.place import Place
from fasttomo.run.resume import absolute_paths, refuse_immutable, warn_changes
from fasttomo.run.stop import RunInterrupted, StopRequests, signal_name
from fasttomo.train.checkpoint import find_checkpoint, load_checkpoint
from fasttomo.train.distributed import (broadcast_object, destroy_distributed, dist_info, init_distributed,
                                        is_distributed)
from fasttomo.train.guard import DivergenceError

log = logging.getLogger("fasttomo")


class Run:
    """One run of ``cfg`` (cfg.output.dir must be set): :meth:`execute` runs the phases."""

    def __init__(self, cfg: Config):
        if not cfg.output.dir:
            raise ConfigError("output.dir: no output folder was given; set output.dir=<folder> (Hydra sets it).")
        self.cfg = cfg
        t0 = time.perf_counter()
        self.joined = _runtime_settings(cfg)
        rank, world, local_rank = dist_info()
        out_dir = Path(broadcast_object(str(Path(cfg.output.dir).resolve())))
        self.place = Place(rank, world, local_rank, out_dir, t0)
        self.main = rank == 0
        self.out_dir = out_dir
        self.resume_cmd = _resume_command(out_dir, world)
        self.stop = StopRequests(world_size=world)
        self.resume_path = None
        self.folder: RunFolder | None = None
        self.handler: logging.Handler | None = None
        self.method = None
        self.ts = self.hold = None
        self.volume: np.ndarray | None = None
        self.exported_step = 0
        self.finite = True
        self.flat: str | None = None  # what makes a finite volume flat (results.flat_volume)
        self.interrupted = False
        self.halves_stopped = False  # a signal came before or during the half-set fits: they were not finished
        self.resumable = False  # the run leaves a checkpoint (every rank alike): its halves can be stopped
        self.written: dict = {}
        self.failed: dict = {}
        self.metrics: dict = {}
        self.state: dict | None = None
        self.checkpoint: results.CheckpointWrite | None = None
        self.publishing: list = []  # volume.mrc going to the disk on a thread (VolumeFiles.later)
        self.publish_s: dict[str, float] = {}  # its fsync and rename on the thread, the run's wait for them
        self.half_curves: dict | None = None
        self.peaks: dict[str, dict] = {}  # host and GPU peaks by phase where there are half sets (timeline)

    # ------------------------------------------------------------------------------ the whole run
    def execute(self) -> dict:
        """Every phase; an error after the folder was opened goes into reconstruct.log and the
        manifest (status failed, diverged or interrupted) before it propagates."""
        ranks = quiet_other_ranks(self.place.rank, self.cfg.logging.all_ranks) if self.place.world > 1 else None
        buffer = _LogBuffer() if self.main else None
        try:
            with self.stop:
                self.prepare()
                self.open(buffer)
                self.fit()
                self.export()
                self.score()
                self.report()
            self.end()
            return self.metrics
        except BaseException as exc:
            self._failed(exc)
            raise
        finally:
            if buffer is not None:
                buffer.close()
            if ranks is not None:
                restore_ranks(ranks)
            if self.handler is not None:
                logging.getLogger("fasttomo").removeHandler(self.handler)
                self.handler.close()

    def _failed(self, exc: BaseException) -> None:
        if not (self.main and self.folder is not None):
            return  # refused before the folder was opened: nothing was written, the entry point says why

        status = ("interrupted" if isinstance(exc, (RunInterrupted, KeyboardInterrupt))
                  else "diverged" if isinstance(exc, DivergenceError) else "failed")
        self.join_checkpoint()  # the manifest closes after the checkpoint's write
        results.log_failure(exc, self.handler)
        if status == "diverged" and "status" not in self.metrics:  # the guard stopped the training
            results.diverged_metrics(self, exc)
        self.folder.finish(status, error=results.one_line(exc),
                           step=self.method.step if self.method is not None else None)

    # ------------------------------------------------------------------------------ the phases
    def prepare(self) -> None:
        """Every input check, before anything is written: the resume checkpoint read and verified
        (every rank reads it, to the CPU), the data read, validated and split (truth attached,
        held-out views set aside), the method made and the checkpoint loaded into it."""

        cfg = self.cfg
        resume_path, resume_state = _read_resume(cfg)
        self.resume_path = resume_path
        self.ts, self.hold = load_inputs(cfg)
        self.method = make_method(cfg, self.ts, self.hold, self.place, self.stop)
        self.cfg = self.method.cfg  # as the method sized it from the data (optim.steps=None)
        if resume_state is not None:
            self.method.load(resume_state, str(resume_path))

    def open(self, buffer: "_LogBuffer | None") -> None:
        """The run folder (rank 0: lock, reuse rules, manifest), the log file (with what was logged
        since the run began), the free-space check, config.yaml."""
        problem = None
        if self.main:
            try:
                self.folder = RunFolder(self.out_dir, overwrite=self.cfg.output.overwrite, resume=self.resume_path,
                                        outputs=results.planned_outputs(self.cfg)).open()
            except (OutputExistsError, OutputFolderError) as exc:
                problem = (isinstance(exc, OutputExistsError), str(exc))
        problem = broadcast_object(problem)
        if problem:
            raise (OutputExistsError if problem[0] else OutputFolderError)(problem[1])
        if self.main:
            self._open_log(buffer)
        problem = None
        if self.main:
            try:
                self.method.check_space(self.out_dir)
            except OutputFolderError as exc:
                problem = str(exc)
        problem = broadcast_object(problem)
        if problem:
            raise OutputFolderError(problem)
        if self.main:
            results.write_text(self.out_dir / "config.yaml", yaml.safe_dump(to_dict(self.cfg), sort_keys=False))

    def _open_log(self, buffer: "_LogBuffer | None") -> None:
        path = self.out_dir / "reconstruct.log"
        try:
            self.handler = add_file_log(path, overwrite=True, append=self.folder.continuing)
        except OSError as exc:
            self.folder.finish("failed", error=f"cannot write the log: {exc}")
            self.folder = None  # closed: the error goes to the console only
            raise OutputFolderError(f"cannot write {path} ({exc.strerror or exc}); choose a folder you can "
                                    "write to.") from None
        if buffer is not None:
            buffer.replay(self.handler)
        for note in self.folder.notes:
            log.info("%s", note)

    def fit(self) -> None:
        self.method.fit()
        self.interrupted = self.stop.signum is not None and self.method.step < self.cfg.optim.steps

    def export(self) -> None:
        """The volume (collective), its files when it is finite (rank 0; a method with
        ``export_files`` writes them as it evaluates the volume), the checkpoint (its state is
        collective; rank 0 writes it)."""
        attrs = {"run": self.cfg.name, "config": to_dict(self.cfg), "units": "input stack units per voxel"}
        files = VolumeFiles(self.ts.pixel_size, attrs, later=self.publishing)
        if hasattr(self.method, "export_files"):
            self.volume, self.exported_step, self.written, self.failed, self.finite = self.method.export_files(
                self.out_dir, files)
        elif not self._export_slabs(files):
            self._export_whole(files)
        self.finite = broadcast_object(self.finite)  # every rank takes the same branches (half sets are collective)
        self.state = self.method.state()
        if self.main and self.state is not None:
            self.checkpoint = results.CheckpointWrite(self.out_dir, self.state)  # joined before metrics.json

    def volume_ready(self) -> np.ndarray | None:
        """``self.volume`` once it can be read: where volume.mrc's writes went on after the export
        (from the copy kept on the GPU for the scoring), wait for them; where they failed, the
        volume becomes that copy's values on the host (for the pictures and the rescue; the join
        reports the failure)."""
        kept = getattr(self.method, "volume_on_device", None)
        for pending in self.publishing:
            if pending.wait_written() is not None and kept is not None and isinstance(self.volume, np.memmap):
                self.volume = kept.cpu().numpy()
        return self.volume

    def join_checkpoint(self) -> None:
        """Wait for the checkpoint's write and for volume.mrc's way to the disk and its name, and
        record them (rank 0; nothing when there is none)."""
        if self.checkpoint is not None:
            self.checkpoint.join(self.written, self.failed)
        while self.publishing:
            pending, t0 = self.publishing.pop(0), time.perf_counter()
            name = os.path.basename(pending.path)
            try:
                pending.join()
            except OSError as exc:
                self.written.pop(name, None)
                self.failed[name] = results.one_line(exc)
                log.error("could not write %s (%s)", pending.path, results.one_line(exc))
            self.publish_s["wait"] = self.publish_s.get("wait", 0.0) + time.perf_counter() - t0
            self.publish_s["fsync_rename"] = self.publish_s.get("fsync_rename", 0.0) + pending.seconds
            if pending.write_seconds:
                self.publish_s["writes"] = self.publish_s.get("writes", 0.0) + pending.write_seconds

    def _export_slabs(self, files: VolumeFiles) -> bool:
        """One process, mrc among the formats, a method with ``volume_slabs`` (SIRT): volume.mrc
        written slab by slab from the device and the other formats from a map of it (the volume
        kept is that map). False when it does not apply or did not succeed."""
        if self.place.world != 1 or not hasattr(self.method, "volume_slabs") or "volume.mrc" not in volume_names(
                self.cfg):
            return False
        with self.method.volume_slabs(slab_planes_of(self.cfg)) as source:
            done = export_slabs(source, self.cfg, self.out_dir, files)
        if done is None:
            return False
        self.volume, self.written, self.failed = done
        self.exported_step, self.finite = self.method.step, True
        return True

    def _export_whole(self, files: VolumeFiles) -> None:
        """The volume evaluated whole (collective), then its files when it is finite (rank 0)."""
        self.volume, self.exported_step = self.method.export()
        if self.main:
            self.finite = bool(np.isfinite(self.volume).all())
            if self.finite:
                self.written, self.failed = results.write_volumes(self.out_dir, self.volume, self.cfg, files)
            else:
                log.error("the volume holds %d non-finite voxels (of %d); no volume file was written",
                          int((~np.isfinite(self.volume)).sum()), self.volume.size)

    def score(self) -> None:
        """metrics (rank 0): the fit's summary, the status, the method's scores, the learned poses'
        files; then the half sets (collective) when the volume is finite and the run was not
        interrupted (a signal before them skips them, one during them stops them: the run is then
        interrupted, its whole fit's results kept)."""
        if self.main:
            self.metrics = self.method.summary(self.volume)
            judged = self.finite and int(self.metrics.get("steps") or 0) >= results.FLAT_MIN_STEPS
            self.flat = results.flat_volume(self.volume_ready(), self.ts) if judged else None
            if self.flat:
                self.metrics["volume_flat"] = self.flat
            good = self.finite and not self.flat
            self.metrics["status"] = ("interrupted" if self.interrupted else "finished") if good else "diverged"
            self.method.scores(self.metrics, self.exported_step)
            if "poses" in self.metrics:
                results.write_pose_files(self.out_dir, self.metrics["poses"], self.ts, self.written, self.failed)
        self.flat = broadcast_object(self.flat)  # every rank skips the half sets alike
        halves = self.cfg.evaluation.half_sets or self.cfg.output.half_volumes
        # a checkpoint to resume the halves from (not SIRT's): the same answer on every rank
        self.resumable = resumable = broadcast_object(self.state is not None)
        if self.finite and not self.flat and not self.interrupted and halves and resumable and self.stop.agreed():
            self.halves_stopped = True  # Ctrl-C after the last step: the user wants the run to end, not two more fits
            halves = None
            if self.main:
                self.metrics["half_sets"] = {"skipped": f"{signal_name(self.stop.signum)} before the half-set fits"}
        if self.finite and not self.flat and not self.interrupted and halves:
            self.peaks["main run"] = timeline.phase_peaks()
            self.method.release()  # the half fits get the device memory the run reads no more
            if self.checkpoint is not None:  # its host copy (3 GB at 4096^2) goes before the halves' stacks come
                self.checkpoint.join(self.written, self.failed)
            t_halves = time.perf_counter()
            halves, self.half_curves = results.half_sets(self)  # sets halves_stopped (every rank alike)
            if self.halves_stopped and self.main:
                halves = {"skipped": f"{signal_name(self.stop.signum)} during the half-set fits"}
            if self.main:
                self.metrics["half_sets"] = halves
                self.metrics["half_sets_seconds"] = round(time.perf_counter() - t_halves, 3)  # both fits, the FSC
        if self.halves_stopped and self.main:
            self.metrics["status"] = "interrupted"

    def report(self) -> None:
        """Rank 0: the pictures (of a finite volume), the wall time, metrics.json; then every rank
        raises what kept results from being written."""
        if self.main:
            results.finish_files(self, pictures=self.finite)
        problem = broadcast_object(results.write_problem(self) if self.main else None)
        if problem:
            raise problem[0](problem[1])

    def end(self) -> None:
        """An interrupted run raises RunInterrupted (with how to resume); a finished one closes its
        manifest, prints the closing summary and leaves the process group it joined."""
        if self.interrupted:
            raise RunInterrupted(self.stop.signum, f"stopped at step {self.method.step} of {self.cfg.optim.steps} "
                                 f"({signal_name(self.stop.signum)}); the volume so far and a checkpoint are in "
                                 f"{self.out_dir}; resume with: {self.resume_cmd}")
        if self.halves_stopped:
            raise RunInterrupted(self.stop.signum, f"stopped before the half-set fits were done "
                                 f"({signal_name(self.stop.signum)}): the volume, checkpoint and metrics of the whole "
                                 f"fit are in {self.out_dir}, without the half-set FSC; to compute it, resume with: "
                                 f"{self.resume_cmd}")
        if self.stop.signum is not None:
            log.info("%s arrived after the last step; the run finished", signal_name(self.stop.signum))
        if self.main:
            self.folder.finish("finished", step=self.method.step)
            written = dict(self.folder.manifest.get("files", {}))
            try:
                written.setdefault("manifest.json", (self.out_dir / "manifest.json").stat().st_size)
            except OSError:  # the folder went away: the summary says it cannot be listed
                pass
            results.closing_summary(self.cfg, self.out_dir, self.metrics, written)
        if self.joined:  # leave the process group we joined (after a successful run; on errors the process exits)
            destroy_distributed()


def _resume_command(out_dir: Path, world: int) -> str:
    """How to continue this run in place: the same number of ranks (scripts/launch_ddp.sh for one
    machine's ranks; a job over several machines is relaunched as it was started)."""
    args = f"resume={out_dir} hydra.run.dir={out_dir}"
    if world == 1:
        return f"fasttomo-reconstruct {args}"
    if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world:
        return f"scripts/launch_ddp.sh {world} {args}"
    return f"the same torchrun job ({world} ranks) with {args}"


def _runtime_settings(cfg: Config) -> bool:
    """Threads, determinism, the process group (joined here: True) and the CUDA device's warm-up."""
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    if cfg.runtime.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    wants_cuda = cfg.runtime.device.startswith("cuda") or (cfg.runtime.device == "auto" and torch.cuda.is_available())
    joined = not is_distributed() and init_distributed("cuda" if wants_cuda else "cpu")
    if wants_cuda and torch.cuda.is_available():  # (no CUDA: build reports runtime.device=cuda)
        from fasttomo.kernels import prewarm
        from fasttomo.run.build import resolve_device

        device = resolve_device(cfg.runtime.device, dist_info()[2])
        prewarm.warm_device(device.index if device.index is not None else torch.cuda.current_device())
    return joined


def _read_resume(cfg: Config):
    """(checkpoint path, its state) of ``resume=``, refusing what a continuation cannot change
    and warning about the settings that differ; (None, None) without a resume."""

    if not cfg.resume:
        return None, None
    path = find_checkpoint(cfg.resume)
    state = load_checkpoint(path, map_location="cpu")
    if isinstance(state.get("config"), dict):
        state["config"] = absolute_paths(upgrade(state["config"]))  # an older fasttomo's keys, today's names
        refuse_immutable(state["config"], to_dict(cfg), str(path))
        warn_changes(state["config"], to_dict(cfg), str(path))
    return path, state


class _LogBuffer(logging.handlers.MemoryHandler):
    """Holds the 'fasttomo' records logged before the log file exists (the input checks run
    before the run folder is made) and hands them to the file when it opens."""

    def __init__(self):
        super().__init__(capacity=1 << 30, flushLevel=logging.CRITICAL + 1, target=None, flushOnClose=False)
        self.logger = logging.getLogger("fasttomo")
        self.logger.addHandler(self)
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)

    def replay(self, handler: logging.Handler) -> None:
        self.setTarget(handler)
        self.flush()
        self.close()

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.buffer = []
        super().close()
