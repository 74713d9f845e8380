"""Rotations: batched builders and two differentiable parametrizations of SO(3).

* :func:`rot_y`, :func:`rot_z`: the elementary rotations of the projection geometry (angles in
  radians). ``rot_y(theta) = [[c, 0, s], [0, 1, 0], [-s, 0, c]]`` (IMOD tilt: a point (x, y, z)
  goes to u = x cos + z sin), ``rot_z(a) = [[c, -s, 0], [s, c, 0], [0, 0, 1]]`` (in-plane rotation
  about the beam axis).
* :func:`rotation_from_matrix`: the rotation closest (Frobenius) to a free 3x3 matrix, by SVD with
  the determinant fixed to +1 ("special orthogonal Procrustes"). Its backward pass is written by
  hand: autograd through ``torch.linalg.svd`` divides by differences of singular values and gives
  inf/NaN at the identity (all singular values equal), which is exactly where frame 0 starts. The
  hand-written gradient only divides by sums of (signed) singular values, finite there.
* :func:`rotation_from_quaternion`: (w, x, y, z) quaternion, normalized inside.

Callers run these in fp32 (or fp64 in tests) with autocast disabled; nothing here casts.
"""

from __future__ import annotations

import torch


def rot_y(theta: torch.Tensor) -> torch.Tensor:
    """(..., 3, 3) rotations about y by ``theta`` (radians, shape (...))."""
    c, s = torch.cos(theta), torch.sin(theta)
    o, z = torch.ones_like(theta), torch.zeros_like(theta)
    return torch.stack((c, z, s, z, o, z, -s, z, c), dim=-1).unflatten(-1, (3, 3))


def rot_z(a: torch.Tensor) -> torch.Tensor:
    """(..., 3, 3) rotations about z (the beam axis) by ``a`` (radians, shape (...))."""
    c, s = torch.cos(a), torch.sin(a)
    o, z = torch.ones_like(a), torch.zeros_like(a)
    return torch.stack((c, -s, z, s, c, z, z, z, o), dim=-1).unflatten(-1, (3, 3))


class _SpecialProcrustes(torch.autograd.Function):
    """R = U diag(1, 1, d) V^T with M = U S V^T and d = sign(det(U V^T)).

    Write U' = U diag(1, 1, d) and s' = (s1, s2, d s3), so M = U' diag(s') V^T and R = U' V^T.
    With P = U'^T dM V, the differential is dR = U' W V^T where W_ij = (P_ij - P_ji)/(s'_i + s'_j).
    Hence for an upstream gradient G: H = U'^T G V, K_ij = (H_ij - H_ji)/(s'_i + s'_j) (zero
    diagonal) and dL/dM = U' K V^T. First-order only (double backward raises).
    """

    @staticmethod
    def forward(ctx, m: torch.Tensor) -> torch.Tensor:
        u, s, vh = torch.linalg.svd(m)
        d = torch.sign(torch.linalg.det(u) * torch.linalg.det(vh))
        d = torch.where(d == 0, torch.ones_like(d), d)
        flip = torch.cat((torch.ones_like(s[..., :2]), d.unsqueeze(-1)), dim=-1)  # (1, 1, d)
        u = u * flip.unsqueeze(-2)  # scale the last column of U
        s_signed = s * flip
        r = u @ vh
        ctx.save_for_backward(u, s_signed, vh)
        return r

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_r: torch.Tensor) -> torch.Tensor:
        u, s, vh = ctx.saved_tensors
        v = vh.transpose(-1, -2)
        h = u.transpose(-1, -2) @ grad_r @ v
        denom = s.unsqueeze(-1) + s.unsqueeze(-2)
        # A zero denominator means a rank-deficient input (not a rotation's neighbourhood): the
        # projection is not differentiable there; return 0 instead of inf.
        safe = torch.where(denom.abs() > 1e-12, denom, torch.ones_like(denom))
        k = torch.where(denom.abs() > 1e-12, (h - h.transpose(-1, -2)) / safe, torch.zeros_like(h))
        return u @ k @ vh


def rotation_from_matrix(m: torch.Tensor) -> torch.Tensor:
    """Project free (..., 3, 3) matrices onto SO(3) (closest rotation, det +1), differentiably."""
    if m.shape[-2:] != (3, 3):
        raise ValueError(f"rotation_from_matrix: expected (..., 3, 3), got {tuple(m.shape)}")
    return _SpecialProcrustes.apply(m)


def rotation_from_quaternion(q: torch.Tensor) -> torch.Tensor:
    """(..., 3, 3) rotations from (..., 4) quaternions (w, x, y, z), normalized inside."""
    if q.shape[-1] != 4:
        raise ValueError(f"rotation_from_quaternion: expected (..., 4), got {tuple(q.shape)}")
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    w, x, y, z = q.unbind(-1)
    return torch.stack((
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ), dim=-1).unflatten(-1, (3, 3))


def random_quaternions(n: int, generator: torch.Generator | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n, 4) unit quaternions uniformly distributed on SO(3) (normalized Gaussian 4-vectors)."""
    q = torch.randn(n, 4, generator=generator, dtype=dtype)
    q = q / q.norm(dim=-1, keepdim=True)
    return q * torch.where(q[:, :1] < 0, -1.0, 1.0)  # canonical hemisphere w >= 0
