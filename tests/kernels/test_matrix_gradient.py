"""reference.matrix_gradient (the fused backward's dL/dM from dL/dq) against einsum in float64."""

from __future__ import annotations

import pytest
import torch

from fasttomo.kernels import reference


@pytest.mark.parametrize("n", [7, 1024 * 64, 1024 * 64 * 2 + 333])  # one GEMM; split exactly; split + rest
def test_matrix_gradient_is_the_sum_of_outer_products(n):
    g = torch.Generator().manual_seed(n)
    dq = torch.randn(3, 4, n, generator=g, dtype=torch.float64)
    points = torch.rand(n, 3, generator=g, dtype=torch.float64) * 2 - 1
    got = reference.matrix_gradient(dq, points)
    want = torch.einsum("itn,nj->tij", dq, points)
    assert got.shape == (4, 3, 3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)
    # fp32 inputs (the fast path's): as close as an fp32 sum of n terms can be
    got32 = reference.matrix_gradient(dq.float(), points.float())
    torch.testing.assert_close(got32.double(), want, rtol=1e-4, atol=1e-3 * n ** 0.5 / 100)
