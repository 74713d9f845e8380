"""Isotropic 3-D Gaussian atoms on a voxel grid: patches, rendering and the batched fit.

Positions here are voxel index coordinates ordered like the array, (z, y, x): voxel (k, i, j)
has its centre at (k, i, j). An atom is ``amplitude * exp(-|p - c|^2 / (2 sigma^2))`` (sigma in
voxels) sitting on a local constant ``background``; its integrated intensity is
``amplitude * (2 pi)^(3/2) sigma^3`` (volume units times voxels).

Everything is batched over atoms in torch, so it runs where the volume lives (CPU or GPU).
"""

from __future__ import annotations

import math

import torch

TWO_PI_32 = (2.0 * math.pi) ** 1.5


def cube_offsets(radius: int, device) -> torch.Tensor:
    """(P, 3) integer offsets (dz, dy, dx) of the cube of half size ``radius``."""
    r = torch.arange(-radius, radius + 1, device=device)
    return torch.stack(torch.meshgrid(r, r, r, indexing="ij"), dim=-1).reshape(-1, 3)


def patch_index(centres: torch.Tensor, radius: int, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Voxels of the cube of half size ``radius`` around the rounded ``centres`` (N, 3) (z, y, x).

    Returns ``(flat, coords, inside)``: flat indices into the volume (N, P) (clamped where the
    voxel lies outside), the voxel coordinates (N, P, 3) float and the inside mask (N, P).
    """
    off = cube_offsets(radius, centres.device)
    base = torch.round(centres).long()
    vox = base[:, None, :] + off[None]                                     # (N, P, 3)
    dims = torch.tensor(shape, device=centres.device)
    inside = ((vox >= 0) & (vox < dims)).all(-1)
    vc = torch.minimum(vox.clamp_min(0), dims - 1)
    flat = (vc[..., 0] * shape[1] + vc[..., 1]) * shape[2] + vc[..., 2]
    return flat, vox.to(centres.dtype), inside


def gaussian_values(coords: torch.Tensor, centre: torch.Tensor, amplitude: torch.Tensor,
                    sigma: torch.Tensor) -> torch.Tensor:
    """``amplitude exp(-|coords - centre|^2 / 2 sigma^2)``: coords (N, P, 3), the rest (N, 3)/(N,)."""
    d2 = ((coords - centre[:, None, :]) ** 2).sum(-1)
    return amplitude[:, None] * torch.exp(-0.5 * d2 / (sigma[:, None] ** 2))


def render(shape, centres: torch.Tensor, amplitude: torch.Tensor, sigma: torch.Tensor,
           radius: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of Gaussian atoms sampled at the voxel centres of a volume of ``shape`` (Z, Y, X).

    ``centres`` (N, 3) are (z, y, x) voxel coordinates; ``amplitude``, ``sigma`` (N,) or scalars.
    Each atom is drawn in the cube of half size ``radius`` (default ceil(4 max sigma)) around its
    rounded centre, so the truncation error is below exp(-8) of its peak. ``out`` (flat or
    shaped) is added to in place when given.
    """
    n = centres.shape[0]
    dev, dt = centres.device, centres.dtype if centres.is_floating_point() else torch.float32
    centres = centres.to(dt)
    amplitude = torch.as_tensor(amplitude, dtype=dt, device=dev).expand(n).contiguous()
    sigma = torch.as_tensor(sigma, dtype=dt, device=dev).expand(n).contiguous()
    if radius is None:
        radius = max(1, int(math.ceil(4.0 * float(sigma.max()) if n else 1)))
    vol = torch.zeros(int(math.prod(shape)), dtype=dt, device=dev) if out is None else out.view(-1)
    chunk = max(1, 2_000_000 // (2 * radius + 1) ** 3)
    for s in range(0, n, chunk):
        sl = slice(s, s + chunk)
        flat, coords, inside = patch_index(centres[sl], radius, shape)
        val = gaussian_values(coords, centres[sl], amplitude[sl], sigma[sl]) * inside
        vol.index_add_(0, flat.reshape(-1), val.reshape(-1).to(vol.dtype))
    return vol.view(*shape) if out is None else out


def fit_gaussians(data: torch.Tensor, coords: torch.Tensor, weight: torch.Tensor, params: torch.Tensor,
                  iterations: int = 12, max_shift: float = 0.75, sigma_bounds: tuple = (0.05, 1e3),
                  fix_sigma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Levenberg-Marquardt fit of one Gaussian plus a constant per patch, all patches at once.

    ``data`` (N, P) voxel values, ``coords`` (N, P, 3) their (z, y, x) positions, ``weight``
    (N, P) 1 inside the volume and 0 outside, ``params`` (N, 6) the start: (cz, cy, cx,
    amplitude, sigma, background). A step is taken per patch only where it lowers that patch's
    squared error (the damping of a refused step grows, of a taken one shrinks); centre steps are
    clamped to ``max_shift`` voxels per iteration, sigma kept within ``sigma_bounds`` voxels (or
    not fitted at all with ``fix_sigma``).

    Returns ``(params, sse)``: the fitted parameters and each patch's sum of squared residuals.
    """
    p = params.clone()
    lam = torch.full((p.shape[0],), 1e-2, dtype=p.dtype, device=p.device)
    eye = torch.eye(6, dtype=torch.float64, device=p.device)

    def residual(q):
        g = torch.exp(-0.5 * ((coords - q[:, None, :3]) ** 2).sum(-1) / (q[:, 4:5] ** 2))
        r = (q[:, 3:4] * g + q[:, 5:6] - data) * weight
        return r, g

    r, g = residual(p)
    sse = (r * r).sum(-1)
    stalled = 0
    for _ in range(iterations):
        a, s = p[:, 3:4], p[:, 4:5]
        diff = coords - p[:, None, :3]                                     # (N, P, 3)
        d2 = (diff * diff).sum(-1)
        ag = a * g
        jac = torch.cat([ag[..., None] * diff / (s[..., None] ** 2), g[..., None],
                         (ag * d2 / s ** 3 * (0.0 if fix_sigma else 1.0))[..., None], torch.ones_like(g)[..., None]],
                        dim=-1) * weight[..., None]
        jtj = torch.einsum("npi,npj->nij", jac, jac).double()
        jtr = torch.einsum("npi,np->ni", jac, r).double()
        diag = torch.diagonal(jtj, dim1=-2, dim2=-1)
        damp = lam.double()[:, None, None] * (torch.diag_embed(diag) + 1e-9 * eye) + 1e-12 * eye
        step = -torch.linalg.solve(jtj + damp, jtr[..., None])[..., 0].to(p.dtype)
        step[:, :3] = step[:, :3].clamp(-max_shift, max_shift)
        q = p + step
        q[:, 4] = q[:, 4].clamp(sigma_bounds[0], sigma_bounds[1])
        step = torch.nan_to_num(q - p)
        q = p + step
        r_new, g_new = residual(q)
        sse_new = (r_new * r_new).sum(-1)
        ok = sse_new < sse
        # converged everywhere (two iterations in a row without a relative gain above 1e-6): stop
        gain = torch.where(ok, (sse - sse_new) / sse.clamp_min(1e-30), torch.zeros_like(sse))
        stalled = stalled + 1 if (gain.numel() == 0 or float(gain.max()) < 1e-6) else 0
        p = torch.where(ok[:, None], q, p)
        r = torch.where(ok[:, None], r_new, r)
        g = torch.where(ok[:, None], g_new, g)
        sse = torch.where(ok, sse_new, sse)
        lam = torch.where(ok, lam * 0.3, lam * 5.0).clamp(1e-6, 1e6)
        if stalled >= 2:
            break
    return p, sse


def log_parabola_offset(c_minus: torch.Tensor, c0: torch.Tensor, c_plus: torch.Tensor) -> torch.Tensor:
    """Sub-voxel offset of the maximum of a Gaussian through three samples (exact for a Gaussian
    sampled on its axis); clamped to +-0.5."""
    eps = 1e-12
    lm, l0, lp = (torch.log(v.clamp_min(eps)) for v in (c_minus, c0, c_plus))
    den = lm - 2.0 * l0 + lp
    off = torch.where(den < -1e-9, 0.5 * (lm - lp) / den.clamp_max(-1e-9), torch.zeros_like(den))
    return off.clamp(-0.5, 0.5)
