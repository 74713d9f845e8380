"""Object models (density fields over the normalized box [-1, 1]^3) and their regularizers."""

from __future__ import annotations

import dataclasses

from torch import nn

from fasttomo.config import FieldConfig
from fasttomo.geometry.rays import Box
from fasttomo.models.kplanes import KPlanesTILTED
from fasttomo.models.voxel import VoxelField


AUTO_COARSEST = 32
"""model.resolutions=None: the coarsest automatic scale has at least this many texels."""
AUTO_SCALES = 3
"""model.resolutions=None: at most this many scales."""
AUTO_FULL_UP_TO = 256
"""model.resolutions=None: boxes up to this largest side get a finest scale of one texel per
voxel; larger boxes get half that (one texel per two voxels)."""


def auto_finest(n: int) -> tuple[int, str]:
    """(finest automatic plane resolution for a box of largest side ``n``, why). Up to
    AUTO_FULL_UP_TO: ``n`` (measured: the 64^2 and 128^3 defaults). Above: ``n // 2``; measured
    once, at 1024^2 x 61 views (thickness 256) on an H200, where [128, 256, 512] with 4000 steps
    gave FSC 0.5 at 21.9 A against 43.4 A for [256, 512, 1024] with 1500 steps. PROVISIONAL for
    other sizes above 256 (512, 2048, 4096) until measured on the GPU."""
    if n <= AUTO_FULL_UP_TO:
        return n, f"one texel per voxel of the box's largest side {n}"
    return n // 2, (f"one texel per 2 voxels of the box's largest side {n} (above {AUTO_FULL_UP_TO}; measured at "
                    "1024, provisional elsewhere)")


def auto_resolutions(box: Box) -> list[int]:
    """model.resolutions=None: F (:func:`auto_finest` of the box's largest side), F/2, ... while a
    scale keeps at least AUTO_COARSEST texels, at most AUTO_SCALES scales, coarsest first: [32, 64]
    for the embedded 64 x 64 x 32 phantom, [32, 64, 128] for a 128^3 box, [64, 128, 256] for
    256, [128, 256, 512] for a 1024-pixel camera."""
    scales = [auto_finest(max(box.shape_zyx))[0]]
    while len(scales) < AUTO_SCALES and scales[-1] // 2 >= AUTO_COARSEST:
        scales.append(scales[-1] // 2)
    return scales[::-1]


def build_field(model_cfg: FieldConfig, box: Box) -> nn.Module:
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


__all__ = ["auto_finest", "auto_resolutions", "build_field", "KPlanesTILTED", "VoxelField"]
