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

import logging
import time

import numpy as np
import torch

from fasttomo.config import Config, ConfigError

log = logging.getLogger("fasttomo")


def background_of(cfg: Config, ts) -> tuple[np.ndarray, dict]:
    """Per-view background (n_views,) to subtract, and its description."""
    from fasttomo.data.background import estimate_background

    mode = cfg.intensity.background
    if mode == "none":
        return np.zeros(ts.n_tilts), {"background_mode": "none", "background": 0.0}
    est = estimate_background(ts.stack, ts.valid)
    ts.metadata["background_estimate"] = est.describe()
    if mode == "learn_per_view" and cfg.intensity.background_value is None:
        return est.per_view.copy(), {"background_mode": "per_view_estimate",
                                     "background_per_view": [float(v) for v in est.per_view]}
    value = est.value if cfg.intensity.background_value is None else float(cfg.intensity.background_value)
    return np.full(ts.n_tilts, value), {"background_mode": "subtracted", "background": value}


def _pearson_t(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    a, b = a.double(), b.double()
    if mask is not None:
        a, b = a[mask], b[mask]
    a = a - a.mean()
    b = b - b.mean()
    den = torch.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")


def run_sirt(cfg: Config, ts, box, device: torch.device, hold=None) -> tuple[dict, np.ndarray]:
    """SIRT on ``ts`` in ``box``; returns (metrics, volume (Z, Y, X) float32 in stack units)."""
    from fasttomo.methods.sirt.projectors import back_project, forward_project
    from fasttomo.methods.sirt.solver import sirt
    from fasttomo.data.io.alignment import view_poses
    from fasttomo.geometry.poses import Poses
    from fasttomo.kernels import dispatch
    from fasttomo.quality.metrics import foreground_mask

    if cfg.output.volume_shape is not None and tuple(cfg.output.volume_shape) != box.shape_zyx:
        raise ConfigError(f"output.volume_shape: model=sirt reconstructs on the box's voxels {list(box.shape_zyx)} "
                          "only; leave output.volume_shape unset (null).")
    if ts.per_line_angles:
        raise ConfigError("model.kind=sirt: per-line (continuous-rotation) angles are not supported by the SIRT "
                          "projectors; use a field model (model=kplanes_tilted).")
    dispatch.configure(cfg.kernels.backend)
    bg, bg_desc = background_of(cfg, ts)
    stack = torch.from_numpy((ts.stack - bg[:, None, None]).astype(np.float32)).to(device)
    valid = None if ts.valid is None else torch.from_numpy(ts.valid).to(device)
    poses = Poses(ts.angles, ts.reference_index(), initial=view_poses(ts.metadata)).to(device)
    truth = fg = None
    every = cfg.evaluation.curve_every
    if ts.ground_truth is not None and every and ts.ground_truth.shape == box.shape_zyx:
        truth = torch.from_numpy(ts.ground_truth).to(device)
        fg = torch.from_numpy(foreground_mask(ts.ground_truth)).to(device)
    curve: list[dict] = []
    clock = {"fit": 0.0, "mark": 0.0}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def callback(i: int, x: torch.Tensor) -> None:
        if truth is None or i % every:
            return
        sync()
        now = time.perf_counter()
        clock["fit"] += now - clock["mark"]
        curve.append({"step": i, "fit_seconds": clock["fit"], "pearson_global": _pearson_t(x, truth),
                      "pearson_foreground": _pearson_t(x, truth, fg)})
        clock["mark"] = time.perf_counter()

    log.info("sirt: %d iterations (relaxation %.3g, positivity %s) on a %s box, %d views, device %s",
             cfg.model.iterations, cfg.model.relaxation, cfg.model.positivity, box.shape_zyx, ts.n_tilts, device)
    # one untimed projection and backprojection of the real shapes first: the kernels' one-off
    # setup (compilation or the cache load, and the op registration) is not SIRT's fit time
    sync()
    t_setup = time.perf_counter()
    back_project(forward_project(torch.zeros(box.shape_zyx, device=device), poses, box, (ts.height, ts.width)),
                 poses, box)
    sync()
    setup = time.perf_counter() - t_setup
    clock["mark"] = time.perf_counter()
    x = sirt(stack, poses, box, cfg.model.iterations, relaxation=cfg.model.relaxation,
             positivity=cfg.model.positivity, valid=valid, callback=callback)
    sync()
    clock["fit"] += time.perf_counter() - clock["mark"]
    volume = x.float().cpu().numpy()
    metrics = {
        "model": "sirt",
        "steps": cfg.model.iterations,
        "train_seconds": clock["fit"],
        "seconds_per_iteration": clock["fit"] / cfg.model.iterations,
        "setup_seconds": setup,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "box_zyx": list(box.shape_zyx),
        "volume_shape_zyx": list(volume.shape),
        "pixel_size_A": ts.pixel_size,
        "intensity": bg_desc,
    }
    if "background_estimate" in ts.metadata:
        metrics["background_estimate"] = ts.metadata["background_estimate"]
    if curve:
        metrics["curve"] = curve
    log.info("sirt: %d iterations in %.3f s (%.2f ms each)", cfg.model.iterations, clock["fit"],
             1e3 * metrics["seconds_per_iteration"])
    if hold is not None:
        from fasttomo.quality.scoring import holdout_scores

        hposes = Poses(hold.angles, int(np.argmin(np.abs(hold.angles))),
                       initial=view_poses(ts.metadata, hold.view_numbers)).to(device)
        pred = forward_project(x.float(), hposes, box, (ts.height, ts.width)).cpu().numpy()
        metrics["holdout"] = holdout_scores(hold, pred + float(np.mean(bg)))
    return metrics, volume
