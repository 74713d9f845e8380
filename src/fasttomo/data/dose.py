"""The detector of the synthetic tilt series: electron dose (Poisson shot noise), gain, offset,
Gaussian read noise and the contrast inversion (``data.dose``, ``data.gain``, ``data.offset``,
``data.absorption``, ``data.noise``, ``data.invert``).

Dose model (linear, mass-thickness bright field; no phase contrast). Each pixel of each view
receives ``dose`` electrons on average; a ray through projected mass P (the exact line integral
of the specimen, voxel-length units) lets through the fraction 1 - mu P, the linearized form of
the transmitted fraction exp(-mu P), with mu = absorption / max P: the most absorbing ray of the
series removes ``absorption`` of the beam. The detector counts the electrons it receives with a
gain and an offset:

    image = offset + gain * Poisson(dose * (1 - mu P))      (electrons drawn per pixel, per view)

so on vacuum (P = 0) the mean is offset + gain * dose and the variance gain^2 * dose. The model is
linear in P on purpose: the reconstruction's intensity model is measured = scale x line integral
+ background, which this image obeys exactly in the mean (scale = -gain dose mu, background =
offset + gain dose); with exp(-mu P) it would hold only to first order in mu P.

Mass is dark in this image. ``data.invert`` (None: true when a dose is set) turns it into x ->
max - x, as ``data.invert`` does for file data, so the mass is bright and the scale positive, as
the reconstruction expects; ``data.invert=false`` keeps the raw counts.

Gaussian noise (``data.noise``) is added after the counts, as read noise: its standard deviation
is ``noise`` times the std or the maximum (``data.noise_relative_to``) of the clean image (the
mean image offset + gain dose (1 - mu P) with a dose, the line integrals without one).

Seeds: the counts draw from ``SeedSequence(phantom_seed, spawn_key=(4,))``, the Gaussian noise
from ``numpy.random.default_rng(phantom_seed)``, so switching either on or off leaves the other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fasttomo.data.specimen import PhantomError, _stream

_DOSE_STREAM = 4


def expected_counts(projections: np.ndarray, dose: float, absorption: float) -> np.ndarray:
    """Mean electrons per pixel, dose (1 - mu P) with mu = absorption / max P (float64)."""
    p = np.asarray(projections, dtype=np.float64)
    top = float(p.max())
    mu = absorption / top if top > 0 else 0.0
    return np.clip(dose * (1.0 - mu * p), 0.0, None)


def detect(projections: np.ndarray, cfg: Any, seed: int) -> tuple[np.ndarray, dict]:
    """The recorded stack (float32) of clean line integrals ``projections`` under the detector of
    ``cfg`` (a PhantomDataConfig), and its metadata (see the module docstring)."""
    dose = getattr(cfg, "dose", None)
    meta: dict = {"dose_e_per_px": dose}
    if dose is not None:
        gain, offset = float(cfg.gain), float(cfg.offset)
        lam = expected_counts(projections, float(dose), float(cfg.absorption))
        counts = _stream(seed, _DOSE_STREAM).poisson(lam)
        clean = offset + gain * lam
        stack = (offset + gain * counts).astype(np.float32)
        meta.update(gain=gain, offset=offset, absorption=float(cfg.absorption),
                    model="offset + gain * Poisson(dose * (1 - absorption * P / max P))")
    else:
        clean = stack = projections
    relative_to = getattr(cfg, "noise_relative_to", "std")
    if relative_to == "std":
        noise_std = float(cfg.noise) * float(np.std(clean))
    elif relative_to == "max":
        noise_std = float(cfg.noise) * float(np.max(clean))
    else:
        raise PhantomError(f"data.noise_relative_to: must be std or max, got {relative_to!r}.")
    if noise_std > 0:
        stack = stack.copy() if stack is projections else stack
        add_noise(stack, noise_std, seed)
    invert = getattr(cfg, "invert", None)
    invert = (dose is not None) if invert is None else bool(invert)
    if invert:
        top = float(stack.max())
        stack = (top - stack).astype(np.float32)
        meta["inverted_about"] = top
    meta.update(noise_std=noise_std, inverted=invert)
    return stack, meta


PROJECT_CHUNK_PIXELS = 1 << 24
"""project_views computes about this many pixels (views x H x W) at a time (its float64 work
arrays: ~128 MB each), so a camera-sized series never needs (N, H, W) float64 arrays whole."""


def add_noise(stack: np.ndarray, std: float, seed: int, chunk_pixels: int | None = None) -> None:
    """Add Gaussian noise of ``std`` from numpy's default_rng(``seed``) to the float32 ``stack`` in
    place, a few views at a time: the generator's stream does not depend on how the draws are
    split, so the result equals ``(stack + rng.normal(0, std, stack.shape)).astype(float32)``."""
    rng = np.random.default_rng(seed)
    per = max(1, int(chunk_pixels or PROJECT_CHUNK_PIXELS) // max(1, stack.shape[1] * stack.shape[2]))
    for lo in range(0, stack.shape[0], per):
        part = stack[lo:lo + per]
        part[...] = (part + rng.normal(0.0, std, size=part.shape)).astype(np.float32)
