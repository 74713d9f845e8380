"""Small line plots drawn with Pillow only (no matplotlib): axes, ticks, grid, labels, title, a
legend and labelled reference lines, written atomically as PNG.

    line_plot("fsc.png", [Series("all", f, c), Series("measured", f, m)], "FSC", "frequency (1/A)",
              "FSC", hlines=[(0.5, "0.5"), (0.143, "0.143")], ylim=(-0.2, 1.05),
              top_ticks=lambda k: f"{1 / k:.3g}", top_label="resolution (A)")

The default font is Pillow's built-in scalable one (``ImageFont.load_default(size)``); it has no
Angstrom sign, so units are written "A".
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

#: matplotlib's "tab10" colours, familiar from scientific figures.
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]
REF_COLOR = (90, 90, 90)
GRID_COLOR = (228, 228, 228)
AXIS_COLOR = (40, 40, 40)
TEXT_COLOR = (20, 20, 20)
SUPERSAMPLE = 2
"""Plots are drawn this many times larger and box-averaged down (anti-aliased lines and text)."""


@dataclasses.dataclass
class Series:
    """One curve: ``y`` against ``x`` (NaN points break the line)."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    color: tuple[int, int, int] | None = None
    """RGB; None takes the next palette colour."""
    width: int = 2
    """Line width in pixels; 0 draws no line (markers only)."""
    markers: bool = False
    """Draw a small dot at every point (for discrete data such as views)."""


@dataclasses.dataclass
class RefLine:
    """A horizontal (or vertical) dashed reference line with an optional label."""

    value: float
    label: str = ""
    color: tuple[int, int, int] = REF_COLOR


@dataclasses.dataclass
class Layout:
    """Pixel boxes (x0, y0, x1, y1), inclusive, of the parts of a rendered plot."""

    plot: tuple[int, int, int, int]
    legend: tuple[int, int, int, int] | None
    colors: list[tuple[int, int, int]]
    """The colour of each series, in order."""


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # pragma: no cover - Pillow < 10.1 has only the small bitmap font
        return ImageFont.load_default()


def _text_size(draw, text: str, font) -> tuple[int, int]:
    x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
    return x1 - x0, y1 - y0


def nice_ticks(lo: float, hi: float, target: int = 6) -> tuple[list[float], float]:
    """Tick positions at 1, 2, 2.5 or 5 times a power of ten covering [lo, hi]; returns (ticks, step)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo], 1.0
    raw = (hi - lo) / max(1, target)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))
    first = math.ceil(lo / step - 1e-9)
    ticks = []
    k = first
    while k * step <= hi + 1e-9 * step:
        ticks.append(0.0 if abs(k * step) < 1e-12 * step else k * step)
        k += 1
    return ticks, step


def _fmt_tick(v: float, step: float) -> str:
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    decimals = next((d for d in range(9) if abs(step * 10 ** d - round(step * 10 ** d)) < 1e-6 * 10 ** d), 9)
    return f"{v:.{decimals}f}"


def _as_series(series) -> list[Series]:
    if isinstance(series, Mapping):
        items: Iterable = [(k, *v) for k, v in series.items()]
    else:
        items = series
    out = []
    for s in items:
        if isinstance(s, Series):
            out.append(s)
        else:
            out.append(Series(*s))
    return out


def _as_ref(lines) -> list[RefLine]:
    out = []
    for r in lines or ():
        if isinstance(r, RefLine):
            out.append(r)
        elif isinstance(r, (int, float)):
            out.append(RefLine(float(r)))
        else:
            out.append(RefLine(*r))
    return out


def _limits(values: np.ndarray, lim, pad: float, log: bool) -> tuple[float, float]:
    if lim is not None:
        lo, hi = float(lim[0]), float(lim[1])
    else:
        v = values[np.isfinite(values)]
        if log:
            v = v[v > 0]
        if v.size == 0:
            lo, hi = (0.1, 1.0) if log else (0.0, 1.0)
        else:
            lo, hi = float(v.min()), float(v.max())
            if hi == lo:  # a single value: widen around it
                lo, hi = (lo / 2, hi * 2) if log else (lo - max(abs(lo), 1.0) / 2, hi + max(abs(hi), 1.0) / 2)
            if log:
                lo, hi = lo / (1 + pad * 4), hi * (1 + pad * 4)
            else:
                span = hi - lo if hi > lo else max(abs(hi), 1.0)
                lo, hi = lo - pad * span, hi + pad * span
    if log and lo <= 0:
        raise ValueError(f"line_plot: a log axis needs positive limits, got ({lo}, {hi}).")
    if not hi > lo:
        raise ValueError(f"line_plot: axis limits must satisfy min < max, got ({lo}, {hi}).")
    return lo, hi


def _log_ticks(lo: float, hi: float) -> list[float]:
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    decades = [10.0 ** k for k in range(a, b + 1) if lo * (1 - 1e-9) <= 10.0 ** k <= hi * (1 + 1e-9)]
    if len(decades) >= 2:
        return decades
    return [m * 10.0 ** k for k in range(a, b + 1) for m in (1, 2, 5) if lo <= m * 10.0 ** k <= hi]


def _hrule(draw, x0: int, x1: int, y: int, color, dash: tuple[int, int] | None = None) -> None:
    """A horizontal line one output pixel thick: rows y .. y + SUPERSAMPLE - 1 (y on the output grid)."""
    step = (x1 - x0 + 1) if dash is None else dash[0] + dash[1]
    length = (x1 - x0 + 1) if dash is None else dash[0]
    for x in range(x0, x1 + 1, step):
        draw.rectangle([x, y, min(x + length - 1, x1), y + SUPERSAMPLE - 1], fill=color)


def _vrule(draw, x: int, y0: int, y1: int, color, dash: tuple[int, int] | None = None) -> None:
    """A vertical line one output pixel thick: columns x .. x + SUPERSAMPLE - 1."""
    step = (y1 - y0 + 1) if dash is None else dash[0] + dash[1]
    length = (y1 - y0 + 1) if dash is None else dash[0]
    for y in range(y0, y1 + 1, step):
        draw.rectangle([x, y, x + SUPERSAMPLE - 1, min(y + length - 1, y1)], fill=color)


def render_line_plot(series, title: str = "", xlabel: str = "", ylabel: str = "", *, hlines=(), vlines=(),
                     xlim: tuple[float, float] | None = None, ylim: tuple[float, float] | None = None,
                     log_y: bool = False, size: tuple[int, int] = (760, 480),
                     top_ticks: Callable[[float], str] | None = None, top_label: str = "",
                     legend: str = "best"):
    """Draw the plot described in :func:`line_plot`; returns ``(PIL.Image, Layout)`` without writing."""
    args = (series, title, xlabel, ylabel, hlines, vlines, xlim, ylim, log_y, size, top_ticks, top_label)
    img, layout, crowded = _render(*args, legend)
    if legend == "best" and crowded:  # every inside corner would hide part of a curve
        img, layout, _ = _render(*args, "below")
    return img, layout


def _render(series, title, xlabel, ylabel, hlines, vlines, xlim, ylim, log_y, size, top_ticks, top_label, legend):
    from PIL import Image, ImageDraw

    ser = _as_series(series)
    h_refs, v_refs = _as_ref(hlines), _as_ref(vlines)
    out_w, out_h = (int(s) for s in size)
    if out_w < 200 or out_h < 150:
        raise ValueError(f"line_plot: size must be at least (200, 150) pixels, got {size!r}.")
    width, height = out_w * SUPERSAMPLE, out_h * SUPERSAMPLE  # drawn large, then averaged down: smooth lines
    colors = []
    k = 0
    for s in ser:
        if s.color is None:
            colors.append(PALETTE[k % len(PALETTE)])
            k += 1
        else:
            colors.append(tuple(int(c) for c in s.color))
    xs = [np.asarray(s.x, dtype=np.float64).ravel() for s in ser]
    ys = [np.asarray(s.y, dtype=np.float64).ravel() for s in ser]
    for s, x, y in zip(ser, xs, ys):
        if x.shape != y.shape:
            raise ValueError(f"line_plot: series {s.label!r} has {x.size} x values and {y.size} y values.")
    all_x = np.concatenate(xs + [np.array([r.value for r in v_refs])]) if ser or v_refs else np.zeros(0)
    all_y = np.concatenate(ys + [np.array([r.value for r in h_refs])]) if ser or h_refs else np.zeros(0)
    x0v, x1v = _limits(all_x, xlim, 0.0, False)
    y0v, y1v = _limits(all_y, ylim, 0.05, log_y)

    scale = SUPERSAMPLE * max(0.75, min(out_w, out_h * 1.5) / 760.0)
    f_title, f_label, f_tick, f_leg = (_font(round(s * scale)) for s in (17, 14, 12, 13))
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)

    # --- ticks (computed first: their labels set the margins)
    if log_y:
        yticks = _log_ticks(y0v, y1v)
        ylabels = [f"{t:g}" for t in yticks]
    else:
        yticks, ystep = nice_ticks(y0v, y1v, target=max(3, height // 80))
        ylabels = [_fmt_tick(t, ystep) for t in yticks]
    xticks, xstep = nice_ticks(x0v, x1v, target=max(3, width // 110))
    xlabels = [_fmt_tick(t, xstep) for t in xticks]
    tick_h = _text_size(draw, "0.9", f_tick)[1]
    label_h = _text_size(draw, "Ag", f_label)[1]
    ytw = max([_text_size(draw, s, f_tick)[0] for s in ylabels] + [10])

    def d(v: float) -> int:  # a length given in output pixels, at the drawing scale
        return max(1, round(v * scale))

    pad, tl, hair = d(8), d(5), SUPERSAMPLE  # padding, tick length, hairline width
    corners = ("upper right", "upper left", "lower right", "lower left")
    if legend not in ("best", "none", "below", *corners):
        raise ValueError(f"line_plot: legend must be best, below, none or one of {list(corners)}, got {legend!r}.")
    show_legend = bool(ser) and legend != "none"
    sample = d(28)
    row_h = _text_size(draw, "Ag", f_leg)[1] + d(8)
    bw = pad + sample + pad + max([_text_size(draw, s.label, f_leg)[0] for s in ser] + [0]) + pad
    bh = pad + row_h * len(ser) + pad // 2
    below = bh + pad if show_legend and legend == "below" else 0
    left = pad + (label_h + pad if ylabel else 0) + ytw + d(3) + tl + hair
    right = width - d(24)
    top = pad + (_text_size(draw, title, f_title)[1] + pad if title else 0)
    if top_ticks is not None:
        top += tick_h + d(3) + tl + hair + (label_h + d(6) + pad if top_label else 0)
    else:
        top += pad
    bottom = height - (pad + hair + tl + d(3) + tick_h + (d(6) + pad + label_h if xlabel else 0) + below)
    ss = SUPERSAMPLE  # the plot area starts and ends on the output pixel grid: crisp frame and rules
    left, top = -(-left // ss) * ss, -(-top // ss) * ss
    right, bottom = left + (right - left + 1) // ss * ss - 1, top + (bottom - top + 1) // ss * ss - 1
    if right - left < d(60) or bottom - top < d(60):
        raise ValueError(f"line_plot: size {size!r} leaves no room for the plot area; make it larger.")
    pw, ph = right - left + 1, bottom - top + 1

    def px(v):
        return (np.asarray(v, dtype=np.float64) - x0v) / (x1v - x0v) * (pw - 1)

    def py(v):
        v = np.asarray(v, dtype=np.float64)
        if log_y:
            with np.errstate(divide="ignore", invalid="ignore"):
                t = (np.log10(v) - math.log10(y0v)) / (math.log10(y1v) - math.log10(y0v))
        else:
            t = (v - y0v) / (y1v - y0v)
        return (1.0 - t) * (ph - 1)

    def gx(v) -> int:  # a plot-area column on the output pixel grid
        return int(min(max(round(float(px(v)) / ss) * ss, 0), pw - ss))

    def gy(v) -> int:
        return int(min(max(round(float(py(v)) / ss) * ss, 0), ph - ss))

    # --- the plot area, drawn on its own image so lines are clipped to it
    area = Image.new("RGB", (pw, ph), "white")
    ad = ImageDraw.Draw(area)
    for t in xticks:
        _vrule(ad, gx(t), 0, ph - 1, GRID_COLOR)
    for t in yticks:
        _hrule(ad, 0, pw - 1, gy(t), GRID_COLOR)
    for r in h_refs:
        _hrule(ad, 0, pw - 1, gy(r.value), r.color, dash=(d(7), d(4)))
    for r in v_refs:
        _vrule(ad, gx(r.value), 0, ph - 1, r.color, dash=(d(7), d(4)))
    drawn_pts = []
    for s, x, y, col in zip(ser, xs, ys, colors):
        good = np.isfinite(x) & np.isfinite(y)
        if log_y:
            good &= y > 0
        X, Y = px(x), py(y)
        runs = np.split(np.arange(x.size), np.flatnonzero(~good) + 1)
        lw = d(s.width)
        for run in runs:
            run = run[good[run]]
            pts = [(float(X[i]), float(Y[i])) for i in run]
            if len(pts) >= 2 and s.width > 0:
                ad.line(pts, fill=col, width=lw, joint="curve")
            if s.markers or len(pts) == 1 or s.width <= 0:
                r = d(max(s.width, 2) + 1.5)
                for (u, v) in pts:
                    ad.ellipse([u - r, v - r, u + r, v + r], fill=col)
            for a_, b_ in zip(pts[:-1], pts[1:]):  # points along the segments, for the legend placement
                for f in np.linspace(0, 1, 6):
                    drawn_pts.append((a_[0] + f * (b_[0] - a_[0]), a_[1] + f * (b_[1] - a_[1])))
            drawn_pts.extend(pts)
    for r in h_refs:
        if r.label:
            yy = gy(r.value)
            tw, th = _text_size(ad, r.label, f_tick)
            ad.rectangle([d(4), yy - th - d(7), d(8) + tw, yy - d(3)], fill="white")
            ad.text((d(6), yy - d(4)), r.label, fill=r.color, font=f_tick, anchor="ld")
    for r in v_refs:
        if r.label:
            xx = gx(r.value)
            ad.text((xx + d(4), ph - d(6)), r.label, fill=r.color, font=f_tick, anchor="ld")

    # --- legend (inside the plot area, in the corner where the curves leave the most room)
    legend_box, crowded = None, False
    if show_legend:
        m = d(10)
        at = {"upper right": (pw - bw - m, m), "upper left": (m, m), "lower right": (pw - bw - m, ph - bh - m),
              "lower left": (m, ph - bh - m)}
        if legend == "below":  # under the x label, on the canvas (never hides a curve)
            canvas, ox, oy, corner = draw, 0, 0, ((left + right - bw) // 2, height - pad - bh)
        elif legend == "best":
            canvas, ox, oy = ad, left, top
            pts = np.asarray(drawn_pts) if drawn_pts else np.zeros((0, 2))

            def crowd(c):
                cx, cy = c
                return int(((pts[:, 0] >= cx - m) & (pts[:, 0] <= cx + bw + m) & (pts[:, 1] >= cy - m)
                            & (pts[:, 1] <= cy + bh + m)).sum()) if pts.size else 0

            corner = min(at.values(), key=crowd)  # dict order breaks ties: upper right first
            crowded = crowd(corner) > 0
        else:
            canvas, ox, oy, corner = ad, left, top, at[legend]
        cx, cy = int(corner[0]), int(corner[1])
        canvas.rectangle([cx, cy, cx + bw, cy + bh], fill="white", outline=(170, 170, 170), width=hair)
        for i, (s, col) in enumerate(zip(ser, colors)):
            ym = cy + pad + i * row_h + row_h // 2
            if s.width > 0:
                canvas.line([(cx + pad, ym), (cx + pad + sample, ym)], fill=col, width=d(3))
            if s.markers or s.width <= 0:
                r = d(max(s.width, 2) + 1.5)
                canvas.ellipse([cx + pad + sample // 2 - r, ym - r, cx + pad + sample // 2 + r, ym + r], fill=col)
            canvas.text((cx + pad + sample + pad, ym), s.label, fill=TEXT_COLOR, font=f_leg, anchor="lm")
        legend_box = tuple(v // SUPERSAMPLE for v in (ox + cx, oy + cy, ox + cx + bw, oy + cy + bh))
    img.paste(area, (left, top))

    # --- frame, ticks and labels
    draw.rectangle([left - hair, top - hair, right + hair, bottom + hair], outline=AXIS_COLOR, width=hair)
    for t, lab in zip(xticks, xlabels):
        xx = left + gx(t)
        _vrule(draw, xx, bottom + 1, bottom + hair + tl, AXIS_COLOR)
        draw.text((xx, bottom + hair + tl + d(3)), lab, fill=TEXT_COLOR, font=f_tick, anchor="mt")
        if top_ticks is not None:
            _vrule(draw, xx, top - hair - tl, top - 1, AXIS_COLOR)
            try:
                tlab = top_ticks(t)
            except (ZeroDivisionError, ValueError, OverflowError):
                tlab = ""
            if tlab:
                draw.text((xx, top - hair - tl - d(3)), tlab, fill=TEXT_COLOR, font=f_tick, anchor="mb")
    for t, lab in zip(yticks, ylabels):
        yy = top + gy(t)
        _hrule(draw, left - hair - tl, left - 1, yy, AXIS_COLOR)
        draw.text((left - hair - tl - d(3), yy), lab, fill=TEXT_COLOR, font=f_tick, anchor="rm")
    cxp = (left + right) // 2
    if xlabel:
        draw.text((cxp, height - pad - below), xlabel, fill=TEXT_COLOR, font=f_label, anchor="md")
    if title:
        draw.text((width // 2, pad), title, fill=TEXT_COLOR, font=f_title, anchor="mt")
    if top_ticks is not None and top_label:
        draw.text((cxp, top - hair - tl - d(3) - tick_h - d(6)), top_label, fill=TEXT_COLOR, font=f_label,
                  anchor="md")
    if ylabel:
        tw, th = _text_size(draw, ylabel, f_label)
        lab = Image.new("L", (tw + d(4), th + d(6)), 0)
        ImageDraw.Draw(lab).text((d(2), d(2)), ylabel, fill=255, font=f_label, anchor="lt")
        lab = lab.rotate(90, expand=True)  # reads bottom to top, as y labels do
        ink = Image.new("RGB", lab.size, TEXT_COLOR)
        img.paste(ink, (pad, (top + bottom) // 2 - lab.size[1] // 2), lab)
    img = img.reduce(SUPERSAMPLE) if SUPERSAMPLE > 1 else img
    plot_box = (-(-left // SUPERSAMPLE), -(-top // SUPERSAMPLE), right // SUPERSAMPLE, bottom // SUPERSAMPLE)
    return img, Layout(plot=plot_box, legend=legend_box, colors=colors), crowded


def line_plot(path: str | os.PathLike, series, title: str = "", xlabel: str = "", ylabel: str = "", *,
              hlines=(), vlines=(), xlim: tuple[float, float] | None = None, ylim: tuple[float, float] | None = None,
              log_y: bool = False, size: tuple[int, int] = (760, 480),
              top_ticks: Callable[[float], str] | None = None, top_label: str = "", legend: str = "best",
              overwrite: bool = False) -> str:
    """Write a line plot as a PNG of ``size`` = (W, H) pixels, atomically; returns the path.

    ``series``: a list of :class:`Series` or ``(label, x, y[, color])`` tuples, or a mapping
    ``{label: (x, y)}``; colours default to the tab10 palette in order. ``hlines`` / ``vlines``:
    reference lines as numbers, ``(value, label[, color])`` tuples or :class:`RefLine` (dashed;
    horizontal labels sit at the left end, above the line). ``xlim`` / ``ylim``: axis limits
    (default: the data; y padded by 5 %). ``log_y``: logarithmic y axis (non-positive values are
    left out). ``top_ticks``: a function giving a second label for every x tick, drawn along the
    top axis with ``top_label`` (e.g. resolution in A over spatial frequency). ``legend``: ``best``
    (an inside corner no curve crosses, else below the plot), ``upper right``, ``upper left``, ``lower right``,
    ``lower left``, ``below`` (under the x axis label: the plot grows no smaller than needed and
    no curve is hidden) or ``none``. An existing file is refused unless ``overwrite``.
    """
    from fasttomo.data.io.atomic import atomic_write

    img, _ = render_line_plot(series, title, xlabel, ylabel, hlines=hlines, vlines=vlines, xlim=xlim, ylim=ylim,
                              log_y=log_y, size=size, top_ticks=top_ticks, top_label=top_label, legend=legend)
    return atomic_write(path, lambda tmp: img.save(tmp, format="PNG"), overwrite=overwrite)


# --------------------------------------------------------------------------------------- FSC
def fsc_plot(path: Path, curves: dict, title: str, tilt_range=None, overwrite: bool = False) -> str:
    """FSC curves (all / measured / wedge) with the 0.5 and 0.143 lines; x in 1/A, resolution on top."""
    from fasttomo.data.io.atomic import atomic_write

    img = render_fsc(curves, title, tilt_range)
    return atomic_write(path, lambda tmp: img.save(tmp, format="PNG"), overwrite=overwrite)


def render_fsc(curves: dict, title: str, tilt_range=None, size: tuple[int, int] | None = None):
    """The picture of :func:`fsc_plot` (a PIL image), e.g. for the run's report.png."""
    names = {"all": "all of Fourier space", "measured": "measured region", "wedge": "missing wedge"}
    if tilt_range is not None:
        names["measured"] = f"measured ({tilt_range[0]:g} to {tilt_range[1]:g} deg)"
    series = []
    lo = 0.0
    for region, curve in curves.items():
        s = curve.summary(curves=False)
        label = f"{names[region]}: 0.5 at {_short(s, 'fsc05')}, 0.143 at {_short(s, 'fsc0143')}"
        series.append(Series(label, curve.freq_inv_A, curve.fsc))
        finite = curve.fsc[np.isfinite(curve.fsc)]
        if finite.size:
            lo = min(lo, float(finite.min()))
    nyq = next(iter(curves.values())).nyquist_inv_A
    img, _ = render_line_plot(series, title, "spatial frequency (1/A)", "Fourier shell correlation",
                              hlines=[RefLine(0.5, "FSC = 0.5"), RefLine(0.143, "FSC = 0.143")],
                              xlim=(0.0, nyq), ylim=(max(-1.0, lo - 0.05), 1.05),
                              top_ticks=lambda k: f"{1.0 / k:.3g}" if k > 0 else "", top_label="resolution (A)",
                              legend="below", size=size or (760, 470 + 22 * len(series)))
    return img


def _short(s: dict, key: str) -> str:
    status = s[f"{key}_status"]
    return f"{s[f'{key}_A']:.3g} A" if status == "crossed" else {"never": f"<{s['nyquist_A']:.3g} A"}.get(status, "-")
