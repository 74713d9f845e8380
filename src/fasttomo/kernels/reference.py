"""Pure-torch twins of every fused op: the CPU path, the create_graph path and the test oracle.

Each function here is differentiable by autograd (any order) and defines the exact semantics the
fast paths in ``kernels/triton`` must reproduce.
"""

from __future__ import annotations

import math

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
        sampled with border clamping, i.e. grid_sample padding_mode='border'; a NaN coordinate
        samples the first texel and +-inf the border, as grid_sample's forward does, with a zero
        coordinate gradient: grid_sample's own backward crashes on them).
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
        q = torch.nan_to_num(q, nan=-1.0, posinf=1.0, neginf=-1.0)
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


def bf16_planes(plane_data: torch.Tensor) -> torch.Tensor:
    """The planes as ``precision.planes=bf16`` samples them: the values of their bf16 copy, the
    gradient passed through to ``plane_data`` unchanged (what the fused kernels do when they read a
    bf16 copy and write fp32 plane gradients)."""
    p = plane_data.detach()
    return plane_data + (p.to(torch.bfloat16).to(p.dtype) - p)


def decoder_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                w3: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    """The hybrid decoder, Linear-ReLU-Linear-ReLU-Linear, on (N, F) features with ``nn.Linear``'s
    weights (w1 (H, F), b1 (H,), w2 (H, H), b2 (H,), w3 (1, H), b3 (1,)): (N,) raw density. The
    same calls as the ``nn.Sequential`` it stands for (autocast applies as it would there)."""
    h = F.relu(F.linear(x, w1, b1))
    h = F.relu(F.linear(h, w2, b2))
    return F.linear(h, w3, b3).squeeze(-1)


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


# ------------------------------------------------------------------------- tomography (SIRT) ops
# Both are forward-only in the fast path; these twins are ordinary torch code (differentiable too).

RAY_COUNT_TOL = 1e-3
"""n = ceil(L / step - RAY_COUNT_TOL): a chord that is a whole number of steps up to rounding
(e.g. 128 voxels at step 0.5) gets exactly L / step cells in every implementation."""


def ray_project(volume: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor,
                image_hw: tuple[int, int], step: float, max_points: int = 1 << 22) -> torch.Tensor:
    """Line integrals (V, H, W) of ``volume`` (Z, Y, X) (density per voxel length) along the ray of
    every pixel of V views with poses ``rot`` (V, 3, 3), ``shift`` (V, 2), in voxel-length units.

    Rays and chords are those of :func:`fasttomo.geometry.rays.ray_samples` (box = the volume's
    shape, voxel = pixel). A ray with clipped chord length L > 0 gets n = max(1, ceil(L / step -
    RAY_COUNT_TOL)) cells of length dt = L / n and the volume is sampled trilinearly at their
    midpoints (grid_sample, align_corners=False, border clamping: the VoxelField convention, so
    a constant c integrates to exactly c * L); the integral is dt * sum of the samples. Rays that
    miss the box give 0. Rays are processed in chunks of at most ``max_points`` sample points
    (one host sync per chunk for its largest n).
    """
    from fasttomo.geometry.rays import Box, ray_samples

    Z, Y, X = volume.shape
    box = Box((Z, Y, X))
    h, w = int(image_hw[0]), int(image_hw[1])
    n_views = rot.shape[0]
    dev = volume.device
    dtype = volume.dtype if volume.dtype == torch.float64 else torch.float32
    vol = volume.to(dtype)[None, None]
    rot = rot.to(device=dev, dtype=dtype)
    shift = shift.to(device=dev, dtype=dtype)
    n_rays = n_views * h * w
    out = torch.zeros(n_rays, device=dev, dtype=dtype)
    half = torch.tensor(box.half_extent, device=dev, dtype=dtype)
    diag = math.sqrt(X * X + Y * Y + Z * Z)
    chunk = max(1, max_points // (int(math.ceil(diag / step)) + 1))
    for r0 in range(0, n_rays, chunk):
        idx = torch.arange(r0, min(r0 + chunk, n_rays), device=dev)
        view = idx // (h * w)
        pix = idx % (h * w)
        rs = ray_samples(pix // w, pix % w, rot[view], shift[view], (h, w), box, 1)
        length = rs.dt  # one cell: dt is the whole chord, the point its (normalized) midpoint
        n = torch.ceil(length / step - RAY_COUNT_TOL).clamp_min(1)
        n = torch.where(length > 0, n, torch.zeros_like(n))
        s_max = int(n.max().item()) if n.numel() else 0
        if s_max == 0:
            continue
        dt = torch.where(n > 0, length / n.clamp_min(1), torch.zeros_like(length))
        dir_n = rot[view][:, 2, :] / half  # R^T e_z in normalized units per voxel
        k = torch.arange(s_max, device=dev, dtype=dtype)
        t = (k[None, :] + 0.5 - n[:, None] / 2) * dt[:, None]  # (B, S), relative to the midpoint
        g = torch.addcmul(rs.points[:, :1, :], t[..., None], dir_n[:, None, :])
        val = F.grid_sample(vol, g.reshape(1, -1, s_max, 1, 3), mode="bilinear",
                            padding_mode="border", align_corners=False).reshape(-1, s_max)
        val = torch.where(k[None, :] < n[:, None], val, torch.zeros((), device=dev, dtype=dtype))
        out[r0:r0 + idx.numel()] = val.sum(dim=1) * dt
    return out.reshape(n_views, h, w)


def voxel_backproject(images: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor,
                      shape_zyx: tuple[int, int, int], max_points: int = 1 << 22) -> torch.Tensor:
    """Voxel-driven backprojection (Z, Y, X) of ``images`` (V, H, W) under poses ``rot`` (V, 3, 3),
    ``shift`` (V, 2): every voxel centre p is projected into every view, (u, v) = (R p + s)[:2]
    (the :func:`fasttomo.geometry.rays.project_points` convention), the image is sampled bilinearly at pixel
    coordinates (u + (W-1)/2, v + (H-1)/2) with zeros outside the detector (grid_sample,
    align_corners=False, zero padding), and the samples are summed over the views. Chunks of Z
    planes keep at most ``max_points`` (voxel, view) pairs in flight.
    """
    Z, Y, X = (int(s) for s in shape_zyx)
    n_views, h, w = images.shape
    dev = images.device
    dtype = images.dtype if images.dtype == torch.float64 else torch.float32
    img = images.to(dtype)[:, None]  # (V, 1, H, W)
    rot = rot.to(device=dev, dtype=dtype)
    shift = shift.to(device=dev, dtype=dtype)
    out = torch.zeros((Z, Y, X), device=dev, dtype=dtype)
    if n_views == 0:
        return out
    # u = r00 x + r01 y + r02 z + su (project_points), separable over the three axes
    cx = (torch.arange(X, device=dev, dtype=dtype) - (X - 1) / 2.0)
    cy = (torch.arange(Y, device=dev, dtype=dtype) - (Y - 1) / 2.0)
    cz = (torch.arange(Z, device=dev, dtype=dtype) - (Z - 1) / 2.0)
    # normalized image coordinates (align_corners=False): 2 u / W, 2 v / H
    scale = torch.tensor([2.0 / w, 2.0 / h], device=dev, dtype=dtype)
    rs = rot[:, :2, :] * scale[None, :, None]  # (V, 2, 3) rows of u and v, normalized
    ss = shift * scale  # (V, 2)
    ux = rs[:, None, :, 0] * cx[None, :, None]  # (V, X, 2)
    uy = rs[:, None, :, 1] * cy[None, :, None]  # (V, Y, 2)
    planes = max(1, max_points // max(1, n_views * Y * X))
    for z0 in range(0, Z, planes):
        zc = cz[z0:z0 + planes]
        uz = rs[:, None, :, 2] * zc[None, :, None] + ss[:, None, :]  # (V, Zc, 2)
        grid = uz[:, :, None, None, :] + uy[:, None, :, None, :] + ux[:, None, None, :, :]
        val = F.grid_sample(img, grid.reshape(n_views, -1, 1, 2), mode="bilinear",
                            padding_mode="zeros", align_corners=False)  # (V, 1, P, 1)
        out[z0:z0 + zc.numel()] = val.sum(dim=0).reshape(zc.numel(), Y, X)
    return out
