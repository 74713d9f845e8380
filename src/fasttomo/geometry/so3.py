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


_QUAT_TERMS = (  # R_ij = sum of sign * q_a q_b over these (a, b), for a unit quaternion (w, x, y, z) = 0..3
    ((1, 0, 0), (1, 1, 1), (-1, 2, 2), (-1, 3, 3)),   # R00 = w^2 + x^2 - y^2 - z^2
    ((2, 1, 2), (-2, 0, 3)),                           # R01 = 2 (xy - wz)
    ((2, 1, 3), (2, 0, 2)),                            # R02 = 2 (xz + wy)
    ((2, 1, 2), (2, 0, 3)),                            # R10 = 2 (xy + wz)
    ((1, 0, 0), (-1, 1, 1), (1, 2, 2), (-1, 3, 3)),   # R11 = w^2 - x^2 + y^2 - z^2
    ((2, 2, 3), (-2, 0, 1)),                           # R12 = 2 (yz - wx)
    ((2, 1, 3), (-2, 0, 2)),                           # R20 = 2 (xz - wy)
    ((2, 2, 3), (2, 0, 1)),                            # R21 = 2 (yz + wx)
    ((1, 0, 0), (-1, 1, 1), (-1, 2, 2), (1, 3, 3)),   # R22 = w^2 - x^2 - y^2 + z^2
)
_quat_basis_cache: dict = {}


def _quat_basis(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(16, 9) constant with vec(R) = vec(q q^T) @ basis for a unit quaternion q; built once per
    device and dtype (first call before a CUDA-graph capture: no host copy inside the step)."""
    key = (device, dtype)
    if key not in _quat_basis_cache:
        b = torch.zeros(16, 9, dtype=torch.float64)
        for j, terms in enumerate(_QUAT_TERMS):
            for sign, a, c in terms:
                b[4 * a + c, j] += sign
        _quat_basis_cache[key] = b.to(device=device, dtype=dtype)
    return _quat_basis_cache[key]


def rotation_from_quaternion(q: torch.Tensor) -> torch.Tensor:
    """(..., 3, 3) rotations from (..., 4) quaternions (w, x, y, z), normalized inside.

    R = Q(q) / |q|^2 with Q the quadratic form of the unit-quaternion formula (the rotation of
    q / |q|), written as one product with a constant so a step runs a handful of kernels (and
    their backward) instead of one per term."""
    if q.shape[-1] != 4:
        raise ValueError(f"rotation_from_quaternion: expected (..., 4), got {tuple(q.shape)}")
    outer = (q.unsqueeze(-1) * q.unsqueeze(-2)).flatten(-2)  # (..., 16)
    norm2 = q.square().sum(dim=-1, keepdim=True).clamp_min(1e-24)
    return ((outer @ _quat_basis(q.device, q.dtype)) / norm2).unflatten(-1, (3, 3))


def random_quaternions(n: int, generator: torch.Generator | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n, 4) unit quaternions uniformly distributed on SO(3) (normalized Gaussian 4-vectors)."""
    q = torch.randn(n, 4, generator=generator, dtype=dtype)
    q = q / q.norm(dim=-1, keepdim=True)
    return q * torch.where(q[:, :1] < 0, -1.0, 1.0)  # canonical hemisphere w >= 0
