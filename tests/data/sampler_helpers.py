"""Helpers for the sampler tests (imported as sampler_helpers): a random tilt series in memory."""

from __future__ import annotations

import numpy as np

from fasttomo.data.tiltseries import TiltSeries


def random_series(n: int, h: int, w: int, seed: int = 0, valid: bool = False) -> TiltSeries:
    """n views of h x w normal(2, 1) pixels over -30..30 degrees; with ``valid``, about 80 % of
    the pixels marked valid at random."""
    rng = np.random.default_rng(seed)
    ts = TiltSeries(stack=rng.normal(2.0, 1.0, (n, h, w)).astype(np.float32), angles=np.linspace(-30, 30, n))
    ts.valid = rng.random((n, h, w)) > 0.2 if valid else None
    return ts
