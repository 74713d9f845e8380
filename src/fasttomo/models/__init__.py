"""Object models (density fields over the normalized box [-1, 1]^3) and their regularizers."""

from __future__ import annotations

import dataclasses

from torch import nn

from fasttomo.config import ModelConfig
from fasttomo.geometry.rays import Box
from fasttomo.models.kplanes import KPlanesTILTED
from fasttomo.models.voxel import VoxelField


def auto_resolutions(box: Box) -> list[int]:
    """model.resolutions=None: [N/4, N/2, N], N the largest side of the box."""
    n = max(box.shape_zyx)
    return [max(2, n // 4), max(2, n // 2), n]


def build_field(model_cfg: ModelConfig, box: Box) -> nn.Module:
    """The field of ``model_cfg.kind``: KPlanesTILTED (resolutions None: :func:`auto_resolutions`),
    or a VoxelField of ``model_cfg.voxel_shape`` (default: the box's own shape). Random init uses
    torch's global RNG (seed it first)."""
    if model_cfg.kind == "kplanes_tilted":
        if model_cfg.resolutions is None:
            model_cfg = dataclasses.replace(model_cfg, resolutions=auto_resolutions(box))
        return KPlanesTILTED(model_cfg)
    if model_cfg.kind == "voxel":
        shape = tuple(model_cfg.voxel_shape) if model_cfg.voxel_shape is not None else box.shape_zyx
        return VoxelField(shape, activation=model_cfg.activation, density_shift=model_cfg.density_shift)
    raise ValueError(f"build_field: unknown model.kind {model_cfg.kind!r}")


__all__ = ["auto_resolutions", "build_field", "KPlanesTILTED", "VoxelField"]
