"""What a run writes after its fit, and how it reports what went wrong (fasttomo.run.run.Run's
helpers): the planned outputs, the checkpoint, the half sets, the pictures and metrics.json, the
missing-results error, the closing summary, the failure's log line. Every file is written
atomically; a failure to write one result keeps the others (outputs.py)."""

from __future__ import annotations

import contextlib
import dataclasses as dc
import gc
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from fasttomo import timeline
from fasttomo.config import Config, ConfigError
from fasttomo.data.io.atomic import atomic_write
from fasttomo.data.tiltseries import TiltSeries
from fasttomo.data.views import permute_views
from fasttomo.quality.plots import fsc_plot, render_fsc, render_line_plot
from fasttomo.quality.report import (add_to_tensorboard, loss_series, number_text, png_bytes, report_image, save_png,
                                     slice_panel, summary_lines)
from fasttomo.quality.scoring import pair_fsc, truth_scores
from fasttomo.run.folder import EVENT_FILES, STEP_CHECKPOINTS, OutputExistsError, OutputFolderError
from fasttomo.run.methods import make_method
from fasttomo.run.outputs import (OutputWriteError, VolumeFiles, dumps, half_volume_names, rescue,
                                  save_checkpoint_file, slab_planes_of, volume_names, write_failure_message,
                                  write_half_volume, write_pose_files, write_volume_slabs, write_volumes)
from fasttomo.run.stop import RunInterrupted, signal_name
from fasttomo.train.guard import DivergenceError

log = logging.getLogger("fasttomo")

__all__ = ["VolumeFiles", "write_pose_files", "write_volumes"]


def planned_outputs(cfg: Config) -> list[str]:
    """What a run of ``cfg`` may write into its folder (names or glob patterns), recorded in the
    manifest before anything is written."""
    names = ["reconstruct.log", "config.yaml", *volume_names(cfg), "checkpoints/last.pt", STEP_CHECKPOINTS,
             "slices.png", "loss.png", "fsc_truth.png", "report.png", "metrics.json"]
    if cfg.output.half_volumes:
        names += [*half_volume_names(cfg, "volume_even"), *half_volume_names(cfg, "volume_odd")]
    elif cfg.evaluation.half_sets:  # a camera-size half with no room on the GPU (_half_volume)
        names += ["volume_even.mrc", "volume_odd.mrc"]
    if cfg.evaluation.half_sets or cfg.output.half_volumes:
        names.append("fsc_halfsets.png")
    if cfg.pose.learn:
        names += ["poses.xf", "poses.tlt", "poses.aln"]
    if cfg.logging.tensorboard:
        names.append(EVENT_FILES)
    return names


def write_text(path: Path, text: str, overwrite: bool = True) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), overwrite=overwrite)


def slices_png(path: Path, volume: np.ndarray, pixel_size: float, truth: np.ndarray | None, overwrite: bool):
    """slices.png: the central slices in three planes with a scale bar and a colour bar; a second
    row shows the ground truth (report.slice_panel). Returns the image."""

    img = slice_panel(volume, pixel_size, truth)
    save_png(path, img, overwrite=overwrite)
    return img


class CheckpointWrite:
    """checkpoints/last.pt written on a background thread while the run scores its volume and
    draws its pictures: the state is copied to the host first, in the caller's thread, so nothing
    the run does afterwards changes what is saved. :meth:`join` waits for it and records it in
    ``written`` or ``failed``; the thread is not a daemon, so the process never exits before it."""

    def __init__(self, out_dir: Path, state: dict):
        import threading

        from fasttomo.train.checkpoint import host_copy

        self.path = out_dir / "checkpoints" / "last.pt"
        self.result: tuple[str | None, str | None] | None = None
        self.seconds = {"copy": 0.0, "write": 0.0, "wait": 0.0}
        t0 = time.perf_counter()
        payload = host_copy(state)
        self.seconds["copy"] = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, args=(payload,), name="fasttomo-checkpoint")
        self._thread.start()

    def _write(self, payload: dict) -> None:
        t0 = time.perf_counter()
        self.result = save_checkpoint_file(self.path, payload)  # never raises
        self.seconds["write"] = time.perf_counter() - t0

    def join(self, written: dict, failed: dict) -> None:
        if self._thread.is_alive():
            t0 = time.perf_counter()
            self._thread.join()
            self.seconds["wait"] += time.perf_counter() - t0
        path, err = self.result or (None, "the checkpoint's thread ended without a result")
        if err:
            failed["checkpoints/last.pt"] = err
        else:
            written["checkpoints/last.pt"] = path


# --------------------------------------------------------------------------------------- half sets
def half_sets(run) -> tuple[dict | None, dict | None]:
    """(FSC report, FSC curves) of the even and the odd views (in tilt order) reconstructed apart
    by the run's method, and their FSC (rank 0; None elsewhere). The half volumes are files
    (volume_even.* / volume_odd.*) with output.half_volumes; with evaluation.half_sets alone they
    are held for the FSC and never written (:func:`_half_volume`). Each half gets its own seed, so
    the two share no initial noise that the data does not overwrite. Collective under DDP."""

    ts = run.ts
    try:
        with _halves(ts) as parts:
            vols = _fit_halves(run, parts)
    finally:
        run.stop.phase = "saving"
    if vols is None or not run.place.main:  # stopped by a signal (every rank alike), or not rank 0
        return None, None
    res, curves = pair_fsc(vols["even"], vols["odd"], ts.pixel_size, tilt_range(ts))
    del vols
    run.peaks["half-set FSC"] = timeline.phase_peaks()
    try:
        fsc_plot(run.out_dir / "fsc_halfsets.png", curves, "FSC of the even-view and odd-view reconstructions",
                 tilt_range(ts), overwrite=True)
    except OSError as exc:
        run.failed["fsc_halfsets.png"] = exc.strerror or str(exc)
    log.info("half sets: FSC 0.143 at %s, 0.5 at %s", _res(res, "fsc0143"), _res(res, "fsc05"))
    return res, curves


def _fit_halves(run, parts: dict) -> dict | None:
    """{even, odd: volume}: each half series of ``parts`` fitted by the run's method with its own
    seed and its volume taken (:func:`_half_volume`), the method let go before the next half.
    None when Ctrl-C or SIGTERM came (``run.halves_stopped``): a field's fit polls the run's stop
    requests after every step and the halves end there, decided together under DDP. A method
    without a trainer and checkpoint (SIRT) is not stopped: its halves finish, as before a resume
    could offer them."""
    cfg, place = run.cfg, run.place
    vols = {}
    for parity, name in ((0, "even"), (1, "odd")):
        hcfg = dc.replace(cfg, resume=None, runtime=dc.replace(cfg.runtime, seed=cfg.runtime.seed + 1 + parity),
                          logging=dc.replace(cfg.logging, tensorboard=False, progress=False, checkpoint_every=0),
                          evaluation=dc.replace(cfg.evaluation, curve_every=0))
        if run.resumable:  # from here a Ctrl-C is said as the halves' stop (the build below takes a while)
            run.stop.phase = "halves"
        log.info("half sets: reconstructing the %s views (%d of %d)", name, parts[name].n_tilts, run.ts.n_tilts)
        method = make_method(hcfg, parts.pop(name), None, dc.replace(place, out_dir=None))
        stoppable = getattr(method, "trainer", None) is not None and run.resumable  # alike on every rank
        if stoppable:
            method.trainer.stop = run.stop  # polled; its fit keeps its quiet log lines (no phases of its own)
        else:
            run.stop.phase = "saving"
        method.fit()
        run.stop.phase = "saving"
        if stoppable and run.stop.agreed():  # collective: every rank stops, or none
            run.halves_stopped = True
            log.warning("half sets: stopped (%s) during the %s half's fit; no half-set FSC",
                        signal_name(run.stop.signum), name)
            return None
        run.peaks[f"{name} half: fit"] = timeline.phase_peaks()
        vols[name] = _half_volume(run, method, name)
        del method  # its device memory (and a copy of its views, where they were copied) go before the next
        gc.collect()  # half's, what its trainer's reference cycles hold included
        run.peaks[f"{name} half: volume"] = timeline.phase_peaks()
    return vols


@contextlib.contextmanager
def _halves(ts):
    """{even, odd: TiltSeries} of ``ts``'s views. Where its stack (and mask) can be written in
    place, their views are put in even-then-odd order and each half reads its own rows of them,
    no copy (at 4096^2 x 121 a copy is 8 GB of host memory beside the stack), and their order is
    put back on the way out, whatever happened. Otherwise (a read-only map, a broadcast) each half
    gets a copy of its views and the run lets its own stack go: nothing reads it afterwards."""
    even, odd = np.arange(0, ts.n_tilts, 2), np.arange(1, ts.n_tilts, 2)
    arrays = [a for a in (ts.stack, ts.valid) if a is not None]
    if not all(type(a) is np.ndarray and a.flags.writeable and a.flags.c_contiguous for a in arrays):
        parts = {"even": _subset(ts, even), "odd": _subset(ts, odd)}
        ts.let_pixels_go()
        yield parts
        return
    order = np.concatenate([even, odd])
    for a in arrays:
        permute_views(a, order)
    try:
        yield {"even": _subset(ts, even, slice(0, len(even))), "odd": _subset(ts, odd, slice(len(even), None))}
    finally:
        back = np.argsort(order)
        for a in arrays:
            permute_views(a, back)


def _half_volume(run, method, half: str):
    """The ``half`` (even or odd) volume of a fitted ``method``, for the half-set FSC. With
    output.half_volumes its files are written (slab by slab where the method can, the volume then
    a read-only map of volume_<half>.mrc). Without, nothing is written: one process holds it on
    its GPU where there is room for both halves (:func:`_half_on_device`), else a volume the
    scores stream (camera size) still goes through volume_<half>.mrc so that the host never holds
    it whole, and a smaller one is taken whole. Collective under DDP (rank 0 gets the volume)."""
    from fasttomo.quality.scoring import WHOLE_VOLUME_MAX_VOXELS

    cfg, ts, place = run.cfg, run.ts, run.place
    files = cfg.output.half_volumes
    if place.world == 1 and hasattr(method, "volume_slabs"):
        vol, voxels = (None, 0) if files else _half_on_device(run, method, half)
        if vol is None and (files or voxels > WHOLE_VOLUME_MAX_VOXELS):
            vol = _half_in_slabs(run, method, half)
        if vol is not None:
            return vol
    vol = method.export()[0]  # collective
    if files and place.main:
        w, f = write_half_volume(run.out_dir, vol, cfg, VolumeFiles(ts.pixel_size, {}), half)
        run.written.update(w)
        run.failed.update(f)
    return vol


def _half_on_device(run, method, half: str) -> tuple[torch.Tensor | None, int]:
    """(volume, its voxels): the half volume evaluated slab by slab into one float32 tensor on the
    method's GPU, where its free memory (with torch's cached blocks) holds twice the half (this one
    and the next) with the scoring's headroom (``quality.scoring.SCORING_DEVICE_HEADROOM``) and
    the slabs are finite; else None, before any slab is evaluated where it is not held."""
    from fasttomo.quality.scoring import SCORING_DEVICE_HEADROOM, free_memory_bytes

    devices = []

    def planes_of(shape, device):  # called once, before the first slab: the method's device
        devices.append(torch.device(device))
        return slab_planes_of(run.cfg)(shape, device)

    with method.volume_slabs(planes_of) as (shape, _planes, slabs):
        voxels, device = math.prod(shape), devices[0]
        if device.type != "cuda":
            return None, voxels
        need = SCORING_DEVICE_HEADROOM * 8 * voxels
        free = (free_memory_bytes(device) or 0) + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device)  # the allocator's cached blocks are free to it
        if free < need:
            log.info("half sets: the %s half (%s voxels) is not held on %s (%.1f GB free, %.1f GB wanted)", half,
                     "x".join(map(str, shape)), device, free / 1e9, need / 1e9)
            return None, voxels
        vol = torch.empty(tuple(shape), dtype=torch.float32, device=device)
        finite = torch.ones((), dtype=torch.bool, device=device)
        for z0, slab in slabs:
            vol[z0:z0 + slab.shape[0]] = slab
            finite &= torch.isfinite(slab).all()  # slab by slab, on the device: no whole-volume mask, one sync
            del slab
    if not bool(finite):
        return None, voxels  # the caller's path names the non-finite volume
    log.info("half sets: the %s half held on %s for the FSC (not written; output.half_volumes=true writes it)",
             half, device)
    return vol, voxels


def _half_in_slabs(run, method, half: str) -> np.ndarray | None:
    """One process: ``volume_<half>.mrc`` written slab by slab from the method's device volume
    (fasttomo.run.outputs.write_volume_slabs), its other files (output.half_volumes) from a
    read-only map of it, which is returned (the half-set FSC reads it crop by crop): a camera-size
    half is never whole in host memory. None when the method cannot or the file could not be
    written (the caller then takes the volume whole)."""
    from fasttomo.data.io.mrc import NonFiniteSlab, mrc_memmap

    cfg, ts = run.cfg, run.ts
    mrc = f"volume_{half}.mrc"
    try:
        with method.volume_slabs(slab_planes_of(cfg)) as (shape, _planes, slabs):
            path = write_volume_slabs(run.out_dir / mrc, shape, slabs, VolumeFiles(ts.pixel_size, {}), cfg.name)[0]
    except NonFiniteSlab:
        return None
    except OSError as exc:
        log.error("could not write %s (%s); taking the half volume whole", run.out_dir / mrc, exc.strerror or exc)
        return None
    volume = mrc_memmap(path)
    run.written[mrc] = path
    if cfg.output.half_volumes:
        w, f = write_half_volume(run.out_dir, volume, cfg, VolumeFiles(ts.pixel_size, {}, skip=(mrc,)), half)
        run.written.update(w)
        run.failed.update(f)
    else:
        log.info("half sets: the %s half written to %s for its FSC (no room on the GPU to hold it)", half, path)
    return volume


def _res(report: dict, key: str) -> str:
    """'12.3 A', or why there is no crossing (from the all-of-Fourier-space curve)."""
    fsc = report.get("fsc") or {}
    if fsc.get(f"{key}_A") is not None:
        return f"{number_text(fsc[f'{key}_A'], '.3g')} A"
    return {"never": f"none (above it up to Nyquist, {number_text(fsc.get('nyquist_A', 0), '.3g')} A)"}.get(
        fsc.get(f"{key}_status"), str(fsc.get(f"{key}_status")))


def _subset(ts, keep: np.ndarray, rows: slice | None = None):
    """The series of ``ts``'s views ``keep``: its stack and mask those ``rows`` of ``ts``'s (views
    of them, with the views already in that order), else copies of the views."""
    sub = lambda a: None if a is None else a[rows] if rows is not None else np.ascontiguousarray(a[keep])  # noqa: E731
    numbers = list(ts.metadata.get("view_numbers") or range(1, ts.n_tilts + 1))
    meta = {**ts.metadata, "view_numbers": [numbers[i] for i in keep]}  # a file alignment follows its views
    return TiltSeries(stack=sub(ts.stack), angles=ts.angles[keep], pixel_size=ts.pixel_size, source=ts.source,
                      metadata=meta, ground_truth=ts.ground_truth, valid=sub(ts.valid))


def tilt_range(ts) -> tuple[float, float]:
    a = np.asarray(ts.angles, dtype=np.float64)
    return float(a.min()), float(a.max())


# --------------------------------------------------------------------------------------- the end of a run
def finish_files(run, pictures: bool = True) -> None:
    """Rank 0, after the volume, the checkpoint and the half sets: the pictures (``pictures``),
    the wall time and metrics.json; what cannot be written is recorded in ``run.failed``."""
    metrics = run.metrics
    metrics["wall_seconds"] = time.perf_counter() - run.place.t0  # again below, with the pictures
    t_pictures = time.perf_counter()
    if pictures:
        _pictures(run)
    t_pictures = time.perf_counter() - t_pictures
    run.join_checkpoint()
    metrics["wall_seconds"] = time.perf_counter() - run.place.t0
    tl = metrics.setdefault("timeline", {})  # SIRT's too: the process's peaks
    tl["pictures_s"] = round(t_pictures - (tl.get("scoring_s") or 0.0), 3)
    if run.checkpoint is not None:
        tl["checkpoint_s"] = {k: round(v, 3) for k, v in run.checkpoint.seconds.items()}
    if run.publish_s:
        tl["volume_publish_s"] = {k: round(v, 3) for k, v in run.publish_s.items()}
    tl["process_to_end_s"] = round(timeline.since_start(), 3)
    tl["peak_host_bytes"] = timeline.peak_rss_bytes()
    tl["peak_gpu_bytes"] = timeline.peak_gpu_bytes()
    if run.peaks:  # where the peaks are: the main run, each half's fit and volume, their FSC
        tl["peak_bytes_by_phase"] = run.peaks
    try:
        write_text(run.out_dir / "metrics.json", dumps(metrics), True)
    except OSError as exc:
        run.failed["metrics.json"] = exc.strerror or str(exc)


def diverged_metrics(run, exc: BaseException) -> None:
    """metrics.json of a run the divergence guard stopped during training (rank 0): the status,
    the error, the steps and the loss curves so far, the guard's counts; nothing if it cannot be
    written (the manifest and the log say the same)."""
    trainer = getattr(run.method, "trainer", None)
    metrics = {"status": "diverged", "error": one_line(exc), "steps": run.method.step,
               "steps_planned": run.cfg.optim.steps}
    if trainer is not None:
        metrics["loss"] = {"curve": trainer.history}
        metrics["val_loss"] = {"curve": trainer.val_history}
        metrics["guard"] = trainer.guard.summary()
    try:
        write_text(run.out_dir / "metrics.json", dumps(metrics), True)
    except OSError as exc2:
        log.warning("could not write metrics.json (%s)", exc2.strerror or exc2)


def _pictures(run) -> None:
    """Scores against a ground truth (into the metrics), slices.png, fsc_truth.png, loss.png and
    report.png, which holds them all (and the half-set FSC, the quality curve and the learned
    poses when they exist) and goes into TensorBoard too (rank 0); a picture that cannot be
    written is recorded in ``run.failed``."""

    cfg, out_dir, volume, ts, metrics = run.cfg, run.out_dir, run.volume, run.ts, run.metrics
    curves = None
    if ts.ground_truth is not None and volume.shape == ts.ground_truth.shape:
        t_score = time.perf_counter()
        kept = getattr(run.method, "volume_on_device", None)
        if torch.cuda.is_initialized():  # the run's own peak: scoring uses free GPU memory only where there is room
            metrics.setdefault("timeline", {})["peak_gpu_bytes_before_scoring"] = (
                timeline.peak_gpu_bytes() - (0 if kept is None else kept.numel() * 4))  # the copy: scoring's
        report, curves = truth_scores(volume, ts.ground_truth, ts.pixel_size, tilt_range(ts), kept,
                                      volume_ready=run.volume_ready)
        del kept
        metrics.update(report)
        metrics.setdefault("timeline", {})["scoring_s"] = round(time.perf_counter() - t_score, 3)
    volume = run.volume_ready()  # the pictures read the file's map
    if getattr(run.method, "volume_on_device", None) is not None:
        run.method.volume_on_device = None  # its GPU memory back
    truth = ts.ground_truth if metrics.get("pearson_global") else None
    # drawn here, one after another (text goes through one FreeType library); encoded and written
    # beside report.png in threads (zlib releases the GIL while it compresses)
    panel = slice_panel(volume, ts.pixel_size, truth)  # slices.png, and the top of report.png
    pictures = [("slices.png", panel)]
    series = loss_series(metrics)
    if series:
        pictures.append(("loss.png", render_line_plot(series, "Loss curves", "step", "loss", log_y=True,
                                                      legend="below")[0]))
    if curves is not None:
        pictures.append(("fsc_truth.png", render_fsc(curves, "FSC of the reconstruction against the ground truth",
                                                     tilt_range(ts))))
    label = run.method.label
    title = (f"fasttomo{'' if cfg.name == 'fasttomo' else ' ' + cfg.name}: {_shown_path(out_dir)}"
             + (f" ({label})" if label else ""))
    with ThreadPoolExecutor(max_workers=len(pictures), thread_name_prefix="fasttomo-picture") as pool:
        futures = [(name, pool.submit(save_png, out_dir / name, img)) for name, img in pictures]
        _report_png(run, title, truth, curves, panel)
        for name, fut in futures:
            try:
                fut.result()
            except OSError as exc:
                run.failed[name] = exc.strerror or str(exc)


def _report_png(run, title: str, truth, curves, panel=None) -> None:
    """report.png (``panel``: its slice panel when already drawn), and the same picture into
    TensorBoard."""

    ts, metrics = run.ts, run.metrics
    try:
        img = report_image(run.volume, ts.pixel_size, metrics, title, truth, curves, run.half_curves, tilt_range(ts),
                           panel=panel)
    except Exception as exc:  # noqa: BLE001 - a picture must never cost the run its results
        log.warning("could not draw report.png (%s: %s); the other results are written", type(exc).__name__, exc)
        return
    img = img.convert("RGB")
    encoded = png_bytes(img)  # once, for the file and TensorBoard
    try:
        save_png(run.out_dir / "report.png", img, encoded=encoded)
    except OSError as exc:
        run.failed["report.png"] = exc.strerror or str(exc)
    if run.cfg.logging.tensorboard:
        try:
            add_to_tensorboard(run.out_dir / "tb", "report", img, int(metrics.get("steps") or 0), encoded=encoded)
        except OSError as exc:
            log.warning("could not add report.png to TensorBoard (%s)", exc.strerror or exc)


def _shown_path(path: Path) -> str:
    """``path`` relative to the working folder when it lies inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


FLAT_FRACTION = 1e-4
"""A volume whose range, summed along its longest side, reaches less than this fraction of the
data's contrast explains nothing of the data: the field learned nothing. Measured (the ratio):
dead decoders 0 and 2e-18, a frozen fp16 run 2.5e-5; untrained fields (1-2 steps) 7.7e-4 to
3.9e-3; a working run 4 (300 steps of the embedded phantom)."""
FLAT_MIN_STEPS = 100
"""Runs of fewer steps (smoke tests) are not judged: their field may still be its start."""


def flat_volume(volume, ts) -> str | None:
    """What makes ``volume`` flat (see :data:`FLAT_FRACTION`), or None. The data's contrast: the
    99.9 % quantile of |stack - vacuum estimate| over a sample of the stack."""
    if volume is None or not volume.size:
        return None
    lo, hi = float(np.min(volume)), float(np.max(volume))
    sample = ts.stack.reshape(-1)[:: max(1, ts.stack.size // 1_000_000)]
    bg = (ts.metadata.get("background_estimate") or {}).get("value")
    bg = float(np.nanmedian(sample)) if bg is None else float(bg)
    contrast = float(np.nanquantile(np.abs(sample - bg), 0.999))
    reach = (hi - lo) * max(volume.shape)
    if contrast > 0 and reach < FLAT_FRACTION * contrast:
        return (f"its values span {lo:.3g}..{hi:.3g}, at most {reach:.3g} summed along its longest side, against "
                f"the data's contrast of {contrast:.3g}")
    return None


def write_problem(run):
    """(error class, message) when results are missing (rank 0), else None: a non-finite volume is a
    divergence; failed writes are rescued where possible and reported with what was saved where (a
    method without a checkpoint: what was written)."""

    written, failed, out_dir = run.written, run.failed, run.out_dir
    if not run.finite:
        where = written.get("checkpoints/last.pt")
        return (DivergenceError, "the reconstructed volume holds non-finite values (the field diverged); no volume "
                "file was written" + (f"; the checkpoint is {where}" if where else "") + ". Lower the learning rates "
                "(optim.lr_*) and run again.")
    if run.flat:
        return (DivergenceError, f"the reconstructed volume is flat ({run.flat}): the training learned nothing (a "
                "dead decoder, or poses that left the images); the volume file was written but holds no "
                "reconstruction. Lower the learning rates (optim.lr_*) and run again.")
    if not failed:
        return None
    if run.state is None:
        return (OutputWriteError, f"could not write {', '.join(f'{k} ({v})' for k, v in failed.items())} in "
                f"{out_dir}; written: {', '.join(written) or 'nothing'}")
    no_volume = not any(k.startswith("volume") for k in written) and any(k.startswith("volume") for k in failed)
    need = {"volume"} if no_volume else set()
    if "checkpoints/last.pt" in failed:
        need.add("checkpoint")
    rescued = rescue(run.volume, run.state, run.cfg, run.ts.pixel_size, need)
    ckpt = written.get("checkpoints/last.pt") or rescued.get("checkpoint")
    hint = f"fasttomo-reconstruct resume={ckpt} hydra.run.dir=<a writable folder>" if ckpt else None
    return (OutputWriteError, write_failure_message(out_dir, failed, written, rescued, hint))


def closing_summary(cfg: Config, out_dir: Path, metrics: dict, written: dict[str, int] | None = None) -> None:
    """The last lines of a finished run: folder, its files (``written``: the manifest's) and sizes,
    time, speed, quality, how to look."""

    try:
        lines = summary_lines(out_dir, metrics, cfg.logging.tensorboard, written)
    except OSError as exc:  # the folder vanished or cannot be listed: say so, the run itself is done
        lines = [f"run folder: {out_dir} (cannot be listed: {exc.strerror or exc})"]
    log.info("finished.\n%s", "\n".join(lines))


# --------------------------------------------------------------------------------------- errors
def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by input, config, the output folder or a checkpoint: reported as one clear
    line (exit code 2), no traceback."""
    from fasttomo.data.specimen import PhantomError
    from fasttomo.data.tiltseries import TiltSeriesError
    from fasttomo.kernels.dispatch import KernelUnavailableError
    from fasttomo.train.checkpoint import CheckpointError

    return (ConfigError, TiltSeriesError, OutputExistsError, OutputFolderError, CheckpointError,
            KernelUnavailableError, FileNotFoundError, PhantomError)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if not text or type(exc).__module__ == "builtins" else text


def log_failure(exc: BaseException, handler: logging.Handler | None) -> None:
    """The run's error into reconstruct.log (and the console): one line for the errors fasttomo
    explains (the entry point then does not repeat it), the traceback -- into the file only, the
    entry point prints it -- for anything else."""

    known = (*user_errors(), DivergenceError, OutputWriteError, RunInterrupted)
    if isinstance(exc, known):
        (log.warning if isinstance(exc, RunInterrupted) else log.error)("%s", exc)
        exc.fasttomo_logged = True
    elif isinstance(exc, KeyboardInterrupt):
        log.warning("interrupted")
    elif handler is not None:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "run failed with an unexpected error: %s",
                                (one_line(exc),), (type(exc), exc, exc.__traceback__))
        handler.handle(record)
