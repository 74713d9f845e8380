"""Voxel-grid projector pair of the conventional reconstructions (SIRT), on fasttomo's geometry.

Geometry and units are exactly those of the neural field (see :mod:`fasttomo.geometry.rays` and
:mod:`fasttomo.geometry.poses`):

* The volume is a (Z, Y, X) float32 array of density per voxel length on the voxel centres of a
  :class:`~fasttomo.geometry.rays.Box` of the same shape (voxel = pixel; voxel (k, i, j) at
  x = j - (X-1)/2, y = i - (Y-1)/2, z = k - (Z-1)/2). Between centres it is interpolated
  trilinearly with border clamping (the :class:`~fasttomo.models.voxel.VoxelField` convention:
  grid_sample, align_corners=False), so a constant volume is constant over the whole box.
* View n maps a point p to (u, v, w) = R_n p + (su_n, sv_n, 0) with R_n = Rz(z3) Ry(theta) Rz(z1)
  (IMOD: at zero in-plane angles and shifts, u = x cos(theta) + z sin(theta), v = y; (0, 0, +10)
  at +30 degrees lands at u = +5). Pixel (i, j) of an (H, W) image sits at u = j - (W-1)/2,
  v = i - (H-1)/2.

:func:`forward_project` (A) is ray-driven: the ray of each pixel is clipped to the box (the chord
of :func:`~fasttomo.geometry.rays.ray_samples`), cut into n = ceil(L / step) equal cells and the
volume is sampled at their midpoints; the result is in voxel-length units, the quantity of
:func:`fasttomo.data.phantom.project` and of a normalized measured stack (NOT divided by Z as the
:class:`~fasttomo.methods.field.projector.Projector`'s output is). :func:`back_project` (B) is voxel-driven:
each voxel centre is projected into each view and the image is sampled bilinearly (zero outside
the detector), summed over views. B is close to, but not exactly, the transpose of A (an
unmatched pair, like ASTRA's and IMOD's): <A x, y> and <x, B y> agree to about a percent on
smooth inputs.

Both go through the kernel door (``dispatch.ray_project`` / ``dispatch.voxel_backproject``): on
CUDA fp32 the Triton kernels, elsewhere (and under autograd) the pure-torch twins.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box
from fasttomo.kernels import dispatch

__all__ = ["forward_project", "back_project", "view_poses"]


def _check_box(shape: tuple[int, ...], box: Box, what: str) -> None:
    if tuple(shape) != tuple(box.shape_zyx):
        raise ValueError(f"{what}: the volume shape (Z, Y, X) = {tuple(shape)} must equal the box's "
                         f"{box.shape_zyx} (voxel = pixel); build the box as Box({tuple(shape)}).")


@torch.no_grad()
def view_poses(poses: Poses, views: Optional[torch.Tensor], device: torch.device,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotations (V, 3, 3) and detector shifts (V, 2) of ``views`` (default: all, in order), on
    ``device``, detached. Per-line (continuous-rotation) angles are not supported."""
    if not isinstance(poses, Poses):
        raise TypeError(f"expected fasttomo.geometry.poses.Poses, got {type(poses).__name__}")
    if poses.per_line:
        raise NotImplementedError(
            "the voxel projectors (forward_project, back_project, sirt) support one tilt angle per "
            "view; per-line angles (continuous-rotation data, angles of shape (N, H)) are not "
            "implemented: a view would need a different pose for every image row.")
    pdev = poses.theta.device
    if views is None:
        tilt = torch.arange(poses.n_views, device=pdev)
    else:
        tilt = torch.as_tensor(views, device=pdev)
        if tilt.dim() != 1 or tilt.dtype in (torch.bool, torch.float16, torch.bfloat16,
                                             torch.float32, torch.float64):
            raise ValueError(f"views must be a 1-D LongTensor of view indices, got {tuple(tilt.shape)} "
                             f"{tilt.dtype}")
        tilt = tilt.long()
        if tilt.numel() and (int(tilt.min()) < 0 or int(tilt.max()) >= poses.n_views):
            raise ValueError(f"views must lie in [0, {poses.n_views}), got min {int(tilt.min())}, "
                             f"max {int(tilt.max())}")
    rot, shift = poses(tilt)
    return (rot.detach().to(device=device, dtype=dtype).contiguous(),
            shift.detach().to(device=device, dtype=dtype).contiguous())


def _float_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def forward_project(volume: torch.Tensor, poses: Poses, box: Box, image_hw: tuple[int, int],
                    views: Optional[torch.Tensor] = None, step: float = 0.5) -> torch.Tensor:
    """Line integrals (n_views, H, W) of ``volume`` (Z, Y, X) along every pixel's ray, in
    voxel-length units (see the module docstring), on the volume's device.

    ``views``: LongTensor of view indices (default all); ``step``: sample spacing along the ray in
    voxels (each ray gets ceil(chord / step) equal cells, midpoint rule; rays missing the box: 0).
    """
    if volume.dim() != 3:
        raise ValueError(f"forward_project: volume must be (Z, Y, X), got shape {tuple(volume.shape)}")
    _check_box(volume.shape, box, "forward_project")
    h, w = (int(s) for s in image_hw)
    if h < 1 or w < 1:
        raise ValueError(f"forward_project: image_hw must be positive, got {image_hw!r}")
    step = float(step)
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"forward_project: step must be a positive number of voxels, got {step!r}")
    dtype = _float_dtype(volume)
    rot, shift = view_poses(poses, views, volume.device, dtype)
    return dispatch.ray_project(volume.to(dtype), rot, shift, (h, w), step)


def back_project(images: torch.Tensor, poses: Poses, box: Box, views: Optional[torch.Tensor] = None,
                 weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Voxel-driven backprojection (Z, Y, X) = box shape of ``images`` (n_views, H, W), summed
    over the views (see the module docstring), on the images' device.

    ``views``: the view index of every image (default: all views, in order); ``weights``
    (n_views, H, W), optional: per-pixel weights multiplied into the images first (0 = invalid
    pixel, which then contributes nothing whatever its value, NaN included).
    """
    if images.dim() != 3:
        raise ValueError(f"back_project: images must be (n_views, H, W), got shape {tuple(images.shape)}")
    dtype = _float_dtype(images)
    rot, shift = view_poses(poses, views, images.device, dtype)
    if rot.shape[0] != images.shape[0]:
        raise ValueError(f"back_project: {images.shape[0]} images for {rot.shape[0]} views; pass "
                         "views= with one index per image")
    img = images.to(dtype)
    if weights is not None:
        if tuple(weights.shape) != tuple(images.shape):
            raise ValueError(f"back_project: weights shape {tuple(weights.shape)} must equal the images' "
                             f"{tuple(images.shape)}")
        wt = weights.to(device=images.device, dtype=dtype)
        img = torch.where(wt != 0, img * wt, torch.zeros((), device=img.device, dtype=dtype))
    return dispatch.voxel_backproject(img, rot, shift, box.shape_zyx)
