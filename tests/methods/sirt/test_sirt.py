"""SIRT on the CPU (pure-torch twins): convergence on a tiny phantom, the callback, masks, init,
validation, and agreement with an independent numpy SIRT on exact ray-pixel intersection lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fasttomo.methods.sirt import forward_project, sirt
from fasttomo.data import phantom as P
from fasttomo.geometry.poses import Poses
from fasttomo.geometry.rays import Box


def _corr(a, b) -> float:
    return float(np.corrcoef(np.ravel(np.asarray(a, dtype=np.float64)), np.ravel(np.asarray(b, dtype=np.float64)))[0, 1])


@pytest.fixture(scope="module")
def tiny():
    ph = P.default_phantom(16, 16, 8)
    angles = np.linspace(-60, 60, 7)
    stack = torch.from_numpy(P.project(ph, angles))
    return Poses(angles, 3), Box(ph.shape_zyx), stack, P.voxelize(ph)


def test_sirt_improves_with_iterations_and_calls_back(tiny):
    poses, box, stack, truth = tiny
    seen = []

    def cb(i, vol):
        seen.append(i)
        if i in (1, 4, 16):
            res = float((forward_project(vol, poses, box, (16, 16)) - stack).norm() / stack.norm())
            record[i] = (res, _corr(vol, truth))

    record = {}
    x = sirt(stack, poses, box, 16, callback=cb)
    assert seen == list(range(1, 17))
    assert x.shape == box.shape_zyx and x.dtype == torch.float32 and float(x.min()) >= 0.0
    (r1, c1), (r4, c4), (r16, c16) = record[1], record[4], record[16]
    # measured: residual 0.37 -> 0.24 -> 0.14, correlation 0.71 -> 0.81 -> 0.91
    assert r1 > r4 > r16 and r16 < 0.2
    assert c1 < c4 < c16 and c16 > 0.85
    # the callback sees the live volume: after the last update it is the result
    assert torch.equal(x, sirt(stack, poses, box, 16))


def test_zero_iterations_and_init_are_respected(tiny):
    poses, box, stack, _ = tiny
    init = torch.full(box.shape_zyx, 0.1)
    keep = init.clone()
    assert torch.equal(sirt(stack, poses, box, 0), torch.zeros(box.shape_zyx))
    x0 = sirt(stack, poses, box, 0, init=init)
    assert torch.equal(x0, init) and x0 is not init
    x2 = sirt(stack, poses, box, 2, init=init, relaxation=0.5, positivity=False)
    assert torch.equal(init, keep)  # never modified
    assert not torch.equal(x2, init)


def test_invalid_pixels_contribute_nothing(tiny):
    """Garbage (NaN, huge values) in invalid pixels: the same volume as with clean values there."""
    poses, box, stack, _ = tiny
    g = torch.Generator().manual_seed(0)
    valid = torch.rand(stack.shape, generator=g) > 0.2
    valid[2] = False  # one whole view invalid as well
    garbage = stack.clone()
    garbage[~valid] = 1e6
    garbage[~valid & (torch.rand(stack.shape, generator=g) > 0.5)] = float("nan")
    a = sirt(garbage, poses, box, 5, valid=valid)
    b = sirt(stack, poses, box, 5, valid=valid.numpy())
    assert torch.isfinite(a).all()
    assert torch.allclose(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, sirt(stack, poses, box, 5), atol=1e-4)  # the mask changes the weights


def test_weights_built_in_place_equal_their_definition(tiny):
    """R = valid / (A 1) and C = 1 / (B valid), zero where the ray misses the box or no valid ray
    sees the voxel, bit for bit as the masked formulas give them (the solver builds them in place)."""
    from fasttomo.kernels import dispatch
    from fasttomo.methods.sirt.projectors import view_poses
    from fasttomo.methods.sirt.solver import EPS, sirt_weights

    poses, _, stack, _ = tiny
    box = Box((8, 20, 20))  # wider than the images: voxels no ray sees (C = 0 there)
    valid = (torch.rand(stack.shape, generator=torch.Generator().manual_seed(1)) > 0.3).float()
    rot, shift = view_poses(poses, None, stack.device, torch.float32)
    R, C = sirt_weights(rot, shift, box, tuple(stack.shape[1:]), valid, 0.5)
    chord = dispatch.ray_project(torch.ones(box.shape_zyx), rot, shift, tuple(stack.shape[1:]), 0.5)
    seen = dispatch.voxel_backproject(valid, rot, shift, box.shape_zyx)
    zero = torch.zeros(())
    assert torch.equal(R, torch.where(chord > EPS, valid / chord.clamp_min(EPS), zero))
    assert torch.equal(C, torch.where(seen > EPS, 1.0 / seen.clamp_min(EPS), zero))
    assert (C == 0).any() and (C > 0).any() and (R == 0).any() and (R > 0).any()


def test_validation_errors(tiny):
    poses, box, stack, _ = tiny
    with pytest.raises(ValueError, match="relaxation"):
        sirt(stack, poses, box, 3, relaxation=2.5)
    with pytest.raises(ValueError, match="one view per image"):
        sirt(stack[:3], poses, box, 3)
    with pytest.raises(ValueError, match="valid mask shape"):
        sirt(stack, poses, box, 3, valid=torch.ones(3, 16, 16))
    with pytest.raises(ValueError, match="init shape"):
        sirt(stack, poses, box, 3, init=torch.zeros(2, 2, 2))
    per_line = Poses(np.repeat(np.linspace(-60, 60, 7)[:, None], 16, axis=1), 3)
    with pytest.raises(NotImplementedError, match="per-line"):
        sirt(stack, per_line, box, 1)


# ------------------------------------------------------------------ an independent 2-D SIRT in numpy
def _siddon(nx: int, nz: int, angles_deg, n_det: int):
    """Exact intersection lengths of parallel rays with the unit pixels of an (nz, nx) grid.

    Written for this test (float64), with no fasttomo code: pixel (i, j) covers
    x in [j - nx/2, j + 1 - nx/2], z in [i - nz/2, i + 1 - nz/2]. The ray of detector position u
    at tilt theta is (x, z)(t) = u (cos, sin) + t (-sin, cos) (IMOD: a point projects to
    u = x cos + z sin). Every crossing of a grid line cuts the ray into segments; each segment's
    midpoint names its pixel. Returns COO (rows, cols, lengths).
    """
    hx, hz = nx / 2.0, nz / 2.0
    lines_x, lines_z = np.arange(nx + 1) - hx, np.arange(nz + 1) - hz
    rows, cols, vals = [], [], []
    us = np.arange(n_det) - (n_det - 1) / 2.0
    for a, th in enumerate(np.deg2rad(np.asarray(angles_deg, float))):
        c, s = math.cos(th), math.sin(th)
        d = (-s, c)
        for k, u in enumerate(us):
            o = (u * c, u * s)
            lo, hi, crossings = -np.inf, np.inf, []
            for oi, di, h, lines in ((o[0], d[0], hx, lines_x), (o[1], d[1], hz, lines_z)):
                if abs(di) < 1e-12:
                    if abs(oi) >= h:
                        lo, hi = 1.0, 0.0
                    continue
                t1, t2 = (-h - oi) / di, (h - oi) / di
                lo, hi = max(lo, min(t1, t2)), min(hi, max(t1, t2))
                crossings.append((lines - oi) / di)
            if hi <= lo:
                continue
            t = np.concatenate(crossings)
            t = np.concatenate(([lo], np.sort(t[(t > lo) & (t < hi)]), [hi]))
            seg, mid = np.diff(t), 0.5 * (t[1:] + t[:-1])
            j = np.floor(o[0] + mid * d[0] + hx).astype(int)
            i = np.floor(o[1] + mid * d[1] + hz).astype(int)
            keep = (seg > 1e-12) & (j >= 0) & (j < nx) & (i >= 0) & (i < nz)
            rows += [a * n_det + k] * int(keep.sum())
            cols += list(i[keep] * nx + j[keep])
            vals += list(seg[keep])
    return np.array(rows), np.array(cols), np.array(vals)


def _numpy_sirt(coo, shape, b, iterations):
    """Textbook SIRT with a matched pair (A, A^T): x <- max(x + C A^T R (b - A x), 0)."""
    rows, cols, vals = coo
    m, n = shape

    def A(x):
        return np.bincount(rows, vals * x[cols], minlength=m)

    def At(y):
        return np.bincount(cols, vals * y[rows], minlength=n)

    rs, cs = A(np.ones(n)), At(np.ones(m))
    R = np.where(rs > 1e-9, 1.0 / np.maximum(rs, 1e-12), 0.0)
    C = np.where(cs > 1e-9, 1.0 / np.maximum(cs, 1e-12), 0.0)
    x = np.zeros(n)
    for _ in range(iterations):
        x = np.maximum(x + C * At(R * (b - A(x))), 0.0)
    return x


def test_sirt_agrees_with_an_independent_numpy_siddon_sirt_on_a_slice():
    """One x-z slice (Y = 1), 32 x 32, 31 tilts over +-60 degrees, exact (analytic) data.

    The two differ in every discretization choice: fasttomo samples a trilinear interpolant along
    the rays and splats bilinearly (an unmatched pair), numpy uses the pixel basis with exact
    intersection lengths and its exact transpose. On the truth their forward projections differ by
    1.7 % (3.7 % and 4.0 % from the analytic data). Measured after 50 iterations: correlation
    between the two reconstructions 0.997 (relative difference 0.071); to the truth 0.957
    (fasttomo) and 0.954 (numpy), up from 0.81 at 5 iterations. Bounds: 0.99 between them (the
    fasttomo slice mirrored in x scores 0.69 against numpy's, shifted by one voxel 0.89), 0.93 to
    the truth, 0.12 relative.
    """
    nx = nz = 32
    ny = 9  # the phantom needs some y extent; the v = 0 row of a 9-row detector sees y = 0
    angles = np.linspace(-60, 60, 31)
    roty = [[math.cos(0.5), 0, math.sin(0.5)], [0, 1, 0], [-math.sin(0.5), 0, math.cos(0.5)]]
    ph = P.Phantom((nz, ny, nx), [
        P.Ellipsoid((0, 0, 0), (12, 4, 7), None, 0.4, "body"),
        P.Ellipsoid((4, 0, 2), (3, 4, 2.5), None, 0.6, "inclusion"),
        P.Ellipsoid((-5, 0, -2), (2, 4, 2), None, 1.0, "dense"),
        P.Ellipsoid((-8, 0, 3), (2.5, 4, 1.5), roty, -0.2, "hole"),
        P.Ellipsoid((9, 0, -3), (1.5, 4, 1.5), None, 0.8, "small, off-centre"),
    ])
    stack = P.project(ph, angles, height=ny, width=nx)[:, ny // 2: ny // 2 + 1, :]  # (31, 1, 32)
    truth = P.voxelize(ph, supersample=4)[:, ny // 2, :]  # the y = 0 slab row, (32, 32)

    coo = _siddon(nx, nz, angles, nx)
    x_np = _numpy_sirt(coo, (len(angles) * nx, nz * nx), stack.ravel().astype(np.float64), 50).reshape(nz, nx)
    x_5 = sirt(torch.from_numpy(stack), Poses(angles, 15), Box((nz, 1, nx)), 5)[:, 0].numpy()
    x_ft = sirt(torch.from_numpy(stack), Poses(angles, 15), Box((nz, 1, nx)), 50)[:, 0].numpy()

    assert _corr(x_ft, x_np) >= 0.99
    assert np.linalg.norm(x_ft - x_np) / np.linalg.norm(x_np) < 0.12
    assert _corr(x_ft, truth) >= 0.93 and _corr(x_np, truth) >= 0.93
    assert _corr(x_5, truth) < _corr(x_ft, truth) - 0.05
    # sanity of the oracle itself: its forward projection of the truth matches the analytic data
    rows, cols, vals = coo
    fwd = np.bincount(rows, vals * truth.ravel()[cols], minlength=len(angles) * nx)
    assert np.linalg.norm(fwd - stack.ravel()) / np.linalg.norm(stack) < 0.05
