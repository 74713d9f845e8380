"""Volume quality metrics."""

from __future__ import annotations

import numpy as np


def pearson(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Pearson correlation of two arrays (optionally over ``mask`` only), in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"pearson: shapes differ, {a.shape} vs {b.shape}")
    if mask is not None:
        a, b = a[mask], b[mask]
    a = a.ravel() - a.mean()
    b = b.ravel() - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")


def foreground_mask(truth: np.ndarray, rel_threshold: float = 0.05) -> np.ndarray:
    """Voxels where the ground truth exceeds ``rel_threshold`` of its maximum (the specimen)."""
    return truth > rel_threshold * float(np.max(truth))


def volume_metrics(recon: np.ndarray, truth: np.ndarray) -> dict:
    """Global and foreground Pearson correlation against a known ground truth."""
    fg = foreground_mask(truth)
    return {
        "pearson_global": pearson(recon, truth),
        "pearson_foreground": pearson(recon, truth, fg),
        "foreground_fraction": float(fg.mean()),
    }
