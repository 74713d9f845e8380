"""Mixed precision: autocast for the field only, GradScaler for fp16.

Rays, rotations, poses and the line integral always run in fp32 (the callers disable autocast
around them); the field's features and MLP run in the configured dtype.
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """precision.dtype=auto: bf16 on a CUDA device that supports it, else fp32."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


class Precision:
    def __init__(self, dtype: str, device: torch.device):
        dtype = resolve_dtype(dtype, device)
        self.name = dtype
        self.dtype = _DTYPES[dtype]
        self.device_type = device.type
        self.enabled = dtype != "fp32"
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=dtype == "fp16")

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        # no weight-cast cache: a captured CUDA graph must recompute casts on every replay
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params, grad_clip: float | None) -> None:
        if grad_clip is not None:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
        self.scaler.step(optimizer)
        self.scaler.update()
