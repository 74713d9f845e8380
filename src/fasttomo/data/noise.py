"""A blind estimate of a tilt series' per-pixel signal-to-noise ratio (no truth, no model).

Noise: each pixel minus the mean of its four neighbours. For white noise of standard deviation s
that residual has variance 1.25 s^2, and smooth image content barely enters it, so
s = 1.4826 MAD(residual) / sqrt(1.25) (the MAD makes edges and hot pixels count little).
Signal: the image's own standard deviation with the noise's variance taken out,
sqrt(max(var - s^2, 0)). The ratio is taken per view and the median over views is reported.

Cost is bounded at any camera size: at most SNR_VIEWS views, evenly spread over the series, and
of each the central SNR_CROP x SNR_CROP pixels. Affine changes of the intensities (gain, offset,
inversion, normalization) leave the ratio unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SNR_VIEWS = 8
"""At most this many views (evenly spread over the series) enter the estimate."""
SNR_CROP = 1024
"""Of each view, at most this many central pixels a side."""
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


def _view_estimate(img: np.ndarray) -> tuple[float, float]:
    x = np.asarray(img, dtype=np.float64)
    r = x[1:-1, 1:-1] - 0.25 * (x[:-2, 1:-1] + x[2:, 1:-1] + x[1:-1, :-2] + x[1:-1, 2:])
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
    ch, cw = min(h, SNR_CROP), min(w, SNR_CROP)
    y0, x0 = (h - ch) // 2, (w - cw) // 2
    noise, signal = zip(*(_view_estimate(stack[v, y0:y0 + ch, x0:x0 + cw]) for v in views))
    ratio = [s / nz if nz > 0 else (math.inf if s > 0 else 0.0) for nz, s in zip(noise, signal)]
    return NoiseEstimate(float(np.median(ratio)), float(np.median(noise)), float(np.median(signal)), len(views))
