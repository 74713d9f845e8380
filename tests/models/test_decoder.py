import pytest
import torch
import torch.nn.functional as F

from fasttomo.models.decoder import Decoder, density_activation, trunc_exp


def test_decoder_kinds_and_shapes():
    lin = Decoder(6, "linear")
    hyb = Decoder(6, "hybrid", hidden=5)
    x = torch.randn(10, 6)
    assert lin(x).shape == (10,) and hyb(x).shape == (10,)
    assert [type(m).__name__ for m in hyb.net] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert hyb.net[0].out_features == 5 and hyb.net[2].out_features == 5
    with pytest.raises(ValueError):
        Decoder(6, "deep")
    a = Decoder(6, "hybrid", 5, generator=torch.Generator().manual_seed(0))
    b = Decoder(6, "hybrid", 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a(x), b(x))  # the generator drives the init


def test_activations():
    raw = torch.tensor([-3.0, 0.0, 2.0, 20.0], requires_grad=True)
    torch.testing.assert_close(density_activation(raw, "softplus", -2.0), F.softplus(raw - 2.0))
    out = density_activation(raw, "trunc_exp", 1.0)
    torch.testing.assert_close(out, torch.exp(raw + 1.0))
    out.sum().backward()
    expect = torch.exp(torch.clamp(raw.detach() + 1.0, max=15.0))  # clamped in backward only
    torch.testing.assert_close(raw.grad, expect)
    with pytest.raises(ValueError):
        density_activation(raw, "relu", 0.0)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(trunc_exp, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = trunc_exp(torch.randn(4).to(torch.bfloat16))
    assert y.dtype == torch.float32
