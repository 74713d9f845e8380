"""SIRT's quality curve scores Pearson in float64 chunks (a 2048^2 x 512 box must not get
whole-volume float64 copies): the chunked value is the whole-volume value to float64 rounding,
with and without a foreground mask, whatever the chunk."""

from __future__ import annotations

import math

import pytest
import torch

from fasttomo.methods.sirt import method


def _whole(a, b, mask=None):
    a, b = a.double(), b.double()
    if mask is not None:
        a, b = a[mask], b[mask]
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / torch.sqrt((a * a).sum() * (b * b).sum()))


@pytest.mark.parametrize("chunk", [1, 97, 1 << 26])
def test_chunked_pearson_is_the_whole_volume_pearson(chunk, monkeypatch):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 9, 11, generator=g) + 3.0
    b = a + 0.5 * torch.randn(7, 9, 11, generator=g)
    fg = b > 3.2
    monkeypatch.setattr(method, "PEARSON_CHUNK", chunk)
    assert method._pearson_t(a, b) == pytest.approx(_whole(a, b), abs=1e-13)
    assert method._pearson_t(a, b, fg) == pytest.approx(_whole(a, b, fg), abs=1e-13)
    assert math.isnan(method._pearson_t(a, b, torch.zeros_like(fg)))
    assert math.isnan(method._pearson_t(a, torch.ones_like(b)))
