"""Data terms: how far the predicted measurements are from the measured pixels.

All take (B,) predictions, targets and weights (1 valid, 0 masked) in the sampler's normalized
units and return a scalar; none synchronizes with the host.

* ``mse``: weighted mean squared error (the Gaussian-noise likelihood).
* ``l1``: weighted mean absolute error.
* ``huber``: weighted mean Huber error with threshold ``delta`` (quadratic below, linear above:
  MSE's efficiency on Gaussian noise, L1's robustness to hot pixels and outliers).
* ``s3im`` (added to any of them with weight ``loss.s3im``): stochastic structural similarity
  (Xie et al., ICCV 2023). The batch's pixels are put in ``S3IM_REPEATS`` random orders, laid
  side by side as a pseudo-image of ``S3IM_PATCH_HEIGHT`` rows, and compared by SSIM over
  ``S3IM_KERNEL`` x ``S3IM_KERNEL`` windows with stride ``S3IM_STRIDE``; the term is 1 - SSIM. It
  compares groups of rays (their means, variances and covariance) rather than single rays. The
  random orders come from uniform numbers drawn outside the step (argsort), so a captured CUDA
  graph replays the eager run's stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

S3IM_REPEATS = 10
S3IM_KERNEL = 4
S3IM_STRIDE = 4
S3IM_PATCH_HEIGHT = 64
SSIM_C1 = 0.01 ** 2
SSIM_C2 = 0.03 ** 2
"""SSIM's stabilizers for a data range of 1 (the normalized targets' scale)."""


def pixel_errors(pred: torch.Tensor, target: torch.Tensor, kind: str, delta: float = 0.05) -> torch.Tensor:
    """(B,) per-pixel error of ``kind`` (mse: squared, l1: absolute, huber: Huber with ``delta``)."""
    err = pred - target
    if kind == "mse":
        return err.square()
    if kind == "l1":
        return err.abs()
    if kind == "huber":
        return F.huber_loss(pred, target, reduction="none", delta=delta)
    raise ValueError(f"pixel_errors: unknown kind {kind!r}")


def data_term(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, kind: str,
              delta: float = 0.05) -> torch.Tensor:
    """Weighted mean of :func:`pixel_errors` (masked pixels carry weight 0)."""
    return (pixel_errors(pred, target, kind, delta) * weight).sum() / weight.sum().clamp_min(1.0)


def s3im_noise_size(batch_size: int) -> int:
    """Uniform numbers one S3IM evaluation takes (one random order per repeat)."""
    return S3IM_REPEATS * batch_size


def s3im(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """1 - stochastic SSIM of (B,) ``pred`` vs ``target`` (masked pixels zeroed in both); ``noise``
    holds :func:`s3im_noise_size` uniform numbers that fix the random orders."""
    b = pred.shape[0]
    order = torch.argsort(noise.reshape(S3IM_REPEATS, b), dim=1).reshape(-1)
    p = (pred * weight)[order]
    t = (target * weight)[order]
    n = p.shape[0]
    rows = S3IM_PATCH_HEIGHT if n >= S3IM_PATCH_HEIGHT * S3IM_KERNEL else S3IM_KERNEL
    cols = n // rows
    p = p[: rows * cols].reshape(1, 1, rows, cols)
    t = t[: rows * cols].reshape(1, 1, rows, cols)
    pool = lambda x: F.avg_pool2d(x, S3IM_KERNEL, S3IM_STRIDE)  # noqa: E731
    mu_p, mu_t = pool(p), pool(t)
    var_p = pool(p * p) - mu_p * mu_p
    var_t = pool(t * t) - mu_t * mu_t
    cov = pool(p * t) - mu_p * mu_t
    ssim = ((2 * mu_p * mu_t + SSIM_C1) * (2 * cov + SSIM_C2)) / (
        (mu_p * mu_p + mu_t * mu_t + SSIM_C1) * (var_p + var_t + SSIM_C2))
    return 1.0 - ssim.mean()
