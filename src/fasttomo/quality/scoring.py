"""Scoring inside a reconstruction run: against a ground truth when there is one, and without one
(held-out views, even/odd half sets).

* :func:`attach_truth`: ``evaluation.truth`` (a volume file) becomes the tilt series' ground truth,
  so synthetic data given as files is scored exactly like the built-in phantom.
* :func:`truth_scores`: Pearson (global and over the specimen), plus the FSC summary against the
  truth (0.5 and 0.143 crossings, in Angstrom) when the volumes match.
* :func:`split_holdout`: ``evaluation.holdout_views`` leaves views out of training;
  :func:`holdout_scores` compares each left-out image with the reconstruction's prediction of it
  (Pearson per view, and the RMS residual in the stack's units; metrics.projection_metrics).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import torch

from fasttomo.data.tiltseries import TiltSeries, TiltSeriesError
from fasttomo.quality.metrics import CHUNK_FSC_CROP


class EvaluateError(ValueError):
    """The inputs cannot be compared as given; the message names both sides and the fix."""

log = logging.getLogger("fasttomo")


def attach_truth(ts: TiltSeries, path: str, thickness: int | None) -> None:
    """The ground-truth volume file ``path`` as ``ts.ground_truth`` ((Z, H, W) required): a
    read-only map of a float32 MRC (``data.io.volume.map_volume``), else read whole."""
    from fasttomo.data.io.volume import map_volume, read_volume

    vol = map_volume(path)
    if vol is None:
        vol, _, _ = read_volume(path, key="evaluation.truth")
    if vol.ndim != 3 or vol.shape[1:] != (ts.height, ts.width) or (thickness is not None and vol.shape[0] != thickness):
        want = f"({thickness if thickness is not None else 'Z'}, {ts.height}, {ts.width})"
        raise TiltSeriesError(f"{path}: evaluation.truth has shape {tuple(vol.shape)} but the reconstruction box "
                              f"is (Z, Y, X) = {want}; give the truth volume of this tilt series (after binning "
                              "and cropping) or set data.thickness to its Z.")
    ts.ground_truth = vol if isinstance(vol, np.memmap) else np.ascontiguousarray(vol, dtype=np.float32)
    log.info("evaluation: scoring against the ground truth %s %s", path, tuple(vol.shape))


FLAT_FSC_KEYS = ("fsc05_A", "fsc0143_A")


def fsc_flat(report: dict) -> dict:
    """The crossings of a :func:`score_against_truth`-style report as flat keys:
    fsc05_A, fsc0143_A and, per Fourier region, fsc05_measured_A, fsc0143_wedge_A, ..."""
    out = {}
    for name, suffix in (("fsc", ""), ("fsc_measured", "_measured"), ("fsc_wedge", "_wedge")):
        for key in FLAT_FSC_KEYS:
            if name in report and report[name].get(key) is not None:
                out[key.replace("_A", f"{suffix}_A")] = report[name][key]
    return out


def truth_scores(volume: np.ndarray, truth: np.ndarray, voxel_size: float,
                 tilt_range: tuple[float, float] | None = None,
                 vol_on_device: torch.Tensor | None = None, volume_ready=None) -> tuple[dict, dict]:
    """Scores of ``volume`` against ``truth`` (same shape): Pearson global/foreground, MSE, PSNR
    (data range: the truth's max - min), FSC over all of Fourier space and in the measured region
    and the missing wedge of ``tilt_range``; flat crossing keys (:func:`fsc_flat`) on top
    (``vol_on_device``, ``volume_ready``: see :func:`score_against_truth`). Returns (metrics, FSC
    curves by region)."""
    report, curves = score_against_truth(volume, truth, voxel_size, tilt_range=tilt_range,
                                         vol_on_device=vol_on_device, volume_ready=volume_ready)
    report.update(fsc_flat(report))
    return report, curves


def pair_fsc(a: np.ndarray, b: np.ndarray, voxel_size: float, tilt_range: tuple[float, float] | None) -> tuple[dict, dict]:
    """FSC of two independent reconstructions (e.g. even/odd half sets; numpy arrays, maps or torch
    tensors), by region; flat keys too."""
    from fasttomo.quality.metrics import fsc, host_array, sector_fsc

    if math.prod(a.shape) > WHOLE_VOLUME_MAX_VOXELS:
        curves = large_fsc(a, b, voxel_size, tilt_range)  # numpy arrays, maps or tensors, crop by crop
    else:
        a, b = host_array(a), host_array(b)
        curves = {"all": fsc(a, b, voxel_size)} if tilt_range is None else sector_fsc(a, b, voxel_size, tilt_range)
    report = {("fsc" if r == "all" else f"fsc_{r}"): c.summary() for r, c in curves.items()}
    report.update(fsc_flat(report))
    return report, curves


@dataclasses.dataclass
class Holdout:
    """Views left out of training."""

    index: np.ndarray
    """Indices of the held-out views in the prepared series."""
    view_numbers: list[int]
    """Their 1-based numbers in the file."""
    stack: np.ndarray
    angles: np.ndarray
    valid: np.ndarray | None


def split_holdout(ts: TiltSeries, views_1based: list[int]) -> tuple[TiltSeries, Holdout | None]:
    """(training series, held-out views) for 1-based file view numbers ``views_1based``."""
    if not views_1based:
        return ts, None
    numbers = list(ts.metadata.get("view_numbers") or range(1, ts.n_tilts + 1))
    missing = sorted(set(views_1based) - set(numbers))
    if missing:
        gone = [v for v in missing if min(numbers) <= v <= max(numbers)]  # inside the file's range: excluded
        why = (f"{gone} {'was' if len(gone) == 1 else 'were'} left out of the series before training (by "
               "data.exclude_views, or dropped as dark)" if gone else
               f"the series' views are {min(numbers)}..{max(numbers)} (1-based)")
        raise TiltSeriesError(f"{ts.source}: evaluation.holdout_views {missing} are not views of this series ({why}); "
                              "hold out views that are used.")
    held = np.array(sorted(numbers.index(v) for v in set(views_1based)))
    keep = np.setdiff1d(np.arange(ts.n_tilts), held)
    if keep.size < 2:
        raise TiltSeriesError(f"{ts.source}: evaluation.holdout_views leaves {keep.size} view(s) to train on; "
                              "hold out fewer views.")
    if ts.reference_index() in held:
        log.info("evaluation: the held-out views include the smallest-|tilt| view; the reference of the poses "
                 "becomes the next smallest.")
    sub = lambda a: None if a is None else np.ascontiguousarray(a[keep])  # noqa: E731
    meta = dict(ts.metadata)
    meta["view_numbers"] = [numbers[i] for i in keep]
    meta["holdout_view_numbers"] = [numbers[i] for i in held]
    train = TiltSeries(stack=sub(ts.stack), angles=ts.angles[keep], pixel_size=ts.pixel_size, source=ts.source,
                       metadata=meta, ground_truth=ts.ground_truth, valid=sub(ts.valid))
    hold = Holdout(held, [numbers[i] for i in held], ts.stack[held], ts.angles[held],
                   None if ts.valid is None else ts.valid[held])
    log.info("evaluation: views %s (1-based) held out of training, %d views remain", hold.view_numbers, keep.size)
    return train, hold


RENDER_POINTS = 1 << 19
"""A pass that renders views (:func:`render_views`: the per-view residuals, the held-out views)
evaluates the field at most at about this many sample points at once (rays per chunk = this /
samples per ray), fewer when free memory is short: a no-grad field evaluation keeps roughly
:data:`NOGRAD_POINT_FLOATS` floats per point, about 0.25 GB at 32 features on the CPU."""

RENDER_MEMORY_FRACTION = 0.25
"""... and at most this fraction of the free memory (the device's, or the host's for the CPU)."""


def nograd_point_bytes(n_features: int, hidden: int, native_decoder: bool = False) -> int:
    """Bytes a no-grad field evaluation holds per sample point (coordinates, plane features,
    decoder activations; measured about 430-590 B at 32 features and 32 hidden units on the CPU's
    aten decoder). ``native_decoder``: the CPU's C decoder (kernels/cpu_mlp.py), which writes no
    hidden layer to memory."""
    return 4 * (8 + (3 * n_features) // 2 + (0 if native_decoder else 2 * hidden))


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (CUDA: the driver's free bytes; CPU: MemAvailable of
    /proc/meminfo), or None where it cannot be read."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except RuntimeError:
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def render_chunk_rays(samples_per_ray: int, point_bytes: int, free: int | None, chunk: int | None = None) -> int:
    """Rays per chunk of a rendering pass: at most :data:`RENDER_POINTS` points, at most
    :data:`RENDER_MEMORY_FRACTION` of ``free`` bytes, at most ``chunk`` rays (when given)."""
    points = RENDER_POINTS
    if free is not None:
        points = min(points, int(RENDER_MEMORY_FRACTION * free) // max(1, point_bytes))
    rays = max(1, points // max(1, int(samples_per_ray)))
    return rays if chunk is None else max(1, min(int(chunk), rays))


def field_point_bytes(proj) -> int:
    """:func:`nograd_point_bytes` of ``proj``'s field."""
    decoder = getattr(proj.field, "decoder", None)
    hidden = max((int(getattr(m, "out_features", 0)) for m in decoder.modules()), default=0) if decoder else 0
    native = bool(decoder is not None and getattr(decoder, "evaluates_natively", lambda: False)())
    return nograd_point_bytes(int(getattr(proj.field, "n_features", 1)), hidden, native)


@torch.no_grad()
def render_views(proj, n: int, chunk: int | None = None, stride: int = 1) -> np.ndarray:
    """Pixels of views 0..n-1 through ``proj`` (a Projector): (n, H, W) numpy, or with ``stride``
    s every s-th row and column, (n, ceil(H/s), ceil(W/s)). Rays go through in chunks sized by
    :func:`render_chunk_rays` (``chunk`` caps the rays per chunk)."""
    h, w = proj.image_hw
    device = next(proj.field.parameters()).device
    chunk = render_chunk_rays(proj.samples_per_ray, field_point_bytes(proj), free_memory_bytes(device), chunk)
    rows = torch.arange(0, h, stride, device=device)
    cols = torch.arange(0, w, stride, device=device)
    hs, ws = rows.numel(), cols.numel()
    ids = torch.arange(n * hs * ws, device=device)
    out = torch.empty(n * hs * ws, device=device)
    for lo in range(0, ids.numel(), chunk):
        i = ids[lo:lo + chunk]
        tilt = torch.div(i, hs * ws, rounding_mode="floor")
        rem = i - tilt * hs * ws
        r = torch.div(rem, ws, rounding_mode="floor")
        out[lo:lo + chunk] = proj(tilt, rows[r], cols[rem - r * ws])
    return out.reshape(n, hs, ws).cpu().numpy()


VIEW_RESIDUAL_RAYS = 1 << 16
"""At most about this many pixels (rays) are predicted for :func:`view_residuals`, all views
together: a regular grid of every s-th row and column (s = 2 for the embedded 61 x 64 x 64
series, about 1,000 pixels per view). Per-view scores from a thousand pixels still single out a
bad view, and the cost stays a fraction of a second on a GPU and a few seconds on a CPU however
large the images are."""


def residual_stride(n: int, h: int, w: int, budget: int = VIEW_RESIDUAL_RAYS) -> int:
    """The smallest pixel stride s with n * ceil(h/s) * ceil(w/s) <= budget."""
    s = max(1, int(math.floor(math.sqrt(n * h * w / budget))))
    while n * (-(-h // s)) * (-(-w // s)) > budget:
        s += 1
    return s


def view_residuals(projector, ts: TiltSeries, scale: float, chunk: int | None = None,
                   budget: int = VIEW_RESIDUAL_RAYS) -> dict:
    """How well the fit explains each training view: the projector (field, learned poses,
    intensity model) predicts the pixels, compared in the stack's units with the measured image
    (Pearson and RMS residual per view, no fitted scale or offset). A view that the others do not
    explain (a bad tilt, a jump in the stage, a frame with a different dose) stands out. Only a
    regular grid of pixels is predicted (every ``pixel_stride``-th row and column, at most about
    ``budget`` pixels in all, see :data:`VIEW_RESIDUAL_RAYS`). Returns per-view lists (1-based view
    numbers, tilt, Pearson, RMS residual), their mean, the three worst views by Pearson and the
    stride used."""
    from fasttomo.quality.metrics import projection_metrics

    n, (h, w) = ts.n_tilts, projector.image_hw
    s = residual_stride(n, h, w, budget)
    pred = render_views(projector, n, chunk, s) * float(scale)
    valid = None if ts.valid is None else ts.valid[:, ::s, ::s]
    pm = projection_metrics(ts.stack[:, ::s, ::s], pred, valid, fit="none").to_json()
    numbers = list(ts.metadata.get("view_numbers") or range(1, ts.n_tilts + 1))
    angles = ts.angles if ts.angles.ndim == 1 else ts.angles.mean(axis=1)
    r = np.asarray(pm["pearson"], dtype=np.float64)
    worst = [int(i) for i in np.argsort(np.where(np.isfinite(r), r, np.inf))[:3]]
    return {"view_numbers": numbers, "tilt_deg": [float(a) for a in angles], "pearson": pm["pearson"],
            "rms_residual": pm["rms"],
            "pearson_mean": float(np.nanmean(r)) if np.isfinite(r).any() else None,  # None: flat predictions
            "worst_views": [numbers[i] for i in worst], "pixel_stride": s}


def holdout_scores(hold: Holdout, predicted: np.ndarray) -> dict:
    """Scores of the predicted held-out images (in the stack's units, no fitted scale or offset)
    against the measured ones: Pearson and RMS residual per view, their mean and worst."""
    from fasttomo.quality.metrics import projection_metrics

    pm = projection_metrics(hold.stack, predicted, hold.valid, fit="none")
    summary = pm.summary()
    per_view = pm.to_json()
    return {"view_numbers": hold.view_numbers, "pearson": per_view["pearson"], "rms_residual": per_view["rms"],
            "pearson_mean": summary["pearson_mean"], "pearson_min": summary["pearson_min"]}


WHOLE_VOLUME_MAX_VOXELS = 1 << 28
"""Above this many voxels (1024 x 1024 x 256) scores against a truth are streamed: Pearson and MSE
from slab-wise sums, the FSC from summed crops (``quality.metrics.chunked_fsc``), so a camera-sized
volume needs no whole-volume transform or float64 copy."""


STREAMED_MOMENTS_ABOVE = 1 << 24
"""Above this many voxels (256^3) Pearson and MSE come from float64 slab sums on the scoring device
(``quality.metrics.streamed_volume_metrics``: the whole-volume values to float64 rounding) even
where the FSC is still one transform: numpy's float64 copies of a 1024^2 x 256 pair cost more
than the transform (2-core CPU, 512^2 x 256: 41 s in numpy, 17 s streamed on the CPU)."""


SCORING_DEVICE_HEADROOM = 2.0
""":func:`on_scoring_device` moves a pair to the GPU only when its free memory is at least this
many times the pair's float32 bytes (the crops' transforms and the moments' float64 slabs come
on top)."""


def on_scoring_device(vol: np.ndarray, truth: np.ndarray, vol_on_device: torch.Tensor | None = None):
    """(volume, truth) as float32 tensors on the scoring GPU, read once from the host (memory maps
    welcome: a slab at a time, each slab's pages released after it), or None where there is no GPU
    or too little free memory (:data:`SCORING_DEVICE_HEADROOM`). Both the streamed moments and the
    FSC crops then read device memory instead of paging the files in once per pass (three passes
    over a camera-sized pair). ``vol_on_device``: the volume's values already on that device (the
    export's copy), so only the truth is read."""
    from fasttomo.quality.metrics import host_tensor, scoring_device

    device = scoring_device()
    if device is None:
        return None
    from fasttomo.data.io.mrc import drop_mapped_pages

    kept = (vol_on_device is not None and tuple(vol_on_device.shape) == tuple(vol.shape)
            and vol_on_device.device == _indexed(torch.device(device)))
    need = 4 * (truth.size if kept else vol.size + truth.size)
    free = free_memory_bytes(torch.device(device))
    if free is None or free < SCORING_DEVICE_HEADROOM * need:
        return None
    planes = max(1, (1 << 26) // max(1, int(np.prod(vol.shape[1:]))))
    out = [vol_on_device.float()] if kept else []
    try:
        for v in (truth,) if kept else (vol, truth):
            t = torch.empty(v.shape, dtype=torch.float32, device=device)
            for z0 in range(0, v.shape[0], planes):
                t[z0:z0 + planes].copy_(host_tensor(np.ascontiguousarray(v[z0:z0 + planes], dtype=np.float32)))
                drop_mapped_pages(v[z0:z0 + planes])
            out.append(t)
    except torch.cuda.OutOfMemoryError:
        out.clear()
        torch.cuda.empty_cache()
        return None
    return out[0], out[1]


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current GPU)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def large_fsc(a: np.ndarray, b: np.ndarray, voxel_size_A: float, tilt_range) -> dict:
    """FSC curves by region (``{"all"}``, plus measured and wedge with ``tilt_range``) of two
    large volumes from crops (``quality.metrics.chunked_fsc``, crops of CHUNK_FSC_CROP voxels)."""
    from fasttomo.quality.metrics import chunked_fsc

    log.info("FSC of a %s volume from crops of %d^3 voxels (more than %d voxels)", tuple(a.shape), CHUNK_FSC_CROP,
             WHOLE_VOLUME_MAX_VOXELS)
    return chunked_fsc(a, b, voxel_size_A, tilt_range)


def score_against_truth(vol: np.ndarray, truth: np.ndarray, voxel_size_A: float, *, tilt_range=None,
                        data_range: float | None = None, mask: np.ndarray | None = None,
                        vol_on_device: torch.Tensor | None = None, volume_ready=None) -> tuple[dict, dict]:
    """Pearson (global, foreground), MSE, PSNR, FSC (and measured/wedge FSC with ``tilt_range``);
    ``vol_on_device``: ``vol``'s values on the scoring device (:func:`on_scoring_device`);
    ``volume_ready``: where ``vol`` is a map of a file still being written from that copy, called
    (and its return read instead of ``vol``) before ``vol`` itself is read.

    Returns ``(metrics, curves)``: the JSON-ready dict (keys ``pearson_global``,
    ``pearson_foreground``, ``foreground_fraction``, ``mse``, ``psnr_dB``, ``data_range``,
    ``data_range_source``, ``fsc`` and, with a tilt range, ``tilt_range_deg``, ``fsc_measured``,
    ``fsc_wedge``) and the :class:`~fasttomo.quality.metrics.FSCCurve` objects by region.
    """
    from fasttomo.quality.metrics import fsc, mse, psnr, sector_fsc, streamed_volume_metrics, volume_metrics

    if vol.shape != truth.shape:
        raise EvaluateError(f"the volume has shape (Z, Y, X) = {vol.shape} but the truth has {truth.shape}; they must "
                            "match voxel for voxel. Crop or resample one of them.")
    large = mask is None and vol.size > WHOLE_VOLUME_MAX_VOXELS
    streamed = mask is None and vol.size > STREAMED_MOMENTS_ABOVE
    cast = truth.dtype.type  # the span in the truth's own precision, as truth.max() - truth.min() gives it
    t0 = time.perf_counter()
    pair = on_scoring_device(vol, truth, vol_on_device) if large and streamed else None
    if pair is None and volume_ready is not None:
        vol = volume_ready()
    vol, truth = pair or (vol, truth)
    out = streamed_volume_metrics(vol, truth) if streamed else volume_metrics(vol, truth)
    t_min, t_max = (cast(out.pop("truth_min")), cast(out.pop("truth_max"))) if streamed else (truth.min(), truth.max())
    if data_range is None:
        span = float(t_max - t_min)
        if not span > 0:
            raise EvaluateError("the truth volume is constant, so PSNR has no data range; set data_range=<value>.")
        out["data_range"], out["data_range_source"] = span, "truth max - min"
    else:
        out["data_range"], out["data_range_source"] = float(data_range), "data_range="
    if not streamed:
        out["mse"] = mse(vol, truth)
        out["psnr_dB"] = psnr(vol, truth, out["data_range"])
    else:
        out["psnr_dB"] = math.inf if out["mse"] == 0 else 10.0 * math.log10(out["data_range"] ** 2 / out["mse"])
    t1 = time.perf_counter()
    if large:
        curves = large_fsc(vol, truth, voxel_size_A, tilt_range)
        out["fsc_crops"] = CHUNK_FSC_CROP
    elif tilt_range is None:
        curves = {"all": fsc(vol, truth, voxel_size_A, mask=mask)}
    else:
        curves = sector_fsc(vol, truth, voxel_size_A, tilt_range, mask=mask)
    if tilt_range is not None:
        out["tilt_range_deg"] = [float(t) for t in tilt_range]
    out["fsc_masked"] = mask is not None
    for region, curve in curves.items():
        out["fsc" if region == "all" else f"fsc_{region}"] = curve.summary()
    t2 = time.perf_counter()
    out["scoring_seconds"] = {"moments": round(t1 - t0, 3), "fsc": round(t2 - t1, 3)}
    log.info("scored against the truth in %.1f s (Pearson and MSE %.1f s, FSC %.1f s)", t2 - t0, t1 - t0, t2 - t1)
    return out, curves
