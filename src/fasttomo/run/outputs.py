"""Writing a run's results so that no finished work is lost: the volume files first, then the
checkpoint, each atomically; a failure to write one keeps the others, and when the run folder
itself cannot be written (read-only, full) the checkpoint and one MRC volume go to a rescue
folder under the system's temporary folder. The caller then raises :class:`OutputWriteError`,
whose one line says what was saved where.

Any failure of a write is a write failure, whatever the library raised (torch.save reports a
full disk as a ``RuntimeError``): it is logged with its reason and the other files are still
written.

Nothing non-finite is written: a volume with NaN/Inf voxels is not written at all (the caller
reports divergence), and metrics.json is strict JSON (non-finite numbers become null).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("fasttomo")

VOLUME_SUFFIX = {"mrc": "mrc", "h5": "h5", "tiff": "tif"}


class OutputWriteError(OSError):
    """Some results could not be written; the message says what was saved where."""


def volume_names(cfg, stem: str = "volume", xzy: bool | None = None) -> list[str]:
    """The volume files of ``cfg.output.formats`` named ``<stem>.<suffix>`` (plus ``<stem>_xzy.mrc``
    with output.imod_xzy, unless ``xzy`` says otherwise)."""
    names = [f"{stem}.{VOLUME_SUFFIX[f]}" for f in cfg.output.formats]
    if cfg.output.imod_xzy if xzy is None else xzy:
        names.append(f"{stem}_xzy.mrc")
    return names


def json_safe(obj):
    """``obj`` with every non-finite float replaced by None (strict JSON has no NaN/Infinity),
    numpy scalars and arrays turned into Python values."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps(obj) -> str:
    """Strict JSON text of ``obj`` (see :func:`json_safe`)."""
    return json.dumps(json_safe(obj), indent=2, allow_nan=False)


def _reason(exc: BaseException, folder: Path | None = None) -> str:
    """Why a write into ``folder`` failed, in a few words ("No space left on device", "Permission
    denied"; a full file system is named as such whatever the library said)."""
    from fasttomo.data.io.atomic import WriteFailed, disk_full

    if isinstance(exc, WriteFailed) and exc.strerror:
        return exc.strerror  # already in a few words
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)  # h5py, for one, puts its whole error stack in strerror
    if folder is not None and disk_full(str(folder)):
        return os.strerror(errno.ENOSPC)
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return " ".join(str(text).split())[:160] or type(exc).__name__


@dataclasses.dataclass(frozen=True)
class VolumeFiles:
    """What a volume's files carry and are called: the voxel size (A), the attributes (HDF5),
    the file stem, whether an IMOD x-z-y copy is written (None: as output.imod_xzy says), and the
    names not to write (already written, e.g. the slab-wise volume.mrc)."""

    pixel_size: float
    attrs: dict
    stem: str = "volume"
    xzy: bool | None = None
    skip: tuple = ()
    later: list | None = None
    """Where the slab-wise volume.mrc goes to the disk and takes its name on a thread
    (``data.io.atomic.PublishLater``, appended here), for the caller to join before it reports the
    file; None: before the export returns."""
    kept: bool = False
    """The slabs are views of a volume kept unchanged until ``later`` is joined (the GPU copy for
    the scoring): with ``later``, their copies to the host and writes go on after the export
    returns (``data.io.mrc.write_mrc_slabs``)."""


def write_volumes(out_dir: Path, volume: np.ndarray, cfg, files: VolumeFiles) -> tuple[dict[str, str], dict[str, str]]:
    """Write every configured volume file (each atomically; names of :func:`volume_names`, but
    those in ``files.skip``). Returns ({name: path}, {name: error})."""
    from fasttomo.data.io.volume import write_volume

    written, failed = {}, {}
    pixel_size, attrs = files.pixel_size, files.attrs
    for name in (n for n in volume_names(cfg, files.stem, files.xzy) if n not in files.skip):
        rotated = name.endswith("_xzy.mrc")
        fmt = "mrc" if rotated else {v: k for k, v in VOLUME_SUFFIX.items()}[name.rsplit(".", 1)[1]]
        try:
            written[name] = write_volume(out_dir / name, volume, pixel_size, label=cfg.name,
                                         attrs=attrs, fmt=fmt, overwrite=True, imod_xzy=rotated)
        except Exception as exc:  # noqa: BLE001 - any failure to write is a write failure
            failed[name] = _reason(exc, out_dir)
            log.error("could not write %s (%s)", out_dir / name, failed[name])
    return written, failed


def rescue_folder(run_name: str) -> Path:
    """A fresh folder under the system's temporary folder for results the run folder refused."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_name)[:40] or "run"
    return Path(tempfile.mkdtemp(prefix=f"fasttomo-rescue-{safe}-"))


def save_checkpoint_file(path: Path, state: dict) -> tuple[str | None, str | None]:
    """(path written, None) or (None, error); never raises for a failed write (of any kind)."""
    from fasttomo.train.checkpoint import save_checkpoint

    try:
        return str(save_checkpoint(path, state)), None
    except Exception as exc:  # noqa: BLE001 - any failure to write is a write failure
        reason = _reason(exc, Path(path).parent)
        log.error("could not write the checkpoint %s (%s)", path, reason)
        return None, reason


def rescue(volume: np.ndarray | None, state: dict | None, cfg, pixel_size: float, need: set[str]) -> dict[str, str]:
    """Write what the run folder refused (``need``: "checkpoint", "volume": the checkpoint, one MRC
    volume) to a rescue folder; returns {what: path} for what it saved there."""
    from fasttomo.data.io.volume import write_volume

    saved: dict[str, str] = {}
    need_volume, need_checkpoint = "volume" in need, "checkpoint" in need
    if not (need_volume or need_checkpoint):
        return saved
    try:
        folder = rescue_folder(cfg.name)
    except OSError as exc:
        log.error("could not create a rescue folder under %s either (%s)", tempfile.gettempdir(), _reason(exc))
        return saved
    if need_checkpoint and state is not None:
        path, _ = save_checkpoint_file(folder / "last.pt", state)
        if path:
            saved["checkpoint"] = path
    if need_volume and volume is not None:
        try:
            saved["volume"] = write_volume(folder / "volume.mrc", volume, pixel_size, label=cfg.name,
                                           attrs={}, fmt="mrc", overwrite=True)
        except Exception as exc:  # noqa: BLE001 - any failure to write is a write failure
            log.error("could not write the rescue volume in %s (%s)", folder, _reason(exc))
    if saved:
        log.warning("saved to the rescue folder %s: %s", folder, ", ".join(saved))
    else:
        try:
            os.rmdir(folder)
        except OSError:
            pass
    return saved


def write_failure_message(out_dir: Path, failed: dict[str, str], kept: dict[str, str], rescued: dict[str, str],
                          resume_hint: str | None) -> str:
    """One line: what could not be written (files that failed for one reason named together), and
    what was saved where."""
    by_reason: dict[str, list[str]] = {}
    for name, why in failed.items():
        by_reason.setdefault(why, []).append(name)
    what = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_reason.items())
    parts = [f"could not write {what} in {out_dir}"]
    if kept:
        parts.append("saved: " + ", ".join(kept.values()))
    if rescued:
        parts.append("rescued to: " + ", ".join(rescued.values()))
    if not kept and not rescued:
        parts.append("nothing could be saved")
    fix = "free disk space or fix the folder's permissions"
    if resume_hint:
        fix += f", then write the results again without training: {resume_hint}"
    return "; ".join(parts) + f". {fix[0].upper()}{fix[1:]}."


def half_volume_names(cfg, stem: str) -> list[str]:
    """The files of one half tomogram: those of output.formats, plus MRC with output.half_volumes
    (what denoisers read); never the XZY copy."""
    names = volume_names(cfg, stem, xzy=False)
    if cfg.output.half_volumes and f"{stem}.mrc" not in names:
        names.append(f"{stem}.mrc")
    return names


def write_half_volume(out_dir: Path, volume: np.ndarray, cfg, files: VolumeFiles,
                      half: str) -> tuple[dict[str, str], dict[str, str]]:
    """Write the ``half`` (even or odd) tomogram as ``volume_<half>.*`` (:func:`half_volume_names`,
    less ``files.skip``) with the full volume's header: its voxel size (``files.pixel_size``),
    label and orientation. Returns ({name: path}, {name: error})."""
    from fasttomo.data.io.volume import write_volume

    pixel_size = files.pixel_size
    written, failed = {}, {}
    for name in half_volume_names(cfg, f"volume_{half}"):
        if name in files.skip:
            continue
        fmt = {v: k for k, v in VOLUME_SUFFIX.items()}[name.rsplit(".", 1)[1]]
        try:
            written[name] = write_volume(out_dir / name, volume, pixel_size, label=f"fasttomo run {cfg.name}",
                                         attrs={"run": cfg.name, "half_set": half}, fmt=fmt, overwrite=True)
        except Exception as exc:  # noqa: BLE001 - any failure to write is a write failure
            failed[name] = _reason(exc, out_dir)
            log.error("could not write %s (%s)", out_dir / name, failed[name])
    return written, failed


def write_pose_files(out_dir: Path, poses: dict, ts, written: dict, failed: dict) -> None:
    """The run's poses as IMOD and AreTomo files for the stack file (poses.xf, poses.tlt, poses.aln;
    fasttomo.data.io.alignment), recorded in ``written`` / ``failed``; a series whose images were
    cropped or rotated is skipped with a log line."""
    from fasttomo.data.io.alignment import write_alignment_files

    try:
        paths = write_alignment_files(out_dir / "poses", poses, ts.metadata, (ts.height, ts.width),
                                      overwrite=True)
    except ValueError as exc:
        log.info("poses: no .xf/.tlt/.aln written: %s.", exc)
        return
    except OSError as exc:
        failed["poses.xf"] = _reason(exc)
        log.error("could not write the pose files in %s (%s)", out_dir, failed["poses.xf"])
        return
    written.update({os.path.basename(p): p for p in paths})
    log.info("poses written for IMOD and AreTomo: %s", ", ".join(paths))


# --------------------------------------------------------------------------------------- slab-wise export
EXPORT_BYTES_PER_VOXEL = 24
"""Bytes one voxel of a slab costs while it is evaluated: its normalized point (12), its density
(4), the density times the scale (4) and the host copy (4); the field's own work runs in chunks
of a fixed number of points."""


def free_memory_bytes(device: torch.device | None) -> int:
    """Free bytes of ``device`` (CUDA: the driver's count) and of the host (MemAvailable),
    whichever is smaller; a large number when neither can be read."""
    import torch

    free = []
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        free.append(int(torch.cuda.mem_get_info(device)[0]))
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    return min(free) if free else 1 << 40


EXPORT_SLAB_MAX_BYTES = 1 << 30
"""At most this many bytes of float32 planes a slab (1 GiB): larger slabs evaluate no faster and
only add to the host's peak (a 4096^2 plane is 64 MiB)."""


def slab_planes(shape_zyx, free_bytes: int) -> int:
    """Z planes per export slab: a quarter of ``free_bytes`` at :data:`EXPORT_BYTES_PER_VOXEL`
    per voxel and at most :data:`EXPORT_SLAB_MAX_BYTES` of float32, at least one plane, at most the
    whole volume."""
    voxels = int(shape_zyx[1]) * int(shape_zyx[2])
    cap = min(free_bytes // 4 // (EXPORT_BYTES_PER_VOXEL * voxels), EXPORT_SLAB_MAX_BYTES // (4 * voxels))
    return int(max(1, min(int(shape_zyx[0]), cap)))


def slab_planes_of(cfg):
    """``planes_of(shape, device)`` for a method's ``volume_slabs``: output.slab_planes, or
    :func:`slab_planes` of the free memory of the device (and the host)."""
    return lambda shape, device: cfg.output.slab_planes or slab_planes(shape, free_memory_bytes(device))


def field_slabs(projector, scale: float, shape_zyx, planes: int):
    """(z0, density of planes z0.. times ``scale``) of ``projector``'s volume, ``planes`` Z planes
    at a time, as float32 tensors on the projector's device (the writer tests them and takes their
    statistics there): the values of the one-shot export, slab by slab."""
    for lo in range(0, int(shape_zyx[0]), planes):
        hi = min(int(shape_zyx[0]), lo + planes)
        yield lo, projector.volume(tuple(shape_zyx), z_range=(lo, hi)) * scale


def scoring_copy(shape, device: torch.device, truth) -> torch.Tensor | None:
    """An empty float32 volume on the GPU for the slab-wise export to fill beside its file, so that
    the scoring against ``truth`` reads the volume there instead of reading the file back: only on
    a GPU, with a truth of the volume's shape that the scoring streams (more than
    ``quality.scoring.WHOLE_VOLUME_MAX_VOXELS`` voxels), where the free memory holds the pair with the
    scoring's headroom (``quality.scoring.SCORING_DEVICE_HEADROOM``); else None."""
    import torch

    from fasttomo.quality.scoring import SCORING_DEVICE_HEADROOM, WHOLE_VOLUME_MAX_VOXELS

    if truth is None or device.type != "cuda" or tuple(truth.shape) != tuple(shape) \
            or truth.size <= WHOLE_VOLUME_MAX_VOXELS:
        return None
    need = SCORING_DEVICE_HEADROOM * 8 * int(np.prod(shape))
    free = torch.cuda.mem_get_info(device)[0]
    if free < need:
        log.info("the scoring reads the volume back from its file (%.1f GB free on %s, %.1f GB wanted to keep it "
                 "there beside the truth)", free / 1e9, device, need / 1e9)
        return None
    try:
        keep = torch.empty(tuple(int(n) for n in shape), dtype=torch.float32, device=device)
    except torch.cuda.OutOfMemoryError:
        return None
    log.info("the volume is also kept on %s for the scoring (%.1f GB)", device, keep.numel() * 4 / 1e9)
    return keep


def _copied(slabs, keep: torch.Tensor):
    """``slabs`` copied into their planes of ``keep``, each passed on as that view of ``keep`` (the
    slab's own memory freed at once; the writer may read the view after the export returns)."""
    for z0, slab in slabs:
        view = keep[z0:z0 + slab.shape[0]]
        view.copy_(slab)
        del slab
        yield z0, view


def export_field(trainer, cfg, out_dir: Path, files: VolumeFiles, truth=None):
    """Evaluate the trainer's field and write the configured volume files (``files``: voxel size
    and attributes); returns (volume,
    written, failed, finite, the volume on the GPU or None). Collective under DDP (call it on every
    rank, inside ``trainer.exported_field()``; ranks other than 0 get (None, {}, {}, True, None)).

    One process with mrc among the formats: the volume is evaluated slab by slab (output.slab_planes,
    or sized from the free memory) straight into volume.mrc (:func:`export_slabs`), and the volume
    handed back is a read-only map of that file, so the other formats, the pictures (central
    slices) and the scores page it in as they need it; with a ``truth`` to score against, the slabs
    are also kept on the GPU where it has room (:func:`scoring_copy`), and with ``files.later`` the
    file's copies to the host and writes then go on from that copy after the return (read the map
    only after ``files.later[-1].wait_written()``). Otherwise (DDP, no mrc, a volume.mrc that
    cannot be written or a non-finite slab) the whole volume is evaluated in memory as before."""
    shape = tuple(cfg.output.volume_shape) if cfg.output.volume_shape is not None else trainer.projector.box.shape_zyx
    if trainer.world_size == 1 and "volume.mrc" in volume_names(cfg):
        keep = scoring_copy(shape, trainer.device, truth)
        planes = slab_planes_of(cfg)(shape, trainer.device)
        slabs = field_slabs(trainer.projector, trainer.sampler.scale, shape, planes)
        source = (shape, planes, slabs if keep is None else _copied(slabs, keep))
        done = export_slabs(source, cfg, out_dir, files if keep is None else dataclasses.replace(files, kept=True))
        if done is not None:
            return (*done, True, keep)
        del keep
    volume = trainer.export_volume(shape)  # collective
    if not trainer.main:
        return None, {}, {}, True, None
    if not np.isfinite(volume).all():
        log.error("the volume holds %d non-finite voxels (of %d); no volume file was written",
                  int((~np.isfinite(volume)).sum()), volume.size)
        return volume, {}, {}, False, None
    written, failed = write_volumes(out_dir, volume, cfg, files)
    return volume, written, failed, True, None


def export_slabs(source, cfg, out_dir: Path, files: VolumeFiles):
    """volume.mrc written from ``source`` = (shape, Z planes a slab, slabs: (z0, array or tensor)
    in Z order), then the run's other formats from a read-only map of it (``files``: voxel size,
    attributes, and with ``files.kept`` and ``files.later`` writes that go on after the return):
    (volume map, written, failed), or None when a slab held non-finite values or volume.mrc could
    not be written (the caller then takes the volume whole)."""
    from fasttomo.data.io.mrc import NonFiniteSlab, mrc_memmap

    shape, planes, slabs = source
    log.info("exporting the volume %s in slabs of %d Z planes", tuple(shape), planes)
    try:
        t0, waited = time.perf_counter(), [0.0]
        path, split = write_volume_slabs(out_dir / "volume.mrc", shape, _timed(slabs, waited), files, cfg.name)
        total = time.perf_counter() - t0
        if files.kept and files.later is not None:
            log.info("volume.mrc evaluated in %.1f s: waiting for the slabs' evaluation %.1f s, their statistics "
                     "%.1f s; its copies to the host and writes go on from the GPU copy", total, waited[0],
                     split.get("copy_to_host", 0.0))
        else:
            rest = total - waited[0] - split.get("copy_to_host", 0.0) - split.get("queue_wait", 0.0)
            log.info("volume.mrc evaluated and written in %.1f s: waiting for the slabs' evaluation %.1f s, their "
                     "statistics and copies to the host %.1f s, the writer's queue %.1f s, closing the file %.1f s "
                     "(the writer thread's writes %.1f s)", total, waited[0], split.get("copy_to_host", 0.0),
                     split.get("queue_wait", 0.0), rest, split.get("write", 0.0))
        volume = path if isinstance(path, np.memmap) else mrc_memmap(path)  # files.later: the map already
        others = [n for n in volume_names(cfg, files.stem, files.xzy) if n != "volume.mrc"]
        if others and files.later and files.later[-1].wait_written() is not None:  # the other formats read the map
            pending = files.later.pop()
            pending.join()  # raises the write's error (its temporary file removed)
        written, failed = write_volumes(out_dir, volume, cfg, dataclasses.replace(files, skip=("volume.mrc",)))
        return volume, {"volume.mrc": os.fspath(out_dir / "volume.mrc"), **written}, failed
    except NonFiniteSlab:
        log.warning("the volume holds non-finite values; evaluating it whole to count them")
    except OSError as exc:
        log.error("could not write %s (%s); evaluating the volume in memory", out_dir / "volume.mrc", _reason(exc))
    return None


def _timed(slabs, waited: list):
    """``slabs`` ((z0, array or tensor)), adding the seconds spent producing each to ``waited[0]``
    (a GPU slab's kernels waited for: the writer would wait for them next anyway)."""
    source = iter(slabs)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(source)
            if getattr(item[1], "is_cuda", False):
                import torch

                torch.cuda.synchronize(item[1].device)
        except StopIteration:
            return
        finally:
            waited[0] += time.perf_counter() - t0
        yield item


def write_volume_slabs(path: Path, shape_zyx, slabs, files: VolumeFiles, run_name: str) -> tuple[str, dict]:
    """volume.mrc of a run from ``slabs`` ((z0, array) in Z order), atomically, with the labels
    :func:`fasttomo.data.io.volume.write_volume` gives it: the same bytes as the one-shot write
    (voxel size ``files.pixel_size``; its last step on a thread with ``files.later``, and with
    ``files.kept`` its writes too). Returns (the path, or with ``files.later`` a read-only map of the
    file, and the seconds of its parts: see :func:`fasttomo.data.io.mrc.write_mrc_slabs`)."""
    from fasttomo.data.io.mrc import MrcHeader, write_mrc_slabs
    from fasttomo.data.io.volume import mrc_label

    header, timings = MrcHeader(files.pixel_size, (mrc_label(run_name),)), {}
    out = write_mrc_slabs(path, shape_zyx, slabs, header, overwrite=True, timings=timings, later=files.later,
                          kept=files.kept)
    log.info("wrote mrc volume %s slab by slab (Z, Y, X = %s, voxel %.4g A)%s", path, tuple(shape_zyx),
             files.pixel_size, "; it goes to the disk while the run goes on" if files.later is not None else "")
    return out, timings
