"""Data terms: Huber, S3IM (values, masking, determinism, gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fasttomo.methods.field import losses


def test_pixel_errors_match_their_definitions():
    pred = torch.tensor([0.0, 0.1, 1.0, -2.0])
    target = torch.zeros(4)
    assert torch.equal(losses.pixel_errors(pred, target, "mse"), pred.square())
    assert torch.equal(losses.pixel_errors(pred, target, "l1"), pred.abs())
    hub = losses.pixel_errors(pred, target, "huber", delta=0.5)
    # quadratic below delta, linear above: 0.5 x^2 and delta (|x| - delta / 2)
    assert torch.allclose(hub, torch.tensor([0.0, 0.005, 0.5 * (1.0 - 0.25), 0.5 * (2.0 - 0.25)]))
    with pytest.raises(ValueError, match="unknown kind"):
        losses.pixel_errors(pred, target, "poisson")


def test_data_term_ignores_masked_pixels():
    pred = torch.tensor([1.0, 1.0, 100.0])
    target = torch.zeros(3)
    weight = torch.tensor([1.0, 1.0, 0.0])
    assert losses.data_term(pred, target, weight, "mse").item() == pytest.approx(1.0)


def _batch(b=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.rand(b, generator=g)
    noise = torch.rand(losses.s3im_noise_size(b), generator=g)
    return target, noise


def test_s3im_is_zero_for_a_perfect_prediction_and_grows_with_noise():
    target, noise = _batch()
    w = torch.ones_like(target)
    assert losses.s3im(target, target, w, noise).item() == pytest.approx(0.0, abs=1e-6)
    g = torch.Generator().manual_seed(3)
    small = losses.s3im(target + 0.05 * torch.randn(target.shape, generator=g), target, w, noise).item()
    large = losses.s3im(target + 0.3 * torch.randn(target.shape, generator=g), target, w, noise).item()
    assert 0 < small < large


def test_s3im_matches_a_direct_ssim_of_the_pseudo_image():
    target, noise = _batch(b=512)
    pred = target.flip(0)
    w = torch.ones_like(target)
    order = torch.argsort(noise.reshape(losses.S3IM_REPEATS, -1), dim=1).reshape(-1)
    p, t = pred[order].reshape(64, -1)[None, None], target[order].reshape(64, -1)[None, None]
    k = losses.S3IM_KERNEL
    mp, mt = F.avg_pool2d(p, k), F.avg_pool2d(t, k)
    vp, vt = F.avg_pool2d(p * p, k) - mp ** 2, F.avg_pool2d(t * t, k) - mt ** 2
    cov = F.avg_pool2d(p * t, k) - mp * mt
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    ssim = ((2 * mp * mt + c1) * (2 * cov + c2)) / ((mp ** 2 + mt ** 2 + c1) * (vp + vt + c2))
    assert losses.s3im(pred, target, w, noise).item() == pytest.approx(1 - ssim.mean().item(), rel=1e-5)


def test_s3im_is_a_function_of_its_noise_and_has_gradients():
    target, noise = _batch()
    pred = (target + 0.1).requires_grad_(True)
    w = torch.ones_like(target)
    a = losses.s3im(pred, target, w, noise)
    b = losses.s3im(pred, target, w, noise.clone())
    c = losses.s3im(pred, target, w, torch.rand(noise.shape, generator=torch.Generator().manual_seed(9)))
    assert a.item() == b.item() and a.item() != c.item()
    a.backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all() and pred.grad.abs().sum() > 0
