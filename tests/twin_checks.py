"""Checks the kernel tests share: a fast path against its pure-torch twin."""

from __future__ import annotations

import torch

from fasttomo.kernels import dispatch


def assert_double_backward_is_the_twins(fast, twin, inputs, op: str) -> None:
    """A create_graph backward through ``fast`` runs the twin's formula with a graph (the spy counts
    'torch' once under ``<op>_bwd``): the first and second derivatives of a loss through it are the
    twin's (float64 inputs, 1e-10), and the second derivative is not zero."""
    res = {}
    for name, fn in (("fast", fast), ("twin", twin)):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        dispatch.reset_counters()
        g1 = torch.autograd.grad(fn(*leaves).square().sum(), leaves, create_graph=True)
        spy = dict(dispatch.counters.get(f"{op}_bwd", {}))
        g2 = torch.autograd.grad(sum((g * torch.cos(g)).sum() for g in g1), leaves)
        res[name] = (g1, g2, spy)
    assert res["fast"][2] == {"torch": 1}
    for a, b in zip(res["fast"][0] + res["fast"][1], res["twin"][0] + res["twin"][1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert any(float(g.abs().max()) > 0 for g in res["fast"][1])  # a real second derivative
