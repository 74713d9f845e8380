"""Preparation of a tilt series read from a file, each step a ``data.*`` option.

The order is fixed (:func:`prepare` runs it and records every step in ``metadata['preparation']``):

 1. ``nonfinite``      NaN/Inf pixels: ``reject`` (error naming view/row/col) or ``mask`` (pixels
                       marked invalid in ``TiltSeries.valid``, value filled).
 1b. ``hot_pixels``    ``mask`` (default): a pixel brighter than its second-brightest of 8 neighbours
                       by more than its view's whole 0.1-99.9 % intensity range (alone or in a
                       pair), or a cluster of up to 6 pixels whose brightest exceeds the
                       6th-brightest of its 24 neighbours by that much, is marked invalid, value
                       filled, when it is in one view only (the views of the next tilt angles do
                       not show it where structure would have moved: an X-ray hit) or hot in a
                       quarter of the views (a camera defect); small bright particles are in every
                       view and stay. The log says how many in how many views. ``keep`` leaves
                       them.
 2. ``exclude_views``  1-based section numbers of the file (IMOD's -EXCLUDELIST), dropped first so
                       every later number refers to the file; angles are checked after this step
                       (duplicates can be excluded).
 3. ``tilt_axis_angle`` each image is rotated by -angle about its centre (bilinear interpolation;
                       a rotation, never a transpose) so the tilt axis, at ``angle`` degrees
                       counter-clockwise from +Y in the raw image (x = column, y = row, as 3dmod
                       shows it), lies along Y. Output size: the input's, with H and W swapped when
                       the axis is closer to X than to Y. Corners without data are marked invalid.
 4. ``binning``        b x b block means (trailing rows/columns that do not fill a block are
                       dropped); the pixel size grows by b; per-line angles are averaged per block.
 5. ``crop``           [y0, y1, x0, x1] window in the binned image (per-line angles follow rows).
 6. dark/blank views   a view whose standard deviation is < 1e-6 of the median view's (blank:
                       constant, it carries no signal) or, for non-negative data, whose mean is
                       < 10 % of the median view mean (dark; means of values clipped at each view's
                       99th percentile, so hot pixels do not count) is reported; ``drop_dark_views`` removes
                       it. A blank view that is kept is refused (one line naming it and the fixes).
 7. sorting            non-monotonic angle lists (dose-symmetric) are sorted by angle (per-line
                       angles: by their mean); ``metadata['sort_permutation']`` holds the order
                       (sorted = before[perm]) and ``metadata['view_numbers']`` the 1-based file
                       sections of the final views.
 8. ``invert``         x -> max - x (bright-field data where mass is dark).
 9. ``normalize``      ``quantile``: (x - q0.01) / (q0.999 - q0.01) over the whole series (not per
                       view, which would break the intensity relation between tilts), or ``none``.

A stack that is constant over all its valid pixels (all zeros, say) carries no signal and is
refused before any step, as is one whose largest |value| is outside :data:`STAT_RANGE` (float32
statistics would call every view blank).

Statistics use valid pixels only (a strided subsample of at most 2 million values for quantiles).
Invalid pixels end up holding their view's median valid value.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fasttomo.data.tiltseries import TiltSeries, TiltSeriesError
from fasttomo.data.views import map_views

log = logging.getLogger("fasttomo.data")

QUANTILES = (0.01, 0.999)
_MAX_STAT_VALUES = 2_000_000
STAT_RANGE = (1e-15, 1e15)
"""Bounds on a stack's largest |value| for float32 statistics: a view's variance is a mean of float32
squared deviations, which overflow beyond 1.8e19 (the square root of float32's largest number
3.4e38) and lose their precision below 1e-19 (that of its smallest normal number 1.2e-38); the
bounds keep a margin."""


@dataclass
class RawSeries:
    """A tilt series as read from its files, before preparation."""

    stack: np.ndarray
    """(n, H, W) float32 (may hold NaN/Inf)."""
    angles: np.ndarray
    """(n,) or (n, H) degrees, in file order."""
    pixel_size: float
    source: str
    angle_source: str
    """Where the angles came from (named in errors)."""
    valid: np.ndarray | None = None
    ground_truth: np.ndarray | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _sample(values: np.ndarray, cap: int = _MAX_STAT_VALUES) -> np.ndarray:
    step = max(1, values.size // cap)
    return values[::step]


def check_angles(angles: np.ndarray, where: str, view_numbers: np.ndarray) -> None:
    """|angle| < 90 and finite, and no duplicates; errors name the file, the views and the fix."""
    flat = angles if angles.ndim == 1 else angles.reshape(angles.shape[0], -1)
    bad = ~np.isfinite(flat) if flat.ndim == 1 else ~np.isfinite(flat).all(axis=1)
    if bad.any():
        raise TiltSeriesError(f"{where}: NaN/Inf tilt angle for view(s) {view_numbers[bad].tolist()}; fix the angle file.")
    worst = np.abs(flat) if flat.ndim == 1 else np.abs(flat).max(axis=1)
    if (worst >= 90).any():
        i = int(np.argmax(worst))
        raise TiltSeriesError(
            f"{where}: tilt angle {float(np.ravel(flat[i])[np.argmax(np.abs(np.ravel(flat[i])))]):.4g} degrees for view "
            f"{int(view_numbers[i])} is not within (-90, 90); angles must be in degrees. Were radians given, or is "
            "this not a tilt-angle list? Fix the angle file or exclude the view (data.exclude_views)."
        )
    if angles.ndim == 1:
        uniq, inverse, counts = np.unique(angles, return_inverse=True, return_counts=True)
        if (counts > 1).any():
            dups = {float(uniq[k]): view_numbers[inverse == k].tolist() for k in np.flatnonzero(counts > 1)}
            raise TiltSeriesError(
                f"{where}: duplicate tilt angles (angle: 1-based views) {dups}; each view needs its own angle. Fix "
                "the angle file or drop the repeats, e.g. data.exclude_views=[" +
                ",".join(str(v[-1]) for v in dups.values()) + "]."
            )


RADIAN_SUSPECT_DEG = 2.0
FEW_VIEWS = 5
"""A series of fewer views is reconstructed with a warning."""
NARROW_TILT_RANGE_DEG = 30.0
"""A series whose views span less than this many degrees is reconstructed with a warning."""


def check_angle_units(angles: np.ndarray, where: str, enabled: bool = True) -> None:
    """Refuse angles whose largest magnitude is below 2 degrees: radians (any tilt series in
    radians has |angle| < pi/2 < 2) read as degrees would give a silently wrong reconstruction.
    A single view, or views all at one angle, are refused as such (whatever the angle)."""
    worst = float(np.max(np.abs(angles))) if angles.size else 0.0
    lo, hi = (float(np.min(angles)), float(np.max(angles))) if angles.size else (0.0, 0.0)
    if angles.size and hi == lo:  # not a units question: one angle is no tilt series
        n = angles.shape[0]
        what = "the stack has one view" if n == 1 else f"all {n} views are"
        raise TiltSeriesError(
            f"{where}: {what} at {lo:.4g} degrees; a tomogram needs views at several tilt angles. Give the whole "
            "tilt series (data.path) and its angle file (data.angles).")
    if worst >= RADIAN_SUSPECT_DEG:
        if angles.shape[0] < FEW_VIEWS:
            log.warning("%s: only %d views; a tomogram from so few is mostly streaks (a tilt series usually has 40 "
                        "or more). Check data.exclude_views and that the whole series was given.", where,
                        angles.shape[0])
        if hi - lo < NARROW_TILT_RANGE_DEG:
            log.warning("%s: the views span only %.4g degrees (%.4g..%.4g); a tomogram's depth resolution comes from "
                        "its tilt range, so this volume will be smeared along Z (a series usually spans 100 "
                        "degrees or more).", where, hi - lo, lo, hi)
        return
    if not enabled:
        log.warning("%s: the tilt angles span only %.4g..%.4g degrees (data.check_angle_units=false).", where, lo, hi)
        return
    raise TiltSeriesError(
        f"{where}: the tilt angles span only {lo:.4g}..{hi:.4g} degrees (largest |angle| {worst:.4g} < "
        f"{RADIAN_SUSPECT_DEG:g}); these look like radians, but fasttomo reads degrees. Convert them to degrees "
        "(x 57.2958) where they are stored, or give data.angles=<a file in degrees>, or set "
        "data.check_angle_units=false if the series really spans less than "
        f"+-{RADIAN_SUSPECT_DEG:g} degrees."
    )


def handle_nonfinite(stack: np.ndarray, valid: np.ndarray | None, mode: str, where: str) -> np.ndarray | None:
    if all(map_views(lambda i: bool(np.isfinite(stack[i]).all()), len(stack), stack.size)):
        return valid  # a view at a time (on threads): no stack-sized mask when all is well
    bad = ~np.isfinite(stack)
    first = np.argwhere(bad)[0]
    if mode == "reject":
        raise TiltSeriesError(
            f"{where}: {int(bad.sum())} NaN/Inf pixels (first at view {int(first[0]) + 1} (1-based), row {int(first[1])}, "
            f"col {int(first[2])}); repair the data, exclude the view (data.exclude_views), or set "
            "data.nonfinite=mask to ignore those pixels in the loss."
        )
    log.warning("%s: %d NaN/Inf pixels in %d views are masked (data.nonfinite=mask).", where, int(bad.sum()),
                int(bad.any(axis=(1, 2)).sum()))
    stack[bad] = 0.0
    return ~bad if valid is None else valid & ~bad


_HOT_SAMPLE = 262_144  # values a view for its quantiles (262 beyond each; at 2048^2 a view takes 20 ms, 50 with 2e6)
HOT_QUANTILES = (0.001, 0.999)
"""The per-view intensity range by which a hot pixel exceeds its second-brightest neighbour (data.hot_pixels)."""


CLUSTER_NEIGHBOUR = 6
"""A cluster candidate exceeds the 6th-brightest of its 24 neighbours (5 x 5): up to 6 pixels."""
DEFECT_VIEWS = 0.25
"""A pixel hot in at least this fraction of the views (and 3) is a detector defect: masked in every
view where it is hot, whatever the views beside show."""


def _hot_pixels(img: np.ndarray, ok: np.ndarray | None) -> dict | None:
    """The hot pixels of one view (see ``hot_pixel_mask``): ``hot`` (rows, cols, excess) of the
    single pixels and pairs, each above its second-brightest of 8 neighbours by ``excess``;
    ``cluster`` (rows, cols, background, excess) of the brightest pixels of clusters of up to 6,
    each above the 6th-brightest of its 24 neighbours (``background``) by ``excess``; None when
    there are none."""
    vals = img.reshape(-1) if ok is None else img[ok]
    if vals.size < 9 or min(img.shape) < 3:
        return None
    lo, hi = (float(q) for q in np.quantile(_sample(vals, _HOT_SAMPLE), HOT_QUANTILES))
    span = hi - lo
    if not span > 0:
        return None
    cand = img > hi if ok is None else (img > hi) & ok  # necessary: a neighbour is rarely below lo
    rows, cols = np.nonzero(cand)
    if rows.size == 0:
        return None
    h, w = img.shape

    def mirror(i, n):  # at the border the neighbour across (never the pixel itself)
        i = np.abs(i)
        return np.minimum(i, 2 * (n - 1) - i)

    reach = (-2, -1, 0, 1, 2) if min(h, w) >= 5 else (-1, 0, 1)  # clusters need 5 x 5 (mirrored, never itself)
    offsets = [(dr, dc) for dr in reach for dc in reach if dr or dc]
    nbrs = np.stack([img[mirror(rows + dr, h), mirror(cols + dc, w)] for dr, dc in offsets])
    inner = np.array([max(abs(dr), abs(dc)) == 1 for dr, dc in offsets])
    value = img[rows, cols]
    excess = value - np.sort(nbrs[inner], axis=0)[-2]
    hot = excess > span  # above its 2nd-brightest neighbour: a pair counts
    background = np.sort(nbrs, axis=0)[-CLUSTER_NEIGHBOUR] if len(offsets) == 24 else value
    cluster = ~hot & (value - background > span)
    if not (hot.any() or cluster.any()):
        return None
    return {"hot": (rows[hot], cols[hot], excess[hot]),
            "cluster": (rows[cluster], cols[cluster], background[cluster], (value - background)[cluster])}


def _seen_beside(stack: np.ndarray, i: int, beside: list[int], angles: np.ndarray, axis_deg: float,
                 row: int, col: int, excess: float) -> bool:
    """Whether a bright spot at (row, col) of view ``i`` is in a view of the next tilt angles too:
    a window there, long across the tilt axis (as far as a point within 0.71 x the image's larger
    side of the axis (a box as thick as it is wide) moves between the two angles, plus 2 pixels)
    and 3 pixels wide, holds a pixel at least half the spot's excess above the window's median.
    Imaged structure passes; an X-ray hit is in one view."""
    h, w = stack.shape[1:]
    cos_a, sin_a = math.cos(math.radians(axis_deg)), math.sin(math.radians(axis_deg))
    for j in beside:
        move = max(h, w) / math.sqrt(2) * abs(math.radians(angles[j] - angles[i]))
        t = np.arange(-(math.ceil(move) + 2), math.ceil(move) + 3)[:, None]
        across = np.array([-1, 0, 1])[None, :]
        r = np.rint(row + t * sin_a + across * cos_a).astype(np.int64)  # across the axis: (col, row) = (cos, sin)
        c = np.rint(col + t * cos_a - across * sin_a).astype(np.int64)
        inside = (r >= 0) & (r < h) & (c >= 0) & (c < w)
        win = stack[j][r[inside], c[inside]]
        if win.size and win.max() - np.median(win) >= 0.5 * excess:
            return True
    return False


def _one_view_only(stack: np.ndarray, found: list, angles: np.ndarray | None, axis_deg: float):
    """Per view, which of its hot pixels and cluster peaks to mask: (mask_hot, mask_cluster) boolean
    arrays, or None for a view without any. Without usable angles (one per view, finite, two views
    or more) every hot pixel is masked and no cluster."""
    n = len(stack)
    per_view = None
    if angles is not None and len(angles) == n and n > 1:
        per_view = np.asarray(angles, dtype=np.float64).reshape(n, -1).mean(axis=1)
        per_view = per_view if np.isfinite(per_view).all() else None
    if per_view is None:
        return [None if f is None else (np.ones(f["hot"][0].size, bool), np.zeros(f["cluster"][0].size, bool))
                for f in found]
    order = np.argsort(per_view, kind="stable")
    rank = np.argsort(order)
    times: dict[tuple[int, int], int] = {}
    for f in found:
        if f is not None:
            for key in zip(f["hot"][0].tolist(), f["hot"][1].tolist()):
                times[key] = times.get(key, 0) + 1
    defect = max(3, DEFECT_VIEWS * n)
    out = []
    for i, f in enumerate(found):
        if f is None:
            out.append(None)
            continue
        beside = [int(order[q]) for q in (rank[i] - 1, rank[i] + 1) if 0 <= q < n]
        def seen(r, c, e, i=i, beside=beside) -> bool:
            return _seen_beside(stack, i, beside, per_view, axis_deg, int(r), int(c), float(e))

        hot = np.array([times[(int(r), int(c))] >= defect or not seen(r, c, e) for r, c, e in zip(*f["hot"])], bool)
        cl = np.array([not seen(r, c, e) for r, c, _, e in zip(*f["cluster"])], bool)
        out.append((hot, cl))
    return out


def hot_pixel_mask(stack: np.ndarray, valid: np.ndarray | None, mode: str, where: str,
                   angles: np.ndarray | None = None, axis_deg: float = 0.0) -> np.ndarray | None:
    """data.hot_pixels=mask: bright pixels that no imaged structure explains become invalid
    (ignored in the loss; the value is filled later with the view's median): a pixel brighter than
    the second-brightest of its 8 neighbours by more than its view's 0.1-99.9 % range (alone or in
    a pair), and a cluster of up to 6 pixels whose brightest exceeds the 6th-brightest of its 24
    neighbours by that much, each unless it is in a view of the next tilt angle too (structure
    moves between views, an X-ray hit is in one; a pixel hot in a quarter of the views is a detector
    defect and masked all the same). ``angles`` (one per view, or per image line) order the views
    and ``axis_deg`` (data.tilt_axis_angle) gives the direction structure moves in; without them
    every hot pixel is masked and no cluster. Returns the validity mask, None while every pixel is
    valid."""
    if mode == "keep":
        return valid
    found = map_views(lambda i: _hot_pixels(stack[i], None if valid is None else valid[i]), len(stack), stack.size)
    chosen = _one_view_only(stack, found, angles, axis_deg)
    new = valid
    views, n_hot, n_clusters, n_cluster_px = [], 0, 0, 0
    for i, (f, pick) in enumerate(zip(found, chosen)):
        if pick is None or not (pick[0].any() or pick[1].any()):
            continue
        if new is valid:
            new = np.ones(stack.shape, dtype=bool) if valid is None else valid.copy()
        hot, cl = pick
        new[i, f["hot"][0][hot], f["hot"][1][hot]] = False
        n_hot += int(hot.sum())
        rows, cols, bgs, excs = (a[cl] for a in f["cluster"])
        for k in np.argsort(-excs, kind="stable"):  # brightest first: a cluster's other pixels are then masked
            row, col, bg, exc = int(rows[k]), int(cols[k]), bgs[k], excs[k]
            if not new[i, row, col]:
                continue
            r0, c0 = max(row - 2, 0), max(col - 2, 0)
            win = new[i, r0:row + 3, c0:col + 3]
            part = (stack[i, r0:row + 3, c0:col + 3] > bg + 0.1 * exc) & win  # its pixels above the background
            n_cluster_px += int(part.sum())
            n_clusters += 1
            win[part] = False
        views.append(i)
    if not views:
        return valid
    shown = ", ".join(str(i + 1) for i in views[:8]) + (" ..." if len(views) > 8 else "")
    clusters = (f" and {n_cluster_px} pixels in {n_clusters} bright clusters (up to 6 pixels)" if n_clusters else "")
    log.warning("%s: %d hot pixels (each brighter than its neighbours by more than its view's 0.1-99.9 %% range)%s "
                "in %d views (%s, in file order), each in one view only or a detector defect, are masked; "
                "data.hot_pixels=keep keeps them.", where, n_hot, clusters, len(views), shown)
    return new


def _bilinear(img: np.ndarray, ok: np.ndarray | None, row: np.ndarray, col: np.ndarray):
    h, w = img.shape
    eps = 1e-6
    inside = (row >= -eps) & (row <= h - 1 + eps) & (col >= -eps) & (col <= w - 1 + eps)
    row = np.clip(row, 0, h - 1)
    col = np.clip(col, 0, w - 1)
    r0 = np.minimum(np.floor(row).astype(np.int64), h - 2)
    c0 = np.minimum(np.floor(col).astype(np.int64), w - 2)
    fr, fc = row - r0, col - c0
    out = np.zeros(row.shape, dtype=np.float64)
    valid = inside
    for dr, dc, wt in ((0, 0, (1 - fr) * (1 - fc)), (0, 1, (1 - fr) * fc), (1, 0, fr * (1 - fc)), (1, 1, fr * fc)):
        out += wt * img[r0 + dr, c0 + dc]
        if ok is not None:
            valid = valid & ((wt <= 1e-9) | ok[r0 + dr, c0 + dc])
    return out.astype(np.float32), valid


def rotate_tilt_axis(stack: np.ndarray, valid: np.ndarray | None, angle_deg: float):
    """Rotate every image by -angle_deg about its centre so a tilt axis at +angle_deg (counter-clockwise
    from +Y, x = column, y = row) lies along +Y. Returns (stack, valid or None)."""
    n, h, w = stack.shape
    phi = math.radians(angle_deg)
    c, s = math.cos(phi), math.sin(phi)
    ho, wo = (w, h) if abs(s) > abs(c) else (h, w)
    y, x = np.meshgrid(np.arange(ho) - (ho - 1) / 2, np.arange(wo) - (wo - 1) / 2, indexing="ij")
    col = x * c - y * s + (w - 1) / 2
    row = x * s + y * c + (h - 1) / 2
    snap = lambda a: np.where(np.abs(a - np.round(a)) < 1e-6, np.round(a), a)  # noqa: E731 - exact at k*90 deg
    row, col = snap(row), snap(col)
    out = np.empty((n, ho, wo), dtype=np.float32)
    out_valid = np.empty((n, ho, wo), dtype=bool)
    for i in range(n):
        out[i], out_valid[i] = _bilinear(stack[i], None if valid is None else valid[i], row, col)
    return out, (None if out_valid.all() else out_valid)


def bin_stack(stack: np.ndarray, valid: np.ndarray | None, angles: np.ndarray, b: int):
    """b x b block means; a block is valid only if all its pixels are. Returns (stack, valid, angles)."""
    n, h, w = stack.shape
    hb, wb = h // b, w // b
    if hb < 2 or wb < 2:
        raise TiltSeriesError(f"data.binning={b} leaves {hb} x {wb} pixels of a {h} x {w} image; use a smaller binning.")
    blocks = stack[:, : hb * b, : wb * b].reshape(n, hb, b, wb, b)
    if valid is None:
        out, out_valid = blocks.mean(axis=(2, 4), dtype=np.float64).astype(np.float32), None
    else:
        vb = valid[:, : hb * b, : wb * b].reshape(n, hb, b, wb, b)
        count = vb.sum(axis=(2, 4))
        total = np.where(vb, blocks, 0).sum(axis=(2, 4), dtype=np.float64)
        out = (total / np.maximum(count, 1)).astype(np.float32)
        out_valid = count == b * b
    if angles.ndim == 2:
        angles = angles[:, : hb * b].reshape(n, hb, b).mean(axis=2)
    return out, out_valid, angles


def crop_stack(stack, valid, angles, crop: list, where: str):
    n, h, w = stack.shape
    y0, y1, x0, x1 = (int(v) for v in crop)
    if not (0 <= y0 < y1 <= h and 0 <= x0 < x1 <= w) or y1 - y0 < 2 or x1 - x0 < 2:
        raise TiltSeriesError(
            f"{where}: data.crop={list(crop)} is not a window of at least 2 x 2 pixels inside the {h} x {w} image "
            "(after binning); use [y0, y1, x0, x1] with 0 <= y0 < y1 <= H and 0 <= x0 < x1 <= W."
        )
    stack = np.ascontiguousarray(stack[:, y0:y1, x0:x1])
    valid = None if valid is None else np.ascontiguousarray(valid[:, y0:y1, x0:x1])
    if angles.ndim == 2:
        angles = angles[:, y0:y1]
    return stack, valid, angles


DARK_CLIP_QUANTILE = 0.99
"""The dark-view check's view means clip each view's values at this quantile (of a sample of it),
so that a few hot pixels or X-ray spikes (1e6 counts in a view of 1e3) cannot lift the median
view mean and make normal views look dark."""
_DARK_SAMPLE = 65536
"""Values of a view (evenly strided) that its clipped mean is taken over."""


def _view_stats(stack: np.ndarray, valid: np.ndarray | None):
    """Each view's mean (over a sample of its valid values clipped at their
    :data:`DARK_CLIP_QUANTILE`) and standard deviation (over all its valid pixels, float64 sums),
    the views on threads (``data.views.map_views``), each thread through one reused view-sized
    buffer: a 4096^2 view's temporaries otherwise cost page faults every view."""
    local = threading.local()

    def stats(i: int) -> tuple[float, float]:
        v = stack[i] if valid is None else stack[i][valid[i]]
        if not v.size:
            return 0.0, 0.0
        buf = getattr(local, "buf", None)
        if buf is None or buf.size < v.size:
            buf = local.buf = np.empty(v.size, dtype=np.float32)
        dev = buf[: v.size].reshape(v.shape)
        few = v.reshape(-1)[:: max(1, v.size // _DARK_SAMPLE)]
        clipped = float(np.minimum(few, np.quantile(few, DARK_CLIP_QUANTILE)).mean(dtype=np.float64))
        mean = float(v.mean(dtype=np.float64))
        np.subtract(v, np.float32(mean), out=dev)
        np.square(dev, out=dev)
        return clipped, math.sqrt(float(dev.mean(dtype=np.float64)))

    out = np.array(map_views(stats, len(stack), stack.size), dtype=np.float64).reshape(len(stack), 2)
    return out[:, 0].copy(), out[:, 1].copy()


def find_dark_views(stack: np.ndarray, valid: np.ndarray | None) -> dict[int, str]:
    """Index -> reason for views that are blank (constant) or dark (see module doc)."""
    means, stds = _view_stats(stack, valid)
    med_std, med_mean = float(np.median(stds)), float(np.median(means))
    found: dict[int, str] = {}
    positive = float(np.min(_sample(stack[valid] if valid is not None else stack.ravel()))) >= 0
    for i in range(len(stack)):
        if stds[i] <= 1e-6 * max(med_std, 1e-30):
            found[i] = f"blank (std {stds[i]:.3g} vs median {med_std:.3g})"
        elif positive and med_mean > 0 and means[i] < 0.1 * med_mean:
            found[i] = f"dark (mean {means[i]:.3g} < 10% of the median view mean {med_mean:.3g})"
    return found


def _take(idx, stack, valid, angles, views):
    return stack[idx], (None if valid is None else valid[idx]), angles[idx], views[idx]


def refuse_constant(stack: np.ndarray, valid: np.ndarray | None, where: str) -> None:
    """Refuse a stack whose valid pixels all hold one value (or that has no valid pixel), or whose
    largest |value| is outside :data:`STAT_RANGE`."""
    values = stack if valid is None else stack[valid]
    if values.size == 0:
        raise TiltSeriesError(f"{where}: no pixel of the stack holds a finite value; nothing to reconstruct. Check "
                              "data.path: is it the right file?")
    if valid is None:  # view by view, on threads
        ends = map_views(lambda i: (float(stack[i].min()), float(stack[i].max())), len(stack), stack.size)
        lo, hi = min(e[0] for e in ends), max(e[1] for e in ends)
    else:
        lo, hi = float(values.min()), float(values.max())
    if hi == lo:
        raise TiltSeriesError(f"{where}: every pixel of the stack holds the value {lo:.6g}; a constant stack carries "
                              "no signal. Check data.path (the right file? exported empty?) and re-export the stack.")
    top = max(abs(lo), abs(hi))
    if not STAT_RANGE[0] <= top <= STAT_RANGE[1]:  # before the dark-view check, which would call every view blank
        flow = "underflow to 0" if top < STAT_RANGE[0] else "overflow to inf"
        raise TiltSeriesError(
            f"{where}: the stack's largest |value| is {top:.3g}, outside the range float32 statistics can handle "
            f"({STAT_RANGE[0]:.0e} to {STAT_RANGE[1]:.0e}: a view's variance would {flow}, and every view would look "
            f"blank). Rescale the stack, e.g. with IMOD newstack -scale 0,1000, or multiply it by about "
            f"{1e3 / top:.0e}.")


def _exclude(parts: tuple, cfg, where: str):
    """data.exclude_views (1-based file sections) of ``parts`` = (stack, valid, angles, views).
    Returns the kept parts and the step's record."""
    stack, valid, angles, views = parts
    n = len(views)
    ex = sorted({int(v) for v in cfg.exclude_views})
    out_of_range = [v for v in ex if not 1 <= v <= n]
    if out_of_range:
        raise TiltSeriesError(f"{where}: data.exclude_views {out_of_range} are not sections of this {n}-view stack; "
                              f"view numbers are 1-based (1..{n}), as in IMOD.")
    keep = np.setdiff1d(views, ex) - 1
    if keep.size < 2:
        raise TiltSeriesError(f"{where}: data.exclude_views {ex} leaves {keep.size} of the {n} views; a reconstruction "
                              "needs at least two views at different angles: exclude fewer views.")
    log.info("%s: excluded views %s (1-based); %d remain.", where, ex, n - len(ex))
    return (*_take(keep, stack, valid, angles, views), f"excluded views {ex} (1-based)")


def _dark_views(parts: tuple, cfg, where: str):
    """Report dark and blank views of ``parts`` = (stack, valid, angles, views); drop them with
    data.drop_dark_views, else refuse blank ones. Returns the kept parts and the step's record
    (or None)."""
    stack, valid, angles, views = parts
    dark = find_dark_views(stack, valid)
    if not dark:
        return stack, valid, angles, views, None
    listing = "; ".join(f"view {views[i]}: {r}" for i, r in dark.items())
    if cfg.drop_dark_views:
        keep = np.setdiff1d(np.arange(len(views)), list(dark))
        log.warning("%s: dropping %d dark/blank views (data.drop_dark_views=true): %s", where, len(dark), listing)
        return (*_take(keep, stack, valid, angles, views), f"dropped dark/blank views: {listing}")
    blank = {int(views[i]): r for i, r in dark.items() if r.startswith("blank")}
    if blank:
        raise TiltSeriesError(
            f"{where}: view{'s' if len(blank) > 1 else ''} {', '.join(map(str, blank))} (1-based) "
            f"{'are' if len(blank) > 1 else 'is'} blank (constant: no signal, a reconstruction would fit its "
            f"emptiness; {'; '.join(f'view {v}: {r}' for v, r in blank.items())}). Drop "
            f"{'them' if len(blank) > 1 else 'it'} with data.exclude_views={list(blank)} "
            "(or data.drop_dark_views=true).")
    log.warning("%s: dark views kept: %s. Set data.drop_dark_views=true to drop them, or data.exclude_views=[...].",
                where, listing)
    return stack, valid, angles, views, None


def _pixel_masks(stack: np.ndarray, valid: np.ndarray | None, cfg, where: str,
                 angles: np.ndarray | None = None) -> np.ndarray | None:
    """Steps 1 and 1b (non-finite and hot pixels), then the refusal of a constant stack."""
    valid = handle_nonfinite(stack, valid, cfg.nonfinite, where)
    valid = hot_pixel_mask(stack, valid, getattr(cfg, "hot_pixels", "mask"), where, angles,
                           getattr(cfg, "tilt_axis_angle", 0.0) or 0.0)
    refuse_constant(stack, valid, where)
    return valid


def prepare(raw: RawSeries, cfg) -> TiltSeries:
    """Apply the preparation steps of ``cfg`` (a DataConfig) in the documented order."""
    where = raw.source
    steps: list[str] = []
    stack = np.ascontiguousarray(raw.stack, dtype=np.float32)
    angles = np.asarray(raw.angles, dtype=np.float64)
    valid = raw.valid
    views = np.arange(1, stack.shape[0] + 1)
    pixel = float(raw.pixel_size)
    gt = raw.ground_truth

    valid = _pixel_masks(stack, valid, cfg, where, angles)
    if cfg.exclude_views:
        stack, valid, angles, views, step = _exclude((stack, valid, angles, views), cfg, where)
        steps.append(step)
    check_angles(angles, f"{where} (angles from {raw.angle_source})", views)
    check_angle_units(angles, f"{where} (angles from {raw.angle_source})", getattr(cfg, "check_angle_units", True))

    if cfg.tilt_axis_angle != 0:
        if angles.ndim == 2:
            raise TiltSeriesError(
                f"{where}: per-line angles belong to the image lines as stored; they cannot follow a tilt-axis "
                "rotation. Give images whose tilt axis already runs along Y (data.tilt_axis_angle=0).")
        stack, valid = rotate_tilt_axis(stack, valid, cfg.tilt_axis_angle)
        steps.append(f"rotated by {-cfg.tilt_axis_angle} degrees (tilt axis {cfg.tilt_axis_angle} -> Y)")
        log.info("%s: rotated images by %.3f degrees so the tilt axis lies along Y (%s).", where,
                 -cfg.tilt_axis_angle, "no empty corners" if valid is None else
                 f"{int((~valid).sum())} pixels without data masked")
    if cfg.binning > 1:
        stack, valid, angles = bin_stack(stack, valid, angles, cfg.binning)
        pixel *= cfg.binning
        steps.append(f"binned by {cfg.binning}")
        log.info("%s: binned by %d -> %s, pixel size %.4g A.", where, cfg.binning, stack.shape[1:], pixel)
    if cfg.crop is not None:
        stack, valid, angles = crop_stack(stack, valid, angles, cfg.crop, where)
        steps.append(f"cropped to {list(cfg.crop)}")
        log.info("%s: cropped to [y0, y1, x0, x1] = %s -> %s.", where, list(cfg.crop), stack.shape[1:])
    if gt is not None and (cfg.tilt_axis_angle != 0 or cfg.binning > 1 or cfg.crop is not None):
        log.info("%s: ground truth dropped (it no longer matches the rotated/binned/cropped images).", where)
        gt = None

    stack, valid, angles, views, step = _dark_views((stack, valid, angles, views), cfg, where)
    if step:
        steps.append(step)
    key = angles if angles.ndim == 1 else angles.mean(axis=1)
    perm = np.argsort(key, kind="stable")
    if not np.array_equal(perm, np.arange(len(perm))):
        stack, valid, angles, views = _take(perm, stack, valid, angles, views)
        steps.append("sorted views by tilt angle")
        log.info("%s: angles not monotonic (e.g. dose-symmetric); views sorted by angle, file order kept in "
                 "metadata['view_numbers'].", where)

    def values():  # the valid pixels, flat (the stack itself, not a copy, when all are valid)
        return stack.reshape(-1) if valid is None else stack[valid]

    if cfg.invert:
        top = float(values().max())
        stack = top - stack
        steps.append(f"inverted (x -> {top:.6g} - x)")
        log.info("%s: contrast inverted (x -> max - x, max = %.6g).", where, top)
    if cfg.normalize == "quantile":
        lo, hi = (float(q) for q in np.quantile(_sample(values()), QUANTILES))
        if not hi > lo:
            raise TiltSeriesError(f"{where}: intensities are constant ({lo:.6g}) between the {QUANTILES} quantiles; "
                                  "nothing to reconstruct (wrong file or all views blank?).")
        stack = stack - np.float32(lo)  # a new array (the raw stack is the caller's), then divided in place
        stack /= np.float32(hi - lo)
        steps.append(f"quantile-normalized ({lo:.6g} -> 0, {hi:.6g} -> 1)")
        log.info("%s: normalized: quantile %.3g = %.6g -> 0, quantile %.4g = %.6g -> 1.", where, QUANTILES[0], lo,
                 QUANTILES[1], hi)
    if valid is not None:
        for i in range(len(stack)):
            good = stack[i][valid[i]]
            stack[i][~valid[i]] = np.median(good) if good.size else 0.0
    meta = dict(raw.metadata)
    meta.update(preparation=steps, view_numbers=views.tolist(), sort_permutation=perm.tolist(),
                pixel_size_A=pixel)
    return TiltSeries(stack=stack, angles=angles, pixel_size=pixel, source=raw.source, metadata=meta,
                      ground_truth=gt, valid=valid)
