"""PIL line plots: the PNG has the requested size, every series' colour is drawn inside the plot
area and inside the legend, reference lines appear, and an existing file is never replaced unless
asked."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from fasttomo.data.io import OutputExistsError
from fasttomo.quality.plots import PALETTE, Series, line_plot, nice_ticks, render_line_plot

RED, BLUE = (214, 39, 40), (31, 119, 180)


def _near(img: np.ndarray, color, tol: float = 40.0) -> np.ndarray:
    """Pixels within ``tol`` (RGB distance) of ``color``: lines are anti-aliased at their edges,
    their cores keep the colour."""
    return np.linalg.norm(img.astype(float) - np.asarray(color, dtype=float), axis=-1) < tol


def _crop(img: np.ndarray, box) -> np.ndarray:
    x0, y0, x1, y1 = box
    return img[y0:y1 + 1, x0:x1 + 1]


def _fsc_like():
    f = np.linspace(0.01, 0.25, 24)
    return [Series("all", f, np.exp(-f / 0.08)), Series("measured", f, np.exp(-f / 0.12)),
            Series("wedge", f, np.exp(-f / 0.04), color=(0, 0, 0))]


def test_png_size_series_colours_and_legend(tmp_path):
    series = _fsc_like()
    kw = dict(hlines=[(0.5, "FSC = 0.5"), (0.143, "FSC = 0.143")], ylim=(-0.1, 1.05), size=(640, 400),
              top_ticks=lambda k: f"{1 / k:.3g}" if k > 0 else "", top_label="resolution (A)")
    path = line_plot(tmp_path / "fsc.png", series, "FSC", "frequency (1/A)", "FSC", **kw)
    img = Image.open(path)
    assert img.format == "PNG" and img.size == (640, 400)
    arr = np.asarray(img.convert("RGB"))
    _, layout = render_line_plot(series, "FSC", "frequency (1/A)", "FSC", **kw)
    assert layout.colors == [PALETTE[0], PALETTE[1], (0, 0, 0)]      # palette in order, explicit colours kept
    x0, y0, x1, y1 = layout.plot
    assert 0 < x0 < x1 < 640 and 0 < y0 < y1 < 400
    plot = _crop(arr, layout.plot)
    legend = _crop(arr, layout.legend)
    lx0, ly0, lx1, ly1 = layout.legend
    assert x0 <= lx0 < lx1 <= x1 and y0 <= ly0 < ly1 <= y1               # the legend sits inside the plot
    for color in layout.colors:
        assert _near(plot, color).sum() > 100, color                     # the curve is drawn
        assert _near(legend, color, tol=20).sum() > 20, color            # and named in the legend
    outside = arr.copy()
    outside[y0:y1 + 1, x0:x1 + 1] = 255
    assert _near(outside, PALETTE[1]).sum() == 0                          # curves are clipped to the plot area
    grey = _near(plot, (90, 90, 90), tol=25)                             # the dashed reference lines
    rows = np.flatnonzero(grey.sum(axis=1) > 0.3 * plot.shape[1])
    assert len(rows) >= 2
    assert (arr < 100).all(axis=-1)[: y0].sum() > 50                      # title and top labels are drawn


def test_legend_below_and_markers(tmp_path):
    ang = np.linspace(-60, 60, 21)
    series = [Series("used views", ang, 0.9 - 1e-4 * ang ** 2, markers=True),
              Series("held out", ang[::5], 0.8 - 1e-4 * ang[::5] ** 2, color=RED, markers=True, width=0)]
    img, layout = render_line_plot(series, "per view", "tilt (degrees)", "r", legend="below", size=(500, 360))
    arr = np.asarray(img)
    assert img.size == (500, 360)
    assert layout.legend[1] > layout.plot[3]                               # under the plot area
    assert _near(_crop(arr, layout.legend), RED, tol=20).sum() > 10
    assert _near(_crop(arr, layout.plot), RED, tol=20).sum() > 5 * 5      # the markers of the held-out views


def test_log_axis_nan_gaps_and_bad_input(tmp_path):
    x = np.arange(10.0)
    y = np.exp(-x)
    y[4] = np.nan
    img, layout = render_line_plot([Series("decay", x, y)], log_y=True, size=(400, 300))
    assert _near(_crop(np.asarray(img), layout.plot), BLUE).sum() > 50
    with pytest.raises(ValueError, match="x values"):
        render_line_plot([Series("bad", [1, 2, 3], [1, 2])])
    with pytest.raises(ValueError, match="legend"):
        render_line_plot([Series("a", x, x)], legend="middle")
    with pytest.raises(ValueError, match="size"):
        render_line_plot([Series("a", x, x)], size=(100, 80))


def test_refuses_to_overwrite_unless_told(tmp_path):
    path = tmp_path / "p.png"
    line_plot(path, {"a": ([0, 1], [0, 1])}, size=(300, 200))
    before = path.read_bytes()
    with pytest.raises(OutputExistsError, match="refusing to overwrite"):
        line_plot(path, {"b": ([0, 1], [1, 0])}, size=(300, 200))
    assert path.read_bytes() == before
    line_plot(path, {"b": ([0, 1], [1, 0])}, size=(320, 200), overwrite=True)
    assert Image.open(path).size == (320, 200)
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]                # no temporary file left


def test_nice_ticks():
    assert nice_ticks(0.0, 1.0, 5)[0] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ticks, step = nice_ticks(-0.13, 0.26, 6)       # 0.39 / 6 = 0.065 -> the next nice step is 0.1
    assert step == pytest.approx(0.1) and ticks == pytest.approx([-0.1, 0.0, 0.1, 0.2]) and ticks[1] == 0.0
    assert nice_ticks(0.0, 0.05, 6)[1] == pytest.approx(0.01)
    assert nice_ticks(0.0, 0.125, 6)[1] == pytest.approx(0.025)
