"""Decoder heads (features -> raw density) and density activations."""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from fasttomo.kernels import dispatch

TRUNC_EXP_CLAMP = 15.0
"""The backward pass of :class:`TruncExp` evaluates exp at min(x, 15) (keeps gradients finite)."""


class Decoder(nn.Module):
    """``linear``: one Linear(in, 1). ``hybrid``: Linear-ReLU-Linear-ReLU-Linear (hidden width)."""

    def __init__(self, in_features: int, kind: str = "hybrid", hidden: int = 32,
                 generator: torch.Generator | None = None) -> None:
        """``generator`` drives the init (nn.Linear's default distribution); None: global RNG."""
        super().__init__()
        if kind == "linear":
            self.net = nn.Linear(in_features, 1)
        elif kind == "hybrid":
            self.net = nn.Sequential(
                nn.Linear(in_features, hidden), nn.ReLU(),
                nn.Linear(hidden, hidden), nn.ReLU(),
                nn.Linear(hidden, 1),
            )
        else:
            raise ValueError(f"Decoder: kind must be 'linear' or 'hybrid', got {kind!r}")
        self.kind = kind
        self.train_dtype: torch.dtype | None = None
        """bf16 on a CPU (train.precision.Precision.decoder_only): the layers run under CPU autocast
        in that dtype while gradients are recorded; evaluation without gradients stays fp32."""
        if generator is not None:
            for layer in self.modules():
                if isinstance(layer, nn.Linear):
                    nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=generator)
                    bound = 1.0 / math.sqrt(layer.in_features)
                    nn.init.uniform_(layer.bias, -bound, bound, generator=generator)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(N, in_features) -> (N,) raw density."""
        if self.train_dtype is not None and features.device.type == "cpu" and torch.is_grad_enabled():
            with torch.autocast("cpu", dtype=self.train_dtype):
                return self._net(features).float()
        return self._net(features)

    def evaluates_natively(self) -> bool:
        """Whether an evaluation without gradients takes the door's native CPU decoder (which
        keeps no hidden layer in memory: the rendering passes size their chunks by it)."""
        if self.kind != "hybrid":
            return False
        w = self.net[0].weight
        return dispatch.decoder_mlp_native(w.device, w.dtype, w.shape[1], w.shape[0])

    def _net(self, features: torch.Tensor) -> torch.Tensor:
        if self.kind == "linear":
            return self.net(features).squeeze(-1)
        l1, l2, l3 = self.net[0], self.net[2], self.net[4]  # the kernel door's decoder_mlp (CPU: native)
        return dispatch.decoder_mlp(features, l1.weight, l1.bias, l2.weight, l2.bias, l3.weight, l3.bias)


class TruncExp(torch.autograd.Function):
    """exp(x) whose backward uses exp(min(x, 15)) (the truncated exponential of Instant-NGP).
    Computed in fp32 (the output is fp32 even under autocast); first-order only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float64 else x.float()
        ctx.save_for_backward(xf)
        ctx.in_dtype = x.dtype
        return torch.exp(xf)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (xf,) = ctx.saved_tensors
        return (grad * torch.exp(xf.clamp(max=TRUNC_EXP_CLAMP))).to(ctx.in_dtype)


def trunc_exp(x: torch.Tensor) -> torch.Tensor:
    return TruncExp.apply(x)


def density_activation(raw: torch.Tensor, kind: str = "softplus", shift: float = 0.0) -> torch.Tensor:
    """Non-negative density from the raw decoder output: softplus(raw + shift) or
    trunc_exp(raw + shift)."""
    if kind == "softplus":
        return F.softplus(raw + shift)
    if kind == "trunc_exp":
        return trunc_exp(raw + shift)
    raise ValueError(f"density_activation: kind must be 'softplus' or 'trunc_exp', got {kind!r}")
