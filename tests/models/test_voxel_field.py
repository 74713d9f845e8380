import pytest
import torch

from fasttomo.config import ModelConfig
from fasttomo.geometry.rays import Box, voxel_grid
from fasttomo.kernels import reference
from fasttomo.models import VoxelField, build_field


def test_voxel_centres_return_the_grid_values_and_interpolation_is_trilinear():
    box = Box((3, 4, 5))
    f = VoxelField(box.shape_zyx, activation="softplus", density_shift=0.5)
    with torch.no_grad():
        f.grid.copy_(torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)))
    dens = f(voxel_grid(box))
    torch.testing.assert_close(dens, torch.nn.functional.softplus(f.grid.detach() + 0.5))
    # halfway between voxels (z=1,y=2,x=1) and (z=1,y=2,x=2): mean of the raw values
    g = voxel_grid(box)
    mid = 0.5 * (g[1, 2, 1] + g[1, 2, 2])
    raw = 0.5 * (f.grid[1, 2, 1] + f.grid[1, 2, 2])
    torch.testing.assert_close(f(mid[None])[0], torch.nn.functional.softplus(raw + 0.5))


def test_voxel_api_and_build_field():
    box = Box((4, 6, 8))
    f = build_field(ModelConfig(kind="voxel", activation="trunc_exp", density_shift=-1.0), box)
    assert isinstance(f, VoxelField) and tuple(f.grid.shape) == (4, 6, 8)
    assert f.param_groups() == {"grids": [f.grid]}
    f2 = build_field(ModelConfig(kind="voxel", voxel_shape=[2, 3, 4]), box)
    assert tuple(f2.grid.shape) == (2, 3, 4)
    with torch.no_grad():
        f.grid.copy_(torch.randn(4, 6, 8))
    tv = f.volume_tv("l1")
    torch.testing.assert_close(tv, reference.volume_tv(f.density(), "l1"))
    tv.backward()
    assert f.grid.grad.abs().sum() > 0
    pts = torch.rand(2, 9, 3) * 2 - 1
    assert f(pts).shape == (2, 9)
    with pytest.raises(ValueError):
        VoxelField((4, 6, 8), activation="relu")
