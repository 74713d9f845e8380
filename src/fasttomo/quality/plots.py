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
    spec = _PlotSpec(series, title, xlabel, ylabel, hlines, vlines, xlim, ylim, log_y, size, top_ticks, top_label,
                     legend)
    img, layout, crowded = _Plot(spec).render()
    if legend == "best" and crowded:  # every inside corner would hide part of a curve
        img, layout, _ = _Plot(dataclasses.replace(spec, legend="below")).render()
    return img, layout


@dataclasses.dataclass(frozen=True)
class _PlotSpec:
    """The arguments of :func:`render_line_plot`."""

    series: object
    title: str
    xlabel: str
    ylabel: str
    hlines: object
    vlines: object
    xlim: tuple[float, float] | None
    ylim: tuple[float, float] | None
    log_y: bool
    size: tuple[int, int]
    top_ticks: Callable[[float], str] | None
    top_label: str
    legend: str


class _Plot:
    """One rendering of a :class:`_PlotSpec`: the data and its limits, the margins set by the tick
    labels, the plot area (grid, reference lines, curves), the legend, the frame and the labels;
    drawn SUPERSAMPLE times larger and averaged down."""

    def __init__(self, spec: _PlotSpec):
        from PIL import Image, ImageDraw

        self.spec = spec
        self.ser = _as_series(spec.series)
        self.h_refs, self.v_refs = _as_ref(spec.hlines), _as_ref(spec.vlines)
        out_w, out_h = (int(s) for s in spec.size)
        if out_w < 200 or out_h < 150:
            raise ValueError(f"line_plot: size must be at least (200, 150) pixels, got {spec.size!r}.")
        self.width, self.height = out_w * SUPERSAMPLE, out_h * SUPERSAMPLE  # drawn large, then averaged down
        self.colors = []
        k = 0
        for s in self.ser:
            if s.color is None:
                self.colors.append(PALETTE[k % len(PALETTE)])
                k += 1
            else:
                self.colors.append(tuple(int(c) for c in s.color))
        self.xs = [np.asarray(s.x, dtype=np.float64).ravel() for s in self.ser]
        self.ys = [np.asarray(s.y, dtype=np.float64).ravel() for s in self.ser]
        for s, x, y in zip(self.ser, self.xs, self.ys):
            if x.shape != y.shape:
                raise ValueError(f"line_plot: series {s.label!r} has {x.size} x values and {y.size} y values.")
        ser, v_refs, h_refs = self.ser, self.v_refs, self.h_refs
        all_x = np.concatenate(self.xs + [np.array([r.value for r in v_refs])]) if ser or v_refs else np.zeros(0)
        all_y = np.concatenate(self.ys + [np.array([r.value for r in h_refs])]) if ser or h_refs else np.zeros(0)
        self.x0v, self.x1v = _limits(all_x, spec.xlim, 0.0, False)
        self.y0v, self.y1v = _limits(all_y, spec.ylim, 0.05, spec.log_y)
        self.scale = SUPERSAMPLE * max(0.75, min(out_w, out_h * 1.5) / 760.0)
        self.f_title, self.f_label, self.f_tick, self.f_leg = (_font(round(s * self.scale)) for s in (17, 14, 12, 13))
        self.img = Image.new("RGB", (self.width, self.height), "white")
        self.draw = ImageDraw.Draw(self.img)
        self._ticks()
        self._margins()

    def d(self, v: float) -> int:
        """A length given in output pixels, at the drawing scale."""
        return max(1, round(v * self.scale))

    def _ticks(self) -> None:
        """The tick values and labels (computed first: their labels set the margins)."""
        spec, draw = self.spec, self.draw
        if spec.log_y:
            self.yticks = _log_ticks(self.y0v, self.y1v)
            self.ylabels = [f"{t:g}" for t in self.yticks]
        else:
            self.yticks, ystep = nice_ticks(self.y0v, self.y1v, target=max(3, self.height // 80))
            self.ylabels = [_fmt_tick(t, ystep) for t in self.yticks]
        self.xticks, xstep = nice_ticks(self.x0v, self.x1v, target=max(3, self.width // 110))
        self.xlabels = [_fmt_tick(t, xstep) for t in self.xticks]
        self.tick_h = _text_size(draw, "0.9", self.f_tick)[1]
        self.label_h = _text_size(draw, "Ag", self.f_label)[1]
        self.ytw = max([_text_size(draw, s, self.f_tick)[0] for s in self.ylabels] + [10])

    def _margins(self) -> None:
        """The legend box's size and the plot area's edges, on the output pixel grid."""
        spec, draw, d = self.spec, self.draw, self.d
        self.pad, self.tl, self.hair = d(8), d(5), SUPERSAMPLE  # padding, tick length, hairline width
        pad, tl, hair = self.pad, self.tl, self.hair
        corners = ("upper right", "upper left", "lower right", "lower left")
        if spec.legend not in ("best", "none", "below", *corners):
            raise ValueError(f"line_plot: legend must be best, below, none or one of {list(corners)}, "
                             f"got {spec.legend!r}.")
        self.show_legend = bool(self.ser) and spec.legend != "none"
        self.sample = d(28)
        self.row_h = _text_size(draw, "Ag", self.f_leg)[1] + d(8)
        label_w = max([_text_size(draw, s.label, self.f_leg)[0] for s in self.ser] + [0])
        self.bw = pad + self.sample + pad + label_w + pad
        self.bh = pad + self.row_h * len(self.ser) + pad // 2
        self.below = self.bh + pad if self.show_legend and spec.legend == "below" else 0
        left = pad + (self.label_h + pad if spec.ylabel else 0) + self.ytw + d(3) + tl + hair
        right = self.width - d(24)
        top = pad + (_text_size(draw, spec.title, self.f_title)[1] + pad if spec.title else 0)
        if spec.top_ticks is not None:
            top += self.tick_h + d(3) + tl + hair + (self.label_h + d(6) + pad if spec.top_label else 0)
        else:
            top += pad
        bottom = self.height - (pad + hair + tl + d(3) + self.tick_h + (d(6) + pad + self.label_h if spec.xlabel else 0)
                                + self.below)
        ss = SUPERSAMPLE  # the plot area starts and ends on the output pixel grid: crisp frame and rules
        left, top = -(-left // ss) * ss, -(-top // ss) * ss
        right, bottom = left + (right - left + 1) // ss * ss - 1, top + (bottom - top + 1) // ss * ss - 1
        if right - left < d(60) or bottom - top < d(60):
            raise ValueError(f"line_plot: size {spec.size!r} leaves no room for the plot area; make it larger.")
        self.left, self.top, self.right, self.bottom = left, top, right, bottom
        self.pw, self.ph = right - left + 1, bottom - top + 1

    def px(self, v):
        return (np.asarray(v, dtype=np.float64) - self.x0v) / (self.x1v - self.x0v) * (self.pw - 1)

    def py(self, v):
        v = np.asarray(v, dtype=np.float64)
        if self.spec.log_y:
            with np.errstate(divide="ignore", invalid="ignore"):
                t = (np.log10(v) - math.log10(self.y0v)) / (math.log10(self.y1v) - math.log10(self.y0v))
        else:
            t = (v - self.y0v) / (self.y1v - self.y0v)
        return (1.0 - t) * (self.ph - 1)

    def gx(self, v) -> int:
        """A plot-area column on the output pixel grid."""
        ss = SUPERSAMPLE
        return int(min(max(round(float(self.px(v)) / ss) * ss, 0), self.pw - ss))

    def gy(self, v) -> int:
        ss = SUPERSAMPLE
        return int(min(max(round(float(self.py(v)) / ss) * ss, 0), self.ph - ss))

    def render(self):
        """(image, Layout, crowded: the best corner of the legend would hide part of a curve)."""
        from PIL import Image, ImageDraw

        self.area = Image.new("RGB", (self.pw, self.ph), "white")  # its own image: lines clipped to it
        self.ad = ImageDraw.Draw(self.area)
        drawn_pts = self._area()
        legend_box, crowded = self._legend(drawn_pts) if self.show_legend else (None, False)
        self.img.paste(self.area, (self.left, self.top))
        self._axes()
        img = self.img.reduce(SUPERSAMPLE) if SUPERSAMPLE > 1 else self.img
        left, top, right, bottom = self.left, self.top, self.right, self.bottom
        plot_box = (-(-left // SUPERSAMPLE), -(-top // SUPERSAMPLE), right // SUPERSAMPLE, bottom // SUPERSAMPLE)
        return img, Layout(plot=plot_box, legend=legend_box, colors=self.colors), crowded

    def _area(self) -> list[tuple[float, float]]:
        """Grid, reference lines and curves in the plot area; returns points along the curves (for
        the legend's placement)."""
        ad, d, pw, ph = self.ad, self.d, self.pw, self.ph
        for t in self.xticks:
            _vrule(ad, self.gx(t), 0, ph - 1, GRID_COLOR)
        for t in self.yticks:
            _hrule(ad, 0, pw - 1, self.gy(t), GRID_COLOR)
        for r in self.h_refs:
            _hrule(ad, 0, pw - 1, self.gy(r.value), r.color, dash=(d(7), d(4)))
        for r in self.v_refs:
            _vrule(ad, self.gx(r.value), 0, ph - 1, r.color, dash=(d(7), d(4)))
        drawn_pts: list[tuple[float, float]] = []
        for s, x, y, col in zip(self.ser, self.xs, self.ys, self.colors):
            self._curve(s, x, y, col, drawn_pts)
        for r in self.h_refs:
            if r.label:
                yy = self.gy(r.value)
                tw, th = _text_size(ad, r.label, self.f_tick)
                ad.rectangle([d(4), yy - th - d(7), d(8) + tw, yy - d(3)], fill="white")
                ad.text((d(6), yy - d(4)), r.label, fill=r.color, font=self.f_tick, anchor="ld")
        for r in self.v_refs:
            if r.label:
                ad.text((self.gx(r.value) + d(4), ph - d(6)), r.label, fill=r.color, font=self.f_tick, anchor="ld")
        return drawn_pts

    def _curve(self, s: Series, x: np.ndarray, y: np.ndarray, col, drawn_pts: list) -> None:
        """One series: lines between finite points (NaN breaks them), dots where asked or alone."""
        ad, d = self.ad, self.d
        good = np.isfinite(x) & np.isfinite(y)
        if self.spec.log_y:
            good &= y > 0
        X, Y = self.px(x), self.py(y)
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

    def _legend(self, drawn_pts: list) -> tuple[tuple | None, bool]:
        """The legend: inside the plot area in the corner where the curves leave the most room
        ("best"), in a named corner, or below the x label. Returns (its box, crowded)."""
        d, pad, bw, bh, pw, ph = self.d, self.pad, self.bw, self.bh, self.pw, self.ph
        legend, crowded = self.spec.legend, False
        m = d(10)
        at = {"upper right": (pw - bw - m, m), "upper left": (m, m), "lower right": (pw - bw - m, ph - bh - m),
              "lower left": (m, ph - bh - m)}
        if legend == "below":  # under the x label, on the canvas (never hides a curve)
            canvas, ox, oy, corner = self.draw, 0, 0, ((self.left + self.right - bw) // 2, self.height - pad - bh)
        elif legend == "best":
            canvas, ox, oy = self.ad, self.left, self.top
            pts = np.asarray(drawn_pts) if drawn_pts else np.zeros((0, 2))

            def crowd(c):
                cx, cy = c
                return int(((pts[:, 0] >= cx - m) & (pts[:, 0] <= cx + bw + m) & (pts[:, 1] >= cy - m)
                            & (pts[:, 1] <= cy + bh + m)).sum()) if pts.size else 0

            corner = min(at.values(), key=crowd)  # dict order breaks ties: upper right first
            crowded = crowd(corner) > 0
        else:
            canvas, ox, oy, corner = self.ad, self.left, self.top, at[legend]
        cx, cy = int(corner[0]), int(corner[1])
        canvas.rectangle([cx, cy, cx + bw, cy + bh], fill="white", outline=(170, 170, 170), width=self.hair)
        sample = self.sample
        for i, (s, col) in enumerate(zip(self.ser, self.colors)):
            ym = cy + pad + i * self.row_h + self.row_h // 2
            if s.width > 0:
                canvas.line([(cx + pad, ym), (cx + pad + sample, ym)], fill=col, width=d(3))
            if s.markers or s.width <= 0:
                r = d(max(s.width, 2) + 1.5)
                canvas.ellipse([cx + pad + sample // 2 - r, ym - r, cx + pad + sample // 2 + r, ym + r], fill=col)
            canvas.text((cx + pad + sample + pad, ym), s.label, fill=TEXT_COLOR, font=self.f_leg, anchor="lm")
        return tuple(v // SUPERSAMPLE for v in (ox + cx, oy + cy, ox + cx + bw, oy + cy + bh)), crowded

    def _axes(self) -> None:
        """The frame, the ticks and their labels, the axis labels and the title."""
        from PIL import Image, ImageDraw

        spec, draw, d = self.spec, self.draw, self.d
        left, top, right, bottom = self.left, self.top, self.right, self.bottom
        hair, tl, pad = self.hair, self.tl, self.pad
        draw.rectangle([left - hair, top - hair, right + hair, bottom + hair], outline=AXIS_COLOR, width=hair)
        for t, lab in zip(self.xticks, self.xlabels):
            xx = left + self.gx(t)
            _vrule(draw, xx, bottom + 1, bottom + hair + tl, AXIS_COLOR)
            draw.text((xx, bottom + hair + tl + d(3)), lab, fill=TEXT_COLOR, font=self.f_tick, anchor="mt")
            if spec.top_ticks is not None:
                _vrule(draw, xx, top - hair - tl, top - 1, AXIS_COLOR)
                try:
                    tlab = spec.top_ticks(t)
                except (ZeroDivisionError, ValueError, OverflowError):
                    tlab = ""
                if tlab:
                    draw.text((xx, top - hair - tl - d(3)), tlab, fill=TEXT_COLOR, font=self.f_tick, anchor="mb")
        for t, lab in zip(self.yticks, self.ylabels):
            yy = top + self.gy(t)
            _hrule(draw, left - hair - tl, left - 1, yy, AXIS_COLOR)
            draw.text((left - hair - tl - d(3), yy), lab, fill=TEXT_COLOR, font=self.f_tick, anchor="rm")
        cxp = (left + right) // 2
        if spec.xlabel:
            draw.text((cxp, self.height - pad - self.below), spec.xlabel, fill=TEXT_COLOR, font=self.f_label,
                      anchor="md")
        if spec.title:
            draw.text((self.width // 2, pad), spec.title, fill=TEXT_COLOR, font=self.f_title, anchor="mt")
        if spec.top_ticks is not None and spec.top_label:
            draw.text((cxp, top - hair - tl - d(3) - self.tick_h - d(6)), spec.top_label, fill=TEXT_COLOR,
                      font=self.f_label, anchor="md")
        if spec.ylabel:
            tw, th = _text_size(draw, spec.ylabel, self.f_label)
            lab = Image.new("L", (tw + d(4), th + d(6)), 0)
            ImageDraw.Draw(lab).text((d(2), d(2)), spec.ylabel, fill=255, font=self.f_label, anchor="lt")
            lab = lab.rotate(90, expand=True)  # reads bottom to top, as y labels do
            ink = Image.new("RGB", lab.size, TEXT_COLOR)
            self.img.paste(ink, (pad, (top + bottom) // 2 - lab.size[1] // 2), lab)


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
