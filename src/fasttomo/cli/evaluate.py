"""`fasttomo-evaluate`: score a volume against a ground truth and/or against its own tilt series.

    fasttomo-evaluate volume=run/volume.mrc truth=phantom_truth.mrc tilt_range=[-60,60]
        -> run/volume_eval/metrics.json, fsc.png: Pearson (global, foreground), PSNR, FSC curve
           and its 0.5 / 0.143 crossings, FSC in the measured region and in the missing wedge
    fasttomo-evaluate volume=run/volume.mrc tiltseries=tilts.ali angles=tilts.tlt held_out_views=[5,30]
        -> metrics.json, views_pearson.png, views_residual.png: the volume forward-projected into
           every view, per-view correlation and residual (data without ground truth)

Any volume fasttomo reads (MRC with its voxel size, HDF5, TIFF) can be scored. The voxel size
comes from the volume's header (``voxel_size=`` overrides it); the tilt range of the wedge FSC
from ``tilt_range=`` or, when a tilt series is given, from its angles. The tilt series must be
the one the volume was reconstructed from, as the volume sees it: the same binning and crop,
the tilt axis along Y (an aligned stack), so its images are (H, W) = (Y, X) of the volume.
Results go to ``out=`` (default ``<volume stem>_eval`` next to the volume), which must not hold
results of an earlier evaluation unless ``overwrite=true``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from fasttomo.config import ConfigError, _require, tool_device
from fasttomo.quality.plots import fsc_plot  # noqa: F401 - the FSC picture (shared with the runs)

log = logging.getLogger("fasttomo")

def __getattr__(name: str):
    """``EvaluateError`` and ``score_against_truth`` (shared with the runs) come from
    fasttomo.quality.scoring, which imports torch: loaded when first asked for, so --help and a
    command-line error start without torch."""
    if name in ("EvaluateError", "score_against_truth"):
        from fasttomo.quality import scoring

        return getattr(scoring, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _error(message: str) -> Exception:
    """An ``EvaluateError`` (one line, exit code 2)."""
    from fasttomo.quality.scoring import EvaluateError

    return EvaluateError(message)


RESULT_NAMES = ("metrics.json", "fsc.png", "views_pearson.png", "views_residual.png")
"""Files an evaluation writes; an output folder holding any of them is refused unless overwrite."""




@dataclasses.dataclass
class EvaluateConfig:
    volume: Optional[str] = None
    """The volume to score (.mrc/.rec/.map, .h5, .tif), an array (Z, Y, X)."""
    truth: Optional[str] = None
    """Ground-truth volume of the same shape: Pearson, PSNR, FSC (and sector FSC with a tilt range)."""
    tiltseries: Optional[str] = None
    """Tilt stack the volume was reconstructed from (.mrc/.st/.ali, .h5, .tif), images (H, W) = (Y, X):
    per-view correlation and residual of the forward-projected volume (no ground truth needed)."""
    angles: Optional[str] = None
    """Angle file of the tilt series (.rawtlt/.tlt degrees, or .mdoc); None: from the stack file."""
    voxel_size: Optional[float] = None
    """Voxel size in Angstrom; overrides the volume's header (the FSC's frequency axis)."""
    tilt_range: Optional[list] = None
    """[min, max] tilt angles in degrees for the measured/missing-wedge FSC; None: the tilt
    series' angles when one is given, else no sector FSC."""
    data_range: Optional[float] = None
    """PSNR's peak value range; None: the truth's max - min (stated in metrics.json)."""
    mask: Optional[str] = None
    """Optional soft real-space mask volume (values in [0, 1], same shape) applied before the FSC."""
    fit: str = "global"
    """Intensity model between the projected volume and the measured stack before the residual:
    global (one scale and offset for the whole stack, as fasttomo's normalization), per_view, none."""
    held_out_views: list = dataclasses.field(default_factory=list)
    """1-based view numbers (as IMOD) held out of the reconstruction: summarized separately."""
    step: float = 0.5
    """Forward projection: sample spacing along each ray, in voxels."""
    device: str = "auto"
    """Forward projection device: auto (the first GPU if torch sees one), cpu, cuda, cuda:N."""
    out: Optional[str] = None
    """Output folder; None: <volume stem>_eval next to the volume."""
    overwrite: bool = False
    """Replace the results of an earlier evaluation in the output folder."""

    def __post_init__(self) -> None:
        _require(self.fit in ("global", "per_view", "none"), "fit",
                 f"must be one of ['global', 'per_view', 'none'], got {self.fit!r}.")
        for name in ("voxel_size", "data_range"):
            v = getattr(self, name)
            if v is not None:
                _require(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, name,
                         f"must be a positive number, got {v!r}; set {name}=<number> or leave it unset.")
        _require(isinstance(self.step, (int, float)) and math.isfinite(self.step) and self.step > 0, "step",
                 f"must be > 0 voxels, got {self.step!r}.")
        if self.tilt_range is not None:
            tr = self.tilt_range
            ok = (len(tr) == 2 and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                                       for t in tr) and tr[0] < tr[1] and tr[1] - tr[0] <= 180)
            _require(ok, "tilt_range", f"must be [min, max] degrees with min < max (at most 180 apart), got {tr!r}; "
                     "e.g. tilt_range=[-60,60].")
        _require(all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.held_out_views),
                 "held_out_views", f"must be 1-based view numbers (integers >= 1), got {self.held_out_views!r}.")
        _require(self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:"), "device",
                 f"must be auto, cpu, cuda or cuda:N, got {self.device!r}.")


# --------------------------------------------------------------------------------------- helpers
def default_out_dir(volume: str | os.PathLike) -> Path:
    """``<volume stem>_eval`` next to the volume."""
    p = Path(volume)
    return p.with_name(p.stem + "_eval")


def _an_evaluation(path: Path) -> bool:
    """Whether ``path`` is the metrics.json of a fasttomo-evaluate (a reconstruction's has a status
    and no voxel-size source)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and "voxel_size_source" in found and "status" not in found


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse a folder holding results of an earlier evaluation (unless ``overwrite``)."""
    if out.exists() and not out.is_dir():
        raise _error(f"out={out}: exists and is not a folder; choose a folder name with out=<folder>.")
    if (out / "metrics.json").exists() and not _an_evaluation(out / "metrics.json"):
        raise _error(f"out={out}: holds a metrics.json that is not an evaluation's (a reconstruction's run folder?), "
                     "which fasttomo-evaluate never replaces; choose another folder with out=<folder> (without out= "
                     "it writes beside the volume, in <volume name>_eval).")
    found = [n for n in RESULT_NAMES if (out / n).exists()]
    if found and not overwrite:
        raise _error(f"out={out}: already holds results of an earlier evaluation ({', '.join(found)}); choose "
                     "another folder with out=<folder>, or set overwrite=true to replace them.")


def _jsonable(obj):
    """NaN/inf -> None, numpy scalars -> Python, recursively (metrics.json stays strict JSON)."""
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    return obj


def _res_text(c: dict, key: str) -> str:
    """'23.4 A' or why there is no crossing, from an FSC summary."""
    status = c[f"{key}_status"]
    if status == "crossed":
        return f"{c[f'{key}_A']:.3g} A"
    return {"never": f"not crossed up to Nyquist ({c['nyquist_A']:.3g} A)",
            "below_at_start": "below already at the first shell", "no_data": "no data"}[status]


def _read_volume(path: str, what: str):
    from fasttomo.data.io.volume import read_volume

    if not os.path.exists(path):
        raise _error(f"{what}={path}: file not found; check the path.")
    vol, vx, attrs = read_volume(path, key=what)
    return vol, vx, bool(attrs.get("voxel_size_assumed", False))


def _pick_voxel_size(cfg: EvaluateConfig, vx: float, assumed: bool, truth_vx: float | None,
                     truth_assumed: bool) -> tuple[float, str]:
    if cfg.voxel_size is not None:
        return float(cfg.voxel_size), "voxel_size="
    if not assumed:
        if truth_vx is not None and not truth_assumed and not math.isclose(vx, truth_vx, rel_tol=1e-3):
            raise _error(f"volume={cfg.volume} has a voxel size of {vx:.6g} A but truth={cfg.truth} has "
                         f"{truth_vx:.6g} A; they must describe the same grid. Resample one of them, or set "
                         "voxel_size=<A> if a header is wrong.")
        return vx, f"the header of {cfg.volume}"
    if truth_vx is not None and not truth_assumed:
        return truth_vx, f"the header of {cfg.truth}"
    log.warning("no voxel size in the files: assuming 1.0 A, so FSC frequencies are in 1/voxel. Set voxel_size=<A>.")
    return 1.0, "assumed (none in the files)"


# --------------------------------------------------------------------------------------- tilt series
def read_tiltseries(stack: str, angles: str | None):
    """(RawSeries) the stack, angles and validity mask as fasttomo reads them, unprepared."""
    from fasttomo.config import DataConfig
    from fasttomo.data.io import DataFileError, source_from_suffix
    from fasttomo.data.load import read_raw

    from fasttomo.data.prepare import check_angle_units, check_angles, refuse_constant
    from fasttomo.data.tiltseries import TiltSeriesError

    if not os.path.exists(stack):
        raise _error(f"tiltseries={stack}: file not found; check the path.")
    words = _OwnKeys()
    data_log = logging.getLogger("fasttomo.data")
    data_log.addFilter(words)  # the loader's warnings name fasttomo-reconstruct's keys
    try:  # the checks fasttomo-reconstruct makes of a series: its angles (degrees, distinct) and its signal
        raw = read_raw(DataConfig(source=source_from_suffix(stack), path=stack, angles=angles, normalize="none"))
        where = f"{raw.source} (angles from {raw.angle_source})"
        check_angles(raw.angles, where, np.arange(1, raw.stack.shape[0] + 1))
        check_angle_units(raw.angles, where)
        refuse_constant(raw.stack, raw.valid, raw.source)
        return raw
    except (DataFileError, TiltSeriesError) as exc:  # name this command's keys, not fasttomo-reconstruct's
        text = str(exc).replace("data.angles", "angles").replace("data.path", "tiltseries")
        for fix in (", or exclude views only through data.exclude_views (the file must still list every section)",
                    " or exclude the view (data.exclude_views)", ", e.g. data.exclude_views=[", "data.exclude_views",
                    ", or set data.check_angle_units=false"):
            if fix in text:  # evaluate scores the stack as it is: no views to exclude, no check to turn off
                text = text.split(fix)[0].rstrip(" ,;(") + "."
                break
        raise _error(text) from None
    finally:
        data_log.removeFilter(words)


class _OwnKeys(logging.Filter):
    """The loader's warnings in this command's words: its keys for the stack and the angles, and
    without the advice about settings it does not have (views to exclude, a pixel size to set)."""

    WORDS = ((" Check data.exclude_views and that the whole series was given.",
              " Check that the whole series was given."),
             ("; the volume's header and scale bars use it. If it is wrong, set data.pixel_size=<Angstrom>.", "."),
             ("data.angles", "angles"), ("data.path", "tiltseries"))

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        for old, new in self.WORDS:
            text = text.replace(old, new)
        text = re.sub(r", data\.tilt_axis_angle=\S+ is used\. For a raw \(unaligned\) stack set "
                      r"data\.tilt_axis_angle=\S+; an aligned \.ali already has the axis along Y\.",
                      "; fasttomo-evaluate takes the tilt axis along Y, as an aligned stack (.ali) has it.", text)
        if "data." in text:  # advice about a setting this command does not have: its sentence goes
            first, *rest = re.split(r"(?<=[.;])\s+", text)
            text = " ".join([first, *(part for part in rest if "data." not in part)]).rstrip(";")
        record.msg, record.args = text, None
        return True


def check_stack(vol_shape, stack_shape, held_out_views=()) -> list[int]:
    """The stack's images must be the volume's projections, (H, W) = (Y, X); held-out view
    numbers (1-based) must exist. Returns the sorted held-out view numbers."""
    n, h, w = stack_shape
    if (h, w) != tuple(vol_shape[1:]):
        raise _error(f"the tilt series has images of (H, W) = ({h}, {w}) (stack shape {tuple(stack_shape)}) but "
                     f"the volume has (Z, Y, X) = {tuple(vol_shape)}, so its projections are (Y, X) = "
                     f"{tuple(vol_shape[1:])}; give the stack as the reconstruction saw it (same binning and "
                     "crop, tilt axis along Y).")
    held = sorted(set(int(v) for v in held_out_views))
    if held and held[-1] > n:
        raise _error(f"held_out_views={held}: the tilt series has only {n} views (numbered 1..{n}).")
    return held


def load_projector() -> Callable:
    """``fasttomo.methods.sirt.projectors.forward_project`` (imported when first needed)."""
    try:
        from fasttomo.methods.sirt.projectors import forward_project
    except ImportError as exc:
        raise _error(
            "tiltseries=: forward-projecting the volume needs fasttomo.methods.sirt.projectors.forward_project, "
            f"which this fasttomo cannot import ({exc}); it comes with fasttomo's conventional projectors. Update "
            "fasttomo, or score against truth= only.") from None
    return forward_project


def score_against_tiltseries(vol: np.ndarray, stack: np.ndarray, angles_deg: np.ndarray, *,
                             valid: np.ndarray | None = None, fit: str = "global", held_out_views=(),
                             step: float = 0.5, device: str = "auto", projector: Callable | None = None
                             ) -> tuple[dict, object]:
    """Forward-project ``vol`` (Z, Y, X) into every view of ``stack`` (n, H, W) at ``angles_deg``
    ((n,) or (n, H) degrees) and compare view by view.

    Returns ``(metrics, ProjectionMetrics)``: metrics holds ``n_views``, ``angles_deg`` (per view;
    the mean of a view's lines for per-line angles), ``fit``, the per-view lists (``pearson``,
    ``rms``, ``rel_rms``, ``n_pixels``, ``scale``, ``offset``), ``summary`` (all views), and with
    ``held_out_views`` (1-based) ``held_out_views`` and ``held_out`` / ``used`` summaries. Worst
    views are given as ``*_worst_view`` (1-based, as IMOD) with their angle.
    """
    import torch

    from fasttomo.geometry.poses import Poses
    from fasttomo.geometry.rays import Box
    from fasttomo.quality.metrics import projection_metrics
    from fasttomo.quality.scoring import EvaluateError

    n, h, w = stack.shape
    held = check_stack(vol.shape, stack.shape, held_out_views)
    ang = np.asarray(angles_deg, dtype=np.float64)
    per_view = ang if ang.ndim == 1 else ang.mean(axis=1)
    projector = load_projector() if projector is None else projector
    dev = tool_device(device, EvaluateError)
    with torch.no_grad():
        poses = Poses(ang, int(np.argmin(np.abs(per_view)))).to(dev)
        pred = projector(torch.from_numpy(np.ascontiguousarray(vol, dtype=np.float32)).to(dev), poses,
                         Box(vol.shape), (h, w), step=step)
    pred = pred.detach().float().cpu().numpy()
    if pred.shape != stack.shape:
        raise _error(f"the projector returned shape {pred.shape} for a stack of {stack.shape}.")
    pm = projection_metrics(stack, pred, valid, fit=fit)
    out: dict = {"n_views": n, "angles_deg": per_view.tolist(), **pm.to_json()}

    def summary(views=None):
        s = pm.summary(views)
        for key in ("pearson", "rms"):
            i = s.pop(f"{key}_worst_index")
            s[f"{key}_worst_view"] = None if i is None else i + 1
            s[f"{key}_worst_angle_deg"] = None if i is None else float(per_view[i])
        return s

    out["summary"] = summary()
    if held:
        out["held_out_views"] = held
        out["held_out"] = summary([v - 1 for v in held])
        used = [i for i in range(n) if i + 1 not in held]
        if used:
            out["used"] = summary(used)
    return out, pm


def view_plots(out_dir: Path, angles: list, pm, held: list, overwrite: bool) -> list[str]:
    """views_pearson.png and views_residual.png: per-view values against the tilt angle."""
    from fasttomo.quality.plots import Series, line_plot

    ang = np.asarray(angles, dtype=np.float64)
    is_held = np.isin(np.arange(1, ang.size + 1), held)
    span = float(ang.max() - ang.min()) or 1.0
    xlim = (float(ang.min()) - 0.03 * span, float(ang.max()) + 0.03 * span)  # room for the end markers

    def series(values, name):
        v = np.asarray(values, dtype=np.float64)
        used = np.flatnonzero(~is_held)
        used = used[np.argsort(ang[used])]
        s = [Series(name if not held else f"{name}, views used", ang[used], v[used], markers=True)]
        if held:
            s.append(Series("held-out views", ang[is_held], v[is_held], color=(214, 39, 40), markers=True, width=0))
        return s

    p1 = line_plot(out_dir / "views_pearson.png", series(pm.pearson, "Pearson r"),
                   "Measured views vs the projected volume", "tilt angle (degrees)", "Pearson correlation",
                   xlim=xlim, legend="best", overwrite=overwrite)
    p2 = line_plot(out_dir / "views_residual.png", series(pm.rel_rms, "RMS residual / view std"),
                   f"Projection residual per view (fit: {pm.fit})", "tilt angle (degrees)",
                   "RMS residual / std of the view", xlim=xlim, legend="best", overwrite=overwrite)
    return [p1, p2]


# --------------------------------------------------------------------------------------- command
def _check_request(cfg: EvaluateConfig) -> None:
    """Refuse a request without a volume or anything to score it against, or with parts that need
    a tilt series given without one."""
    if not cfg.volume:
        raise ConfigError("volume: give the volume to score, e.g. fasttomo-evaluate volume=run/volume.mrc "
                          "truth=phantom_truth.mrc (and/or tiltseries=<stack> angles=<file>).")
    if not cfg.truth and not cfg.tiltseries:
        raise ConfigError("truth / tiltseries: nothing to score against; give truth=<volume file> and/or "
                          "tiltseries=<stack> angles=<angle file>.")
    if cfg.angles and not cfg.tiltseries:
        raise ConfigError("angles: given without tiltseries=<stack>; give the stack too, or drop angles=.")
    if cfg.held_out_views and not cfg.tiltseries:
        raise ConfigError("held_out_views: needs tiltseries=<stack>.")


def evaluate(cfg: EvaluateConfig, projector: Callable | None = None) -> dict:
    """Run one evaluation as ``cfg`` says; writes metrics.json and the plots, returns the metrics.

    ``projector`` replaces ``fasttomo.methods.sirt.projectors.forward_project`` (same signature).
    """
    from fasttomo import __version__
    from fasttomo.data.io.atomic import atomic_write
    from fasttomo.quality.scoring import score_against_truth

    _check_request(cfg)
    out_dir = Path(cfg.out) if cfg.out else default_out_dir(cfg.volume)
    check_out_dir(out_dir, cfg.overwrite)  # before any heavy work
    if cfg.tiltseries and projector is None:
        projector = load_projector()  # a missing projector is said before anything is computed

    vol, vx, vx_assumed = _read_volume(cfg.volume, "volume")
    truth = truth_vx = None
    truth_assumed = True
    if cfg.truth:
        truth, truth_vx, truth_assumed = _read_volume(cfg.truth, "truth")
        if truth.shape != vol.shape:
            raise _error(f"volume={cfg.volume} has shape (Z, Y, X) = {vol.shape} but truth={cfg.truth} has "
                         f"{truth.shape}; they must match voxel for voxel. Crop or resample one of them.")
    voxel, voxel_source = _pick_voxel_size(cfg, vx, vx_assumed, truth_vx, truth_assumed)
    mask = None
    if cfg.mask:
        if not cfg.truth:
            raise ConfigError("mask: the FSC mask needs truth=<volume file>.")
        mask, _, _ = _read_volume(cfg.mask, "mask")
        if mask.shape != vol.shape:
            raise _error(f"mask={cfg.mask} has shape {mask.shape} but volume={cfg.volume} has {vol.shape}.")

    metrics: dict = {"fasttomo_version": __version__, "volume": str(cfg.volume), "shape_zyx": list(vol.shape),
                     "voxel_size_A": voxel, "voxel_size_source": voxel_source}
    raw = None
    tilt_range, tilt_range_source = cfg.tilt_range, "tilt_range="
    if cfg.tiltseries:
        raw = read_tiltseries(cfg.tiltseries, cfg.angles)
        check_stack(vol.shape, raw.stack.shape, cfg.held_out_views)  # before anything is written
        if not raw.metadata.get("pixel_size_assumed") and not math.isclose(raw.pixel_size, voxel, rel_tol=1e-2):
            log.warning("tiltseries=%s has %.4g A pixels but the volume %.4g A voxels: was the stack binned "
                        "differently from the reconstruction? (the projection is compared pixel for voxel)",
                        cfg.tiltseries, raw.pixel_size, voxel)
        if tilt_range is None:
            tilt_range = [float(np.min(raw.angles)), float(np.max(raw.angles))]
            tilt_range_source = f"the angles of {cfg.tiltseries}"
    written: list[str] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    if truth is not None:
        res, curves = score_against_truth(vol, truth, voxel, tilt_range=tilt_range, data_range=cfg.data_range,
                                          mask=mask)
        res["path"] = str(cfg.truth)
        if tilt_range is not None:
            res["tilt_range_source"] = tilt_range_source
        metrics["truth"] = res
        written.append(fsc_plot(out_dir / "fsc.png", curves, f"FSC: {Path(cfg.volume).name} vs {Path(cfg.truth).name}",
                                tilt_range, overwrite=cfg.overwrite))
    if raw is not None:
        res, pm = score_against_tiltseries(vol, raw.stack, raw.angles, valid=raw.valid, fit=cfg.fit,
                                           held_out_views=cfg.held_out_views, step=cfg.step, device=cfg.device,
                                           projector=projector)
        res = {"path": str(cfg.tiltseries), "angle_source": raw.angle_source, "pixel_size_A": raw.pixel_size, **res}
        metrics["tiltseries"] = res
        written += view_plots(out_dir, res["angles_deg"], pm, res.get("held_out_views", []), cfg.overwrite)
    text = json.dumps(_jsonable(metrics), indent=2, allow_nan=False)
    written.insert(0, atomic_write(out_dir / "metrics.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"),
                                   overwrite=cfg.overwrite))
    if cfg.overwrite:  # results of the earlier evaluation that this one did not rewrite would mislead
        for name in RESULT_NAMES:
            p = out_dir / name
            if str(p) not in written and p.exists():
                p.unlink()
                log.info("removed %s of the earlier evaluation", p)
    for line in summary_lines(metrics) + [f"  wrote {', '.join(written)}"]:
        print(line)
    return metrics


def summary_lines(m: dict) -> list[str]:
    """A short human summary of an evaluation's metrics dict."""
    lines = [f"fasttomo-evaluate: {m['volume']}, (Z, Y, X) = {tuple(m['shape_zyx'])}, voxel {m['voxel_size_A']:.4g} A "
             f"(from {m['voxel_size_source']})"]
    t = m.get("truth")
    if t:
        psnr = "inf (identical)" if not math.isfinite(t["psnr_dB"]) else f"{t['psnr_dB']:.2f} dB"
        lines.append(f"  vs truth {t['path']}: Pearson {t['pearson_global']:.4f} global, {t['pearson_foreground']:.4f} "
                     f"foreground; PSNR {psnr} (data range {t['data_range']:.4g} = {t['data_range_source']}), "
                     f"MSE {t['mse']:.4g}")
        f = t["fsc"]
        lines.append(f"  FSC, all of Fourier space: 0.5: {_res_text(f, 'fsc05')}; 0.143: {_res_text(f, 'fsc0143')} "
                     "(against a ground truth, 0.5 is the usual criterion)")
        if "fsc_measured" in t:
            a, b = t["tilt_range_deg"]
            for region, name in (("measured", f"measured region ({a:g} to {b:g} deg)"), ("wedge", "missing wedge")):
                f = t[f"fsc_{region}"]
                lines.append(f"  FSC, {name}: 0.5: {_res_text(f, 'fsc05')}; 0.143: {_res_text(f, 'fsc0143')}")
    s = m.get("tiltseries")
    if s:
        def views(x: dict, what: str) -> str:
            if x["pearson_mean"] is None:
                return f"{what}: no valid pixels"
            return (f"{what}: Pearson mean {x['pearson_mean']:.4f}, worst {x['pearson_min']:.4f} (view "
                    f"{x['pearson_worst_view']}, {x['pearson_worst_angle_deg']:.1f} deg); RMS residual / view std "
                    f"mean {x['rel_rms_mean']:.4f}, worst {x['rel_rms_max']:.4f}")
        lines.append(f"  vs tilt series {s['path']} ({s['n_views']} views, intensity fit {s['fit']}): "
                     + views(s["summary"], "all views"))
        if "held_out" in s:
            lines.append("  " + views(s["held_out"], f"held-out views {s['held_out_views']}"))
    return lines


DESCRIPTION = """score a reconstructed volume against a ground truth (Pearson, PSNR, FSC with its
0.5 and 0.143 crossings, also in the measured region and the missing wedge) and/or against the tilt
series it was reconstructed from (each view forward-projected and compared: per-view correlation
and residual, no ground truth needed). Results go to <volume stem>_eval/ (metrics.json and plots)."""


def program():
    """What ``--help`` and the command-line checks know of this command (fasttomo.cli.help)."""
    from fasttomo.cli.help import Program
    from fasttomo.config import config_dir

    return Program("fasttomo-evaluate", DESCRIPTION, EvaluateConfig, config_dir(), "evaluate",
                   ("volume", "truth", "tiltseries", "angles", "tilt_range", "held_out_views", "out", "overwrite"),
                   examples=("fasttomo-evaluate volume=run/volume.mrc truth=phantom_truth.mrc tilt_range=[-60,60]",
                             "fasttomo-evaluate volume=run/volume.mrc tiltseries=tilts.ali angles=tilts.tlt"),
                   groups=())


def _start() -> None:
    """Compose configs/evaluate.yaml with the command line (Hydra) and run the evaluation."""
    from fasttomo.cli.errors import hydra_app
    from fasttomo.config import from_dict
    from fasttomo.data.tiltseries import TiltSeriesError

    def user_errors() -> tuple:
        from fasttomo.quality.scoring import EvaluateError  # torch: only once the config is composed

        return ConfigError, TiltSeriesError, EvaluateError, FileExistsError

    hydra_app("evaluate", EvaluateConfig, lambda data: evaluate(from_dict(EvaluateConfig, data)), user_errors,
              throw_on_missing=True)


def main() -> None:
    from fasttomo.cli.errors import run_checked

    run_checked(program(), sys.argv[1:], _start)


if __name__ == "__main__":
    main()
