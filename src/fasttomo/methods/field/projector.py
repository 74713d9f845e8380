"""The differentiable projector: poses -> rays -> sample points -> field -> line integrals.

One ``nn.Module`` owns the object model (the field) AND the per-tilt poses, so DDP synchronizes
both and a checkpoint or a device move carries both. Rays, rotations and the quadrature run in
fp32 with autocast disabled; only the field runs under the caller's autocast.

The intensity model (:class:`fasttomo.methods.field.intensity.Intensity`, optional) maps line integrals to
predicted measurements (gain x integral + background); without one the prediction is the integral.

The projector also owns what is fitted and how: its optimizer parameter groups
(:meth:`Projector.param_groups`: the field's grids, decoder and frame rotations, the pose
rotations and shifts, the intensity model) and its losses (:meth:`Projector.data_loss`, the data
term of ``loss.kind`` plus S3IM, and :meth:`Projector.regularization`, the plane and volume TV of
the field), so the Trainer only runs steps.

Units: the field's output is density in units of "target per slab thickness": the line integral
is divided by the box depth Z (voxels), so an O(1) field explains O(1) normalized projections
whatever the box size (a plain per-voxel sum would need densities ~1/Z and start training far
off). ``density()`` and ``volume()`` undo this and return density per voxel length.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fasttomo.methods.field import losses
from fasttomo.config import LossConfig
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box, line_integral, ray_segments, voxel_grid
from fasttomo.kernels import dispatch
from fasttomo.methods.field.intensity import Intensity
from fasttomo.models.regularizers import PLANE_TV, SUBGRID_NOISE, needs_noise, regularization, subgrid_points


class Projector(nn.Module):
    def __init__(self, field: nn.Module, poses: Poses, box: Box, image_hw: tuple[int, int],
                 samples_per_ray: int, intensity: Intensity | None = None, loss: LossConfig | None = None):
        super().__init__()
        self.field = field
        self.poses = poses
        self.intensity = intensity
        self.box = box
        self.image_hw = (int(image_hw[0]), int(image_hw[1]))
        self.samples_per_ray = int(samples_per_ray)
        self.length_unit = float(box.shape_zyx[0])
        self.loss = loss if loss is not None else LossConfig(plane_tv=PLANE_TV)
        """The data term and regularizer weights (the ``loss`` group)."""

    # ------------------------------------------------------------------ what is fitted
    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by optimizer group, in a fixed order: the field's (grids,
        decoder, rotations), pose_rotations (z1, z3, the tilt-axis rotation), pose_shifts, intensity. Groups without a
        trainable parameter are left out."""
        groups = dict(self.field.param_groups())
        groups["pose_rotations"] = [self.poses.z1, self.poses.z3, self.poses.axis]
        groups["pose_shifts"] = [self.poses.shifts]
        groups["intensity"] = [] if self.intensity is None else list(self.intensity.parameters())
        out = {name: [p for p in params if p.requires_grad] for name, params in groups.items()}
        return {name: params for name, params in out.items() if params}

    # ------------------------------------------------------------------ losses
    def noise_sizes(self, batch_size: int) -> tuple[int, int]:
        """Uniform numbers one step's losses take, drawn outside the step (a CUDA graph replays
        the eager stream): (the volume TV sub-grid's, S3IM's random orders)."""
        sub = SUBGRID_NOISE if needs_noise(self.field, self.loss) else 0
        return sub, (losses.s3im_noise_size(batch_size) if self.loss.s3im > 0 else 0)

    def pixel_errors(self, pred: torch.Tensor, batch) -> torch.Tensor:
        """Per-pixel data term (loss.kind) times the pixel weight (0 = masked)."""
        return losses.pixel_errors(pred, batch.target, self.loss.kind, self.loss.huber_delta) * batch.weight

    def data_loss(self, pred: torch.Tensor, batch, s3im_noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The data term and, with ``s3im_noise`` (loss.s3im > 0), the weighted S3IM term."""
        lc = self.loss
        parts = {"data": losses.data_term(pred, batch.target, batch.weight, lc.kind, lc.huber_delta)}
        if s3im_noise is not None:
            parts["s3im"] = lc.s3im * losses.s3im(pred, batch.target, batch.weight, s3im_noise)
        return parts

    def plane_tv_in_forward(self) -> bool:
        """Whether a training step asks :meth:`forward` for the plane TV (a K-Planes field with a
        positive loss.plane_tv): the features' and the TV's backward then run as one pass."""
        return bool(self.loss.plane_tv) and self.loss.plane_tv > 0 and hasattr(self.field, "plane_tv")

    def tv_points(self, generator: torch.Generator | None = None, noise: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
        """The volume TV's random sub-grid (n, n, n, 3) for this step, or None when the field has
        no such term; evaluate it with the rays (``forward(..., extra_points=)``) and pass the
        density to :meth:`regularization`."""
        return subgrid_points(self.field, self.loss, generator, noise)

    def regularization(self, generator: torch.Generator | None = None, noise: torch.Tensor | None = None,
                       tv_density: torch.Tensor | None = None, plane_tv_scale: torch.Tensor | None = None,
                       plane_tv: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The field's weighted regularizers (plane TV, volume TV) and their total; ``tv_density``:
        the field on :meth:`tv_points` (else the sub-grid is drawn and evaluated here);
        ``plane_tv_scale``: the plane TV schedule's factor of the step (0-dim tensor);
        ``plane_tv``: the planes' TV from :meth:`forward` (else computed here)."""
        return regularization(self.field, self.loss, generator, noise, tv_density, plane_tv_scale, plane_tv)

    def forward(self, tilt: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
                extra_points: torch.Tensor | None = None, plane_tv: bool = False):
        """Predicted measurements (B,) fp32 for pixels (tilt, row, col): the line integrals,
        through the intensity model when there is one. With ``extra_points`` (..., 3) normalized
        xyz the field is evaluated there in the same call (one field evaluation per step for the
        rays and the volume TV's sub-grid), and with ``plane_tv`` a K-Planes field's plane TV comes
        from the same call (its backward in one pass with the features'); either returns
        ``(predicted, density at extra_points or None, plane TV or None)``."""
        device_type = tilt.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            rot, shift = self.poses(tilt, row)
            segments = ray_segments(row, col, rot, shift, self.image_hw, self.box, self.samples_per_ray)
            samples = dispatch.ray_samples(segments, self.box, self.samples_per_ray)
        b, s = samples.points.shape[:2]
        points = samples.points.reshape(b * s, 3)
        if extra_points is not None:
            points = torch.cat((points, extra_points.reshape(-1, 3).to(points.dtype)))
        tv = None
        if plane_tv and hasattr(self.field, "plane_tv"):
            out, tv = self.field(points, plane_tv=True)
        else:
            out = self.field(points)
        density = out[:b * s].reshape(b, s)
        with torch.autocast(device_type=device_type, enabled=False):
            integral = line_integral(density.float(), samples) / self.length_unit
            pred = integral if self.intensity is None else self.intensity(integral, tilt)
        if extra_points is None and not plane_tv:
            return pred
        return pred, (None if extra_points is None else out[b * s:].reshape(extra_points.shape[:-1])), tv

    def density(self, points: torch.Tensor) -> torch.Tensor:
        """Density per voxel length (target units) at normalized points (N, 3), fp32."""
        return self.field(points).float() / self.length_unit

    @torch.no_grad()
    def volume(self, shape_zyx: tuple[int, int, int] | None = None, chunk: int | None = None,
               z_range: tuple[int, int] | None = None) -> torch.Tensor:
        """Density at voxel centres of the box (or of ``shape_zyx`` resampling it), fp32 (Z, Y, X),
        evaluated ``chunk`` points at a time (default :func:`volume_chunk` of the device: the
        values do not depend on it). ``z_range`` selects a slab of Z planes (the export's slabs,
        and its shards across ranks); only that slab's grid is built. The volume is
        given in the frame where the reference view's shift is zero (``Poses.gauge_translation``)."""
        param = next(self.field.parameters())
        chunk = chunk or volume_chunk(param.device)
        grid = voxel_grid(self.box, shape_zyx, device=param.device, z_range=z_range)  # (Z, Y, X, 3) normalized xyz
        pts = grid.reshape(-1, 3)
        if self.poses.free_reference_shift:
            t = self.poses.gauge_translation().to(pts.device)
            pts = self.box.normalize(self.box.denormalize(pts) - t)
        out = torch.empty(pts.shape[0], device=param.device, dtype=torch.float32)
        for i in range(0, pts.shape[0], chunk):
            out[i:i + chunk] = self.density(pts[i:i + chunk])
        return out.reshape(grid.shape[:3])


VOLUME_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 21}
"""Points per field evaluation of :meth:`Projector.volume`, by device type. On a GPU a small
chunk is bound by the launches of its dozen kernels: a 2048^2 x 64 slab of camera2k's field took
702 ms at 2^18 points, 189 ms at 2^21 and 184 ms at 2^22, the same values bit for bit (H200,
benchmarks/README.md, "Evaluating the volume"); a CPU keeps 2^18 (its chunk's temporaries stay in the cache-friendly range)."""


def volume_chunk(device: torch.device) -> int:
    """:data:`VOLUME_CHUNK` of ``device``'s type (the CPU's for any other type)."""
    return VOLUME_CHUNK.get(torch.device(device).type, VOLUME_CHUNK["cpu"])


@torch.no_grad()
def predict_views(field_projector, angles: np.ndarray, chunk: int = 1 << 15, initial: dict | None = None
                  ) -> np.ndarray:
    """The images (n, H, W) that ``field_projector``'s field predicts at tilt ``angles`` (per-view
    poses ``initial``, e.g. a file alignment, or none; the learned tilt-axis rotation, common to
    every view, applied; no intensity model): line integrals in the projector's normalized units."""
    from fasttomo.quality.scoring import render_views

    src = field_projector
    device = next(src.field.parameters()).device
    poses = Poses(angles, int(np.argmin(np.abs(angles if angles.ndim == 1 else angles.mean(axis=1)))),
                  initial=initial).to(device)
    poses.axis.copy_(src.poses.axis.detach())   # a tilt-axis error turns the views set aside too
    proj = Projector(src.field, poses, src.box, src.image_hw, src.samples_per_ray)
    return render_views(proj, len(angles), chunk)
