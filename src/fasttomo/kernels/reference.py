"""Pure-torch twins of every fused op: the CPU path, the create_graph path and the test oracle.

Each function here is differentiable by autograd (any order) and defines the exact semantics the
fast paths in ``kernels/triton`` must reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fasttomo.kernels.layout import PLANE_AXES, PlaneLayout


def _full(t: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32; fp32 and fp64 (gradcheck) unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def tilted_kplanes(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor,
                   layout: PlaneLayout) -> torch.Tensor:
    """Multi-scale TILTED K-Planes features.

    points: (N, 3) coordinates (x, y, z) in [-1, 1]^3 (any values are accepted: the planes are
        sampled with border clamping, i.e. grid_sample padding_mode='border').
    matrices: (T, 3, 3) linear maps; frame t samples the planes at q = matrices[t] @ p.
    plane_data: flat buffer laid out by ``layout``.
    Returns (N, L*T*C) features, index l*T*C + t*C + c, each the Hadamard product over the three
    plane kinds of bilinear samples (align_corners=True: -1 is the first texel centre, +1 the last).
    """
    n = points.shape[0]
    T, C = layout.n_rot, layout.channels
    # sample coordinates stay fp32 under autocast (bf16 would round them to ~a texel at res 512)
    with torch.autocast(device_type=points.device.type, enabled=False):
        q = torch.einsum("tij,nj->tni", _full(matrices), _full(points))  # (T, N, 3)
    feats = []
    for l in range(layout.n_scales):
        prod = None
        for k, (a, b) in enumerate(PLANE_AXES):
            planes = layout.view(plane_data, l, k).permute(0, 3, 1, 2)  # (T, C, H, W), channels-last
            grid = torch.stack((q[..., a], q[..., b]), dim=-1).unsqueeze(2)  # (T, N, 1, 2)
            s = F.grid_sample(planes, grid, mode="bilinear", padding_mode="border", align_corners=True)
            s = s[..., 0]  # (T, C, N)
            prod = s if prod is None else prod * s
        feats.append(prod.permute(2, 0, 1).reshape(n, T * C))
    return torch.cat(feats, dim=1)


def plane_tv(plane_data: torch.Tensor, layout: PlaneLayout) -> torch.Tensor:
    """Plane total variation: mean over every plane of squared neighbour differences along H and W,
    summed over planes (each plane's mean taken separately, then averaged over the 3*L*T planes)."""
    total = plane_data.new_zeros(())
    count = 0
    for l in range(layout.n_scales):
        for k in range(3):
            v = layout.view(plane_data, l, k)  # (T, H, W, C)
            dh = (v[:, 1:] - v[:, :-1]).square().mean(dim=(1, 2, 3))
            dw = (v[:, :, 1:] - v[:, :, :-1]).square().mean(dim=(1, 2, 3))
            total = total + (dh + dw).sum()
            count += layout.n_rot
    return total / count


def volume_tv(volume: torch.Tensor, kind: str = "squared") -> torch.Tensor:
    """Anisotropic total variation of a (D, H, W) or (..., D, H, W) volume, averaged per axis.

    kind='squared': mean squared forward differences summed over the 3 axes;
    kind='l1': mean absolute forward differences summed over the 3 axes.
    """
    diffs = (volume.diff(dim=-3), volume.diff(dim=-2), volume.diff(dim=-1))
    if kind == "squared":
        return sum(d.square().mean() for d in diffs)
    if kind == "l1":
        return sum(d.abs().mean() for d in diffs)
    raise ValueError(f"volume_tv: kind must be 'squared' or 'l1', got {kind!r}")
