"""SIRT on a voxel grid, on exactly the geometry, conventions and units of the neural field.

Algorithm (Simultaneous Iterative Reconstruction Technique, the weighting of ASTRA's SIRT and of
Gregor & Benson 2008)::

    x <- x + lambda * C * B( R * (b - A x) )          then x <- max(x, 0) if positivity

* A = :func:`~fasttomo.methods.sirt.projectors.forward_project` (ray-driven line integrals,
  trilinear, ``step`` voxels between samples), B =
  :func:`~fasttomo.methods.sirt.projectors.back_project` (voxel-driven, bilinear). They are an
  unmatched pair (B is close to A^T, not equal), as in ASTRA's GPU SIRT and IMOD.
* R = w / (A 1) per ray: w the valid mask (1 valid, 0 invalid; invalid pixels contribute nothing),
  A 1 the chord length of the ray through the box in voxels; R = 0 where the ray misses the box.
* C = 1 / (B w) per voxel: B w is the (bilinearly weighted) number of valid views seeing the
  voxel; C = 0 where no valid ray sees it. So each update moves a voxel by lambda times the
  average, over the rays through it, of the ray's residual per unit chord length: a residual of
  r (line-integral units) on a ray of chord L asks for a density change of r / L everywhere along
  it, which is the right scale whatever the box size.
* lambda (``relaxation``) in (0, 2); 1 is the standard choice. Starting from zero (or ``init``),
  SIRT converges to a weighted least-squares solution; on limited-angle, noisy data the iteration
  count is the regularizer (stop early: ``callback`` lets a caller score each iteration).

Units and conventions
    ``stack`` (n_views, H, W) holds line integrals in voxel-length units (a normalized tilt series:
    the quantity of :func:`fasttomo.data.phantom.project`); the result (Z, Y, X) float32 is a
    density per voxel length on the voxel centres of ``box`` (voxel = pixel), the quantity of
    :meth:`fasttomo.methods.field.projector.Projector.volume` and of ``phantom.voxelize``. Views and poses are
    those of :class:`~fasttomo.geometry.poses.Poses` (IMOD handedness; in-plane rotations and
    shifts honoured, per-line angles not supported).

Cost per iteration: one forward projection, one backprojection and four elementwise passes. With
the fused kernels (CUDA fp32) the loop has no host synchronization: it only queues kernels unless
``callback`` synchronizes. The pure-torch twin syncs once per chunk of rays (its loop bounds).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import torch

from fasttomo.methods.sirt.projectors import view_poses
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box
from fasttomo.kernels import dispatch

__all__ = ["sirt", "sirt_weights"]

EPS = 1e-6
"""Chord lengths (voxels) and backprojected weights at or below this count as zero (R, C = 0)."""


@torch.no_grad()
def sirt_weights(rot: torch.Tensor, shift: torch.Tensor, box: Box, image_hw: tuple[int, int],
                 valid: torch.Tensor, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C): R = valid / (A 1) per ray (n_views, H, W), C = 1 / (B valid) per voxel (Z, Y, X),
    zero where the ray misses the box / no valid ray sees the voxel."""
    ones = torch.ones(box.shape_zyx, device=rot.device, dtype=rot.dtype)
    R = dispatch.ray_project(ones, rot, shift, image_hw, step)  # the chord lengths, then R in their place
    del ones
    miss = ~(R > EPS)
    torch.div(valid, R.clamp_min_(EPS), out=R).masked_fill_(miss, 0.0)
    del miss
    C = dispatch.voxel_backproject(valid, rot, shift, box.shape_zyx)  # B valid, then C in its place
    miss = ~(C > EPS)
    C.clamp_min_(EPS).reciprocal_().masked_fill_(miss, 0.0)
    return R, C


@torch.no_grad()
def sirt(stack, poses: Poses, box: Box, iterations: int, *, relaxation: float = 1.0,
         positivity: bool = True, valid=None, init: Optional[torch.Tensor] = None,
         callback: Optional[Callable[[int, torch.Tensor], None]] = None,
         step: float = 0.5) -> torch.Tensor:
    """SIRT reconstruction (Z, Y, X) of ``stack`` (n_views, H, W) (see the module docstring).

    stack: tensor (or numpy array) of line integrals; the reconstruction runs on its device.
    poses: one pose per image (``poses.n_views == n_views``). box: the reconstruction box.
    iterations: number of SIRT updates (0 returns the start volume).
    relaxation: lambda in (0, 2). positivity: clamp the volume at 0 after every update.
    valid: optional bool/0-1 mask (n_views, H, W); False pixels contribute nothing (their values
        may be anything, NaN included).
    init: optional start volume (Z, Y, X) (default zeros); it is copied, never modified.
    callback: ``callback(i, volume)`` after update i = 1..iterations, with the live volume (do not
        modify it; clone it to keep it). None costs nothing.
    step: sample spacing along the rays in voxels (forward projector).
    """
    b = torch.as_tensor(np.asarray(stack) if not isinstance(stack, torch.Tensor) else stack)
    if b.dim() != 3:
        raise ValueError(f"sirt: stack must be (n_views, H, W), got shape {tuple(b.shape)}")
    dtype = torch.float64 if b.dtype == torch.float64 else torch.float32
    b = b.to(dtype)
    dev = b.device
    n_views, h, w = b.shape
    if not isinstance(poses, Poses) or poses.n_views != n_views:
        raise ValueError(f"sirt: poses must be a Poses with one view per image ({n_views}), got "
                         f"{getattr(poses, 'n_views', type(poses).__name__)}")
    iterations = int(iterations)
    if iterations < 0:
        raise ValueError(f"sirt: iterations must be >= 0, got {iterations}")
    relaxation = float(relaxation)
    if not (0.0 < relaxation < 2.0):
        raise ValueError(f"sirt: relaxation must lie in (0, 2) (SIRT diverges outside), got {relaxation}")
    step = float(step)
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"sirt: step must be a positive number of voxels, got {step!r}")
    if valid is None:
        wmask = torch.ones_like(b)
    else:
        wmask = torch.as_tensor(np.asarray(valid) if not isinstance(valid, torch.Tensor) else valid)
        if tuple(wmask.shape) != tuple(b.shape):
            raise ValueError(f"sirt: valid mask shape {tuple(wmask.shape)} must equal the stack's {tuple(b.shape)}")
        wmask = (wmask.to(dev) != 0).to(dtype)
        b = torch.where(wmask > 0, b, torch.zeros((), device=dev, dtype=dtype))  # NaN-safe

    rot, shift = view_poses(poses, None, dev, dtype)
    R, C = sirt_weights(rot, shift, box, (h, w), wmask, step)
    del wmask
    if init is None:
        x = torch.zeros(box.shape_zyx, device=dev, dtype=dtype)
    else:
        if tuple(init.shape) != tuple(box.shape_zyx):
            raise ValueError(f"sirt: init shape {tuple(init.shape)} must equal the box's {box.shape_zyx}")
        x = init.detach().to(device=dev, dtype=dtype).clone()
    CR = C.mul_(relaxation)  # lambda folded into C once
    del C
    for i in range(1, iterations + 1):
        residual = dispatch.ray_project(x, rot, shift, (h, w), step)
        torch.sub(b, residual, out=residual)
        residual.mul_(R)
        x.addcmul_(CR, dispatch.voxel_backproject(residual, rot, shift, box.shape_zyx))
        if positivity:
            x.clamp_(min=0.0)
        if callback is not None:
            callback(i, x)
    return x
