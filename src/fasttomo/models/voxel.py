"""VoxelField: a plain learnable (Z, Y, X) grid, the baseline object model.

The grid holds raw values at voxel centres of the reconstruction box; a normalized point (x, y, z)
is sampled trilinearly with grid_sample's align_corners=False convention (voxel k of n at
(2k + 1)/n - 1, the :class:`~fasttomo.geometry.rays.Box` normalization) and border clamping, then
passed through the density activation. Sampling exactly at voxel centres returns the activated
grid values.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from fasttomo.kernels import dispatch
from fasttomo.models.decoder import density_activation


class VoxelField(nn.Module):
    def __init__(self, shape_zyx: tuple[int, int, int], activation: str = "softplus",
                 density_shift: float = 0.0, init: float = 0.0) -> None:
        """``init``: starting raw value of every voxel (density = activation(init + shift))."""
        super().__init__()
        shape = tuple(int(s) for s in shape_zyx)
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(f"VoxelField: shape_zyx must be 3 positive ints, got {shape_zyx!r}")
        density_activation(torch.zeros(1), activation, 0.0)  # validates the kind
        self.activation = activation
        self.density_shift = float(density_shift)
        self.grid = nn.Parameter(torch.full(shape, float(init)))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        """Density at normalized points (..., 3) -> (...)."""
        lead = points.shape[:-1]
        g = points.reshape(1, -1, 1, 1, 3).to(self.grid.dtype)
        raw = F.grid_sample(self.grid[None, None], g, mode="bilinear", padding_mode="border",
                            align_corners=False)
        return density_activation(raw.reshape(lead), self.activation, self.density_shift)

    def density(self) -> torch.Tensor:
        """(Z, Y, X) density at the voxel centres."""
        return density_activation(self.grid, self.activation, self.density_shift)

    def volume_tv(self, kind: str = "squared") -> torch.Tensor:
        return dispatch.volume_tv(self.density(), kind)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        return {"grids": [self.grid]}
