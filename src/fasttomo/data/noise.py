"""A blind estimate of a tilt series' per-pixel signal-to-noise ratio (no truth, no model).

Noise: each pixel minus the mean of its four neighbours. For white noise of standard deviation s
that residual has variance 1.25 s^2, and smooth image content barely enters it, so
s = 1.4826 MAD(residual) / sqrt(1.25) (the MAD makes edges and hot pixels count little).
Signal: the image's own standard deviation with the noise's variance taken out,
sqrt(max(var - s^2, 0)). The ratio is taken per view and the median over views is reported.

Cost is bounded at any camera size: at most SNR_VIEWS views, evenly spread over the series, and
of each at most SNR_CROP pixels a side: the whole image where it is that small, else SNR_TILES
tiles of SNR_TILE pixels a side along each longer axis, evenly spread from edge to edge (each
tile's residuals taken inside it, the signal's variance over all of them), so the estimate sees
the whole field of view at any size instead of its centre alone (one central 1024^2 crop of a
4096^2 view of large objects saw little of their contrast). Affine changes of the intensities
(gain, offset, inversion, normalization) leave the ratio unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fasttomo.data.views import map_views

SNR_VIEWS = 8
"""At most this many views (evenly spread over the series) enter the estimate."""
SNR_CROP = 1024
"""Of each view, at most this many pixels a side (SNR_TILES x SNR_TILE)."""
SNR_TILE = 256
SNR_TILES = SNR_CROP // SNR_TILE
"""Along an axis longer than SNR_CROP: this many tiles of SNR_TILE pixels, evenly spread."""
_MAD_TO_STD = 1.4826
"""Standard deviation of a normal distribution over its median absolute deviation."""


@dataclasses.dataclass(frozen=True)
class NoiseEstimate:
    snr: float
    """Median over the views of signal / noise standard deviation (inf for noise-free images)."""
    noise_std: float
    signal_std: float
    views: int

    def describe(self) -> str:
        shown = "> 1000" if not math.isfinite(self.snr) or self.snr > 1000 else f"{self.snr:.2f}"
        return f"estimated signal-to-noise {shown} per pixel (median of {self.views} views)"


def _segments(n: int) -> list[slice]:
    """The stretches of an axis of ``n`` pixels that enter the estimate: all of it up to
    SNR_CROP, else SNR_TILES stretches of SNR_TILE evenly spread from one edge to the other."""
    if n <= SNR_CROP:
        return [slice(0, n)]
    starts = np.linspace(0, n - SNR_TILE, SNR_TILES).round().astype(int)
    return [slice(int(a), int(a) + SNR_TILE) for a in starts]


def _view_estimate(img: np.ndarray) -> tuple[float, float]:
    residuals, pixels = [], []
    for ys in _segments(img.shape[0]):
        for xs in _segments(img.shape[1]):
            x = np.asarray(img[ys, xs], dtype=np.float64)
            residuals.append((x[1:-1, 1:-1] - 0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:])).ravel())
            pixels.append(x.ravel())
    r, x = np.concatenate(residuals), np.concatenate(pixels)
    noise = _MAD_TO_STD * float(np.median(np.abs(r - np.median(r)))) / math.sqrt(1.25)
    signal = math.sqrt(max(float(x.var()) - noise * noise, 0.0))
    return noise, signal


def estimate_snr(stack: np.ndarray) -> NoiseEstimate:
    """The :class:`NoiseEstimate` of an (n_views, H, W) stack (see the module docstring); images
    smaller than 3 x 3 pixels have no estimate and raise ValueError."""
    n, h, w = stack.shape
    if h < 3 or w < 3 or n < 1:
        raise ValueError(f"estimate_snr: images of {h} x {w} pixels are too small to estimate their noise (>= 3 x 3)")
    views = np.unique(np.linspace(0, n - 1, min(n, SNR_VIEWS)).round().astype(int))
    noise, signal = zip(*map_views(lambda j: _view_estimate(stack[views[j]]), len(views), stack.size))
    ratio = [s / nz if nz > 0 else (math.inf if s > 0 else 0.0) for nz, s in zip(noise, signal)]
    return NoiseEstimate(float(np.median(ratio)), float(np.median(noise)), float(np.median(signal)), len(views))
