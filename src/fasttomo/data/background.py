"""Robust estimate of the vacuum (background) level of a tilt series.

The measured image is modelled as ``scale x (line integral) + background``: pixels whose rays
cross no specimen (vacuum) read the background. A low quantile of the pixel values is a biased
estimate of it: on noisy data the lowest values are vacuum pixels with negative noise, so the 1 %
quantile lies about 2.3 noise standard deviations BELOW the vacuum level (it was fasttomo's first
normalization default, and on 5 % noise it filled the box with density).

The estimate here is unbiased for zero-mean noise by splitting the pixels in two:

1. Each view is cut into ``block x block`` tiles. The pixels of a tile are split like a
   checkerboard into set A ((row + col) even) and set B (odd).
2. Tiles are ranked by the mean of their A pixels; the darkest ``fraction`` of the tiles (over
   all views for the global value, within each view for the per-view values; at least
   ``min_tiles``) are taken as vacuum.
3. The background is the median, over those tiles, of the mean of their B pixels.

The selection (step 2) looks only at A pixels and the estimate (step 3) only at B pixels, so with
noise independent from pixel to pixel the choice of tiles cannot bias the value: selecting tiles
with low A means selects tiles of low *signal*, not tiles of negative B noise. Tile means are close
to Gaussian (many pixels each), so their median is an unbiased, outlier-robust centre.

Contrast: fasttomo reconstructs mass as bright (dark-field, HAADF-STEM, or bright-field counts
inverted by ``data.invert``). In raw bright-field counts the vacuum is the BRIGHTEST level, and the
darkest tiles are the thickest specimen: uneven where vacuum would be flat. :meth:`BackgroundEstimate.mass_dark`
compares the spread of the darkest tiles with that of the brightest ones, so a run can say so.

What it cannot know: a field of view with no vacuum at all (a specimen wider than the images) has
no pixel that reads the background; the estimate is then the level of the thinnest specimen
region. That is why the forward model can also learn the background (``intensity.background``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

FRACTION = 0.05
"""Share of the tiles taken as vacuum (the darkest by their A pixels)."""
MIN_TILES = 4
"""At least this many tiles enter each estimate."""
MASS_DARK_RATIO = 2.0
"""The darkest tiles spread this many times more than the brightest: the images look mass-dark.
Measured on simulated 128^2 series (bench_quality's specimens, 5 % Gaussian noise or Poisson
doses of 20 and 200): mass-dark versions 1.4-74, mass-bright ones 0.01-0.71; the low-dose
mass-dark cases (1.4, 1.8) go unflagged rather than risk flagging mass-bright data."""


@dataclasses.dataclass
class BackgroundEstimate:
    value: float
    """Vacuum level over the whole series, in the stack's units."""
    per_view: np.ndarray
    """(n_views,) vacuum level of each view (its own darkest tiles)."""
    spread: float
    """Robust standard deviation (1.4826 x MAD) of the B means of the chosen tiles: how uniform the
    chosen vacuum is (large values: the darkest tiles are not one flat level)."""
    block: int
    """Tile side in pixels."""
    n_tiles: int
    """Tiles that entered the global value."""
    bright_spread: float = 0.0
    """The same spread over as many of the brightest tiles."""

    def mass_dark(self) -> bool:
        """Whether the images look mass-dark (raw bright-field: the vacuum is the brightest, flat
        level): the darkest tiles spread :data:`MASS_DARK_RATIO` times more than the brightest."""
        return self.spread > 0 and self.spread >= MASS_DARK_RATIO * self.bright_spread

    def describe(self) -> dict:
        return {"value": self.value, "spread": self.spread, "bright_spread": self.bright_spread,
                "block_px": self.block, "n_tiles": self.n_tiles, "per_view": [float(v) for v in self.per_view]}


def warn_if_mass_dark(est: BackgroundEstimate, log, where: str) -> None:
    """Log a warning naming data.invert when ``est`` looks mass-dark (see the module docstring)."""
    if est.mass_dark():
        log.warning("%s: the images look mass-dark (bright-field contrast): the darkest tiles spread %.3g, the "
                    "brightest %.3g, as where the vacuum is the brightest, flat level. fasttomo reconstructs mass as "
                    "bright: for raw bright-field counts set data.invert=true (or turn it off if the data were "
                    "inverted already); data that are mass-bright (HAADF-STEM) can ignore this.",
                    where, est.spread, est.bright_spread)


def default_block(height: int, width: int) -> int:
    """Tile side: 1/16 of the smaller image side, at least 4 (so each half holds >= 8 pixels)."""
    return max(4, int(round(min(height, width) / 16)))


TILE_CHUNK_PIXELS = 1 << 22
"""_tile_means reads about this many pixels (whole views) at a time: its float64 work arrays stay
~32 MB each whatever the series' size, and the chunks run on several CPU threads."""


def _tile_means(stack: np.ndarray, valid: np.ndarray | None, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, ty, tx) means of the A and B pixels of each tile (NaN where a half has no valid pixel),
    computed a few views at a time on a few threads (each view's means are computed alone, so
    the chunking changes no value: tests/data/test_background.py)."""
    from concurrent.futures import ThreadPoolExecutor

    n, h, w = stack.shape
    ty, tx = h // block, w // block
    # centre the tiling (edge rows/columns that do not fill a tile are left out symmetrically)
    y0, x0 = (h - ty * block) // 2, (w - tx * block) // 2
    strided = valid is None and block % 2 == 0  # every half holds block^2 / 2 pixels: strided sums, no copies
    if not strided:
        i, j = np.meshgrid(np.arange(ty * block), np.arange(tx * block), indexing="ij")
        a_mask = ((i + j) % 2 == 0)[None]
    out_a, out_b = np.empty((n, ty, tx)), np.empty((n, ty, tx))

    def means(s: np.ndarray, ok: np.ndarray, mask: np.ndarray) -> np.ndarray:
        k = s.shape[0]
        m = (ok & mask).reshape(k, ty, block, tx, block)
        v = np.where(m, s.reshape(k, ty, block, tx, block), 0.0)
        count = m.sum(axis=(2, 4))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, v.sum(axis=(2, 4)) / np.maximum(count, 1), np.nan)

    def views(lo: int, hi: int) -> None:
        cut = (slice(lo, hi), slice(y0, y0 + ty * block), slice(x0, x0 + tx * block))
        if strided:
            out_a[lo:hi], out_b[lo:hi] = _checker_means(np.asarray(stack[cut]), ty, tx, block)
            return
        s = np.asarray(stack[cut], dtype=np.float64)
        ok = np.ones(s.shape, dtype=bool) if valid is None else np.asarray(valid[cut])
        out_a[lo:hi], out_b[lo:hi] = means(s, ok, a_mask), means(s, ok, ~a_mask)

    per = max(1, TILE_CHUNK_PIXELS // max(1, ty * block * tx * block))
    chunks = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
    if len(chunks) == 1:
        views(*chunks[0])
    else:
        import os

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1, len(chunks))) as pool:
            list(pool.map(lambda c: views(*c), chunks))
    return out_a, out_b


def _checker_means(c: np.ndarray, ty: int, tx: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_tile_means` of a crop ``c`` (k, ty * block, tx * block) with every pixel valid and
    ``block`` even: the A pixels of a tile are its (even, even) and (odd, odd) ones, each a strided
    view summed in float64 without a copy of the crop."""
    k, hb = c.shape[0], block // 2

    def part(r: int, q: int) -> np.ndarray:
        return c[:, r::2, q::2].reshape(k, ty, hb, tx, hb).sum(axis=(2, 4), dtype=np.float64)

    half = block * block / 2
    return (part(0, 0) + part(1, 1)) / half, (part(0, 1) + part(1, 0)) / half


def _darkest(a: np.ndarray, b: np.ndarray, fraction: float, min_tiles: int) -> np.ndarray:
    """B means of the tiles with the lowest A means (flattened inputs, NaN tiles skipped)."""
    keep = np.isfinite(a) & np.isfinite(b)
    a, b = a[keep], b[keep]
    if a.size == 0:
        return b
    k = min(a.size, max(min_tiles, int(math.ceil(fraction * a.size))))
    idx = np.argpartition(a, k - 1)[:k]
    return b[idx]


def estimate_background(stack: np.ndarray, valid: np.ndarray | None = None, block: int | None = None,
                        fraction: float = FRACTION, min_tiles: int = MIN_TILES) -> BackgroundEstimate:
    """Vacuum level of ``stack`` (n, H, W) (see the module docstring). ``valid`` (same shape,
    bool) excludes pixels; ``block`` defaults to :func:`default_block`."""
    stack = np.asarray(stack)
    if stack.ndim != 3:
        raise ValueError(f"estimate_background: stack must be (n, H, W), got shape {stack.shape}")
    n, h, w = stack.shape
    block = default_block(h, w) if block is None else int(block)
    block = max(2, min(block, h, w))
    a, b = _tile_means(stack, valid, block)
    chosen = _darkest(a.reshape(-1), b.reshape(-1), fraction, min_tiles)
    if chosen.size == 0:  # no valid tile at all: fall back to the median of the valid pixels
        values = stack if valid is None else stack[valid]
        value = float(np.median(values)) if values.size else 0.0
        return BackgroundEstimate(value, np.full(n, value), 0.0, block, 0)
    value = float(np.median(chosen))
    spread = float(1.4826 * np.median(np.abs(chosen - value)))
    bright = -_darkest(-a.reshape(-1), -b.reshape(-1), fraction, min_tiles)
    bright_spread = float(1.4826 * np.median(np.abs(bright - np.median(bright))))
    per_view = np.empty(n)
    for v in range(n):
        cv = _darkest(a[v].reshape(-1), b[v].reshape(-1), fraction, min_tiles)
        per_view[v] = float(np.median(cv)) if cv.size else value
    return BackgroundEstimate(value, per_view, spread, block, int(chosen.size), bright_spread)
