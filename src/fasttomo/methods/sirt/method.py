"""``model=sirt``: the conventional baseline run inside fasttomo-reconstruct.

The tilt series is prepared exactly as for the fields; the background (vacuum level) is handled by
the same ``intensity`` settings (SIRT has no learned offset: ``learn`` and ``fixed`` subtract the
robust vacuum estimate or ``intensity.background_value``, ``learn_per_view`` each view's own
estimate, ``none`` nothing), then :func:`fasttomo.methods.sirt.solver.sirt` runs ``model.iterations``
iterations on the run's device. The volume comes back in the stack's units per voxel, like a
field's. With a ground truth and ``evaluation.curve_every`` = N the volume is scored every N
iterations (Pearson, on the device), the scoring time not counted as fit time.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from fasttomo.config import Config, ConfigError

log = logging.getLogger("fasttomo")


def background_of(cfg: Config, ts) -> tuple[np.ndarray, dict]:
    """Per-view background (n_views,) to subtract, and its description."""
    from fasttomo.data.background import estimate_background, warn_if_mass_dark

    mode = cfg.intensity.background
    if mode == "none":
        return np.zeros(ts.n_tilts), {"background_mode": "none", "background": 0.0}
    est = estimate_background(ts.stack, ts.valid)
    ts.metadata["background_estimate"] = est.describe()
    warn_if_mass_dark(est, log, str(ts.source))
    if mode == "learn_per_view" and cfg.intensity.background_value is None:
        return est.per_view.copy(), {"background_mode": "per_view_estimate",
                                     "background_per_view": [float(v) for v in est.per_view]}
    value = est.value if cfg.intensity.background_value is None else float(cfg.intensity.background_value)
    return np.full(ts.n_tilts, value), {"background_mode": "subtracted", "background": value}


PEARSON_CHUNK = 1 << 26
"""Voxels per chunk of :func:`_pearson_t` (float64 temporaries of 0.5 GB, whatever the box)."""


def _pearson_t(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Pearson of two volumes (over ``mask``), two passes in float64 over chunks of
    :data:`PEARSON_CHUNK` voxels: whole-volume float64 copies of a 2048^2 x 512 box took 98 GB."""
    a, b = a.reshape(-1), b.reshape(-1)
    m = None if mask is None else mask.reshape(-1)

    def chunks():
        for i in range(0, a.numel(), PEARSON_CHUNK):
            x, y = a[i:i + PEARSON_CHUNK].double(), b[i:i + PEARSON_CHUNK].double()
            if m is not None:
                keep = m[i:i + PEARSON_CHUNK]
                x, y = x[keep], y[keep]
            yield x, y

    n = sa = sb = 0.0
    for x, y in chunks():
        n, sa, sb = n + x.numel(), sa + x.sum(), sb + y.sum()
    if n == 0:
        return float("nan")
    ma, mb = sa / n, sb / n
    saa = sbb = sab = 0.0
    for x, y in chunks():
        x, y = x - ma, y - mb
        saa, sbb, sab = saa + (x * x).sum(), sbb + (y * y).sum(), sab + (x * y).sum()
    den = torch.sqrt(torch.as_tensor(saa * sbb, dtype=torch.float64))
    return float(sab / den) if den > 0 else float("nan")


class SirtMethod:
    """``model=sirt`` behind the run's method interface (fasttomo.methods.base.Method): SIRT on
    ``ts`` in ``box`` on rank 0 (``main``; the other ranks wait), no checkpoint. The settings it
    cannot honour are refused when it is made, before the run folder is touched."""

    label = "SIRT"

    def __init__(self, cfg: Config, ts, box, device: torch.device, hold=None, main: bool = True):
        if cfg.output.volume_shape is not None and tuple(cfg.output.volume_shape) != box.shape_zyx:
            raise ConfigError(f"output.volume_shape: model=sirt reconstructs on the box's voxels "
                              f"{list(box.shape_zyx)} only; leave output.volume_shape unset (null).")
        if ts.per_line_angles:
            raise ConfigError("model.kind=sirt: per-line (continuous-rotation) angles are not supported by the SIRT "
                              "projectors; use a field model (model=kplanes_tilted).")
        self.cfg, self.ts, self.box, self.device, self.hold, self.main = cfg, ts, box, device, hold, main
        self.step = 0
        self._metrics: dict = {}
        self._x: torch.Tensor | None = None
        self._bg: np.ndarray | None = None

    def load(self, state: dict, source: str) -> None:
        """SIRT keeps no training state: a resume starts it afresh."""

    def check_space(self, out_dir) -> None:
        """SIRT writes the volumes and pictures only (no checkpoints): no estimate is made."""

    def fit(self) -> None:
        if self.main:
            self._solve()
        self.step = self.cfg.model.iterations

    def export(self) -> tuple[np.ndarray | None, int]:
        return (None if self._x is None else self._x.float().cpu().numpy()), self.step

    @contextlib.contextmanager
    def volume_slabs(self, planes_of):
        """(shape, Z planes a slab, slabs) of the volume, slab by slab from the device;
        ``planes_of(shape, device)`` sizes the slabs. The time inside is ``export_seconds``."""
        x = self._x
        planes = planes_of(tuple(x.shape), x.device)
        t0 = time.perf_counter()
        try:
            yield tuple(x.shape), planes, ((z, x[z:z + planes].float()) for z in range(0, x.shape[0], planes))
        finally:
            self._metrics["export_seconds"] = round(time.perf_counter() - t0, 3)

    def release(self) -> None:
        """After the export and the scores: the volume's device memory back, for the half sets'
        fits (at 4096^2 x 256 it is 17 GB, which the even half's SIRT needs)."""
        self._x = None

    def state(self) -> dict | None:
        return None

    def summary(self, volume: np.ndarray) -> dict:
        return dict(self._metrics)

    def scores(self, metrics: dict, exported_step: int) -> None:
        """The held-out views' reprojection scores (evaluation.holdout_views)."""
        from fasttomo.data.io.alignment import view_poses
        from fasttomo.geometry.poses import Poses
        from fasttomo.methods.sirt.projectors import forward_project
        from fasttomo.quality.scoring import holdout_scores

        hold, ts = self.hold, self.ts
        if hold is None or self._x is None:
            return
        hposes = Poses(hold.angles, int(np.argmin(np.abs(hold.angles))),
                       initial=view_poses(ts.metadata, hold.view_numbers)).to(self.device)
        pred = forward_project(self._x.float(), hposes, self.box, (ts.height, ts.width)).cpu().numpy()
        metrics["holdout"] = holdout_scores(hold, pred + float(np.mean(self._bg)))

    def _solve(self) -> None:
        """SIRT's iterations, timed apart from the kernels' one-off setup and from the scoring of
        the quality curve; fills the volume and the fit's metrics."""
        from fasttomo.methods.sirt.solver import sirt

        cfg, ts, box, device = self.cfg, self.ts, self.box, self.device
        prep = _prepare(cfg, ts, box, device)
        self._bg = prep.bg
        curve = _Curve(prep.truth, prep.fg, cfg.evaluation.curve_every, device)
        log.info("sirt: %d iterations (relaxation %.3g, positivity %s) on a %s box, %d views, device %s",
                 cfg.model.iterations, cfg.model.relaxation, cfg.model.positivity, box.shape_zyx, ts.n_tilts, device)
        setup = _warm_up(prep.poses, box, (ts.height, ts.width), device)
        curve.mark = time.perf_counter()
        x = sirt(prep.stack, prep.poses, box, cfg.model.iterations, relaxation=cfg.model.relaxation,
                 positivity=cfg.model.positivity, valid=prep.valid, callback=curve)
        _sync(device)
        curve.fit += time.perf_counter() - curve.mark
        self._x = x
        self._metrics = {
            "model": "sirt",
            "steps": cfg.model.iterations,
            "train_seconds": curve.fit,
            "seconds_per_iteration": curve.fit / cfg.model.iterations,
            "setup_seconds": setup,
            "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
            "box_zyx": list(box.shape_zyx),
            "volume_shape_zyx": list(x.shape),
            "pixel_size_A": ts.pixel_size,
            "intensity": prep.bg_desc,
        }
        if "background_estimate" in ts.metadata:
            self._metrics["background_estimate"] = ts.metadata["background_estimate"]
        if curve.rows:
            self._metrics["curve"] = curve.rows
        log.info("sirt: %d iterations in %.3f s (%.2f ms each)", cfg.model.iterations, curve.fit,
                 1e3 * self._metrics["seconds_per_iteration"])


class _Prepared:
    """The device tensors SIRT works on: the background-subtracted stack, its valid mask, the
    poses, the truth and its foreground mask (for the quality curve), the background."""

    def __init__(self, **parts):
        self.__dict__.update(parts)


def _prepare(cfg: Config, ts, box, device: torch.device) -> _Prepared:
    from fasttomo.data.io.alignment import view_poses
    from fasttomo.geometry.poses import Poses
    from fasttomo.kernels import dispatch
    from fasttomo.quality.metrics import FOREGROUND_REL

    dispatch.configure(cfg.kernels.backend, gpu_decoder=cfg.kernels.gpu_decoder, step_fusion=cfg.kernels.step_fusion)
    bg, bg_desc = background_of(cfg, ts)
    stack = torch.empty(ts.stack.shape, dtype=torch.float32, device=device)
    for i in range(ts.n_tilts):  # a view at a time, on the device: no float64 copy of the stack on the host
        stack[i] = (torch.from_numpy(np.ascontiguousarray(ts.stack[i])).to(device, torch.float64) - float(bg[i])).float()
    valid = None if ts.valid is None else torch.from_numpy(ts.valid).to(device)
    poses = Poses(ts.angles, ts.reference_index(), initial=view_poses(ts.metadata)).to(device)
    truth = fg = None
    if ts.ground_truth is not None and cfg.evaluation.curve_every and ts.ground_truth.shape == box.shape_zyx:
        truth = torch.empty(box.shape_zyx, dtype=torch.float32, device=device)
        for z in range(truth.shape[0]):  # a plane at a time: the truth may be a read-only map of its file
            truth[z] = torch.from_numpy(np.array(ts.ground_truth[z], dtype=np.float32))
        fg = truth > FOREGROUND_REL * float(truth.max())  # quality.metrics.foreground_mask, on the device
    return _Prepared(bg=bg, bg_desc=bg_desc, stack=stack, valid=valid, poses=poses, truth=truth, fg=fg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(poses, box, shape, device: torch.device) -> float:
    """One untimed projection and backprojection of the real shapes: the kernels' one-off setup
    (compilation or the cache load, and the op registration) is not SIRT's fit time. Returns its
    seconds."""
    from fasttomo.methods.sirt.projectors import back_project, forward_project

    _sync(device)
    t_setup = time.perf_counter()
    back_project(forward_project(torch.zeros(box.shape_zyx, device=device), poses, box, shape), poses, box)
    _sync(device)
    return time.perf_counter() - t_setup


class _Curve:
    """SIRT's callback: every ``every`` iterations the volume's Pearson against the truth (on the
    device), with the fit seconds so far (the scoring time left out)."""

    def __init__(self, truth, fg, every: int, device: torch.device):
        self.truth, self.fg, self.every, self.device = truth, fg, every, device
        self.rows: list[dict] = []
        self.fit = 0.0
        self.mark = 0.0

    def __call__(self, i: int, x: torch.Tensor) -> None:
        if self.truth is None or i % self.every:
            return
        _sync(self.device)
        now = time.perf_counter()
        self.fit += now - self.mark
        self.rows.append({"step": i, "fit_seconds": self.fit, "pearson_global": _pearson_t(x, self.truth),
                          "pearson_foreground": _pearson_t(x, self.truth, self.fg)})
        self.mark = time.perf_counter()
