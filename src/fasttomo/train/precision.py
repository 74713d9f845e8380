"""Mixed precision: autocast for the field only, GradScaler for fp16; and the optimizer step,
which a device-side ``skip`` flag (the divergence guard's, see train/guard.py) can cancel
without a host sync.

Rays, rotations, poses and the line integral always run in fp32 (the callers disable autocast
around them); the field's features and MLP run in the configured dtype. On a CPU, bf16 covers the
decoder's layers in training alone (``Precision.decoder_only``): the interpolation's CPU kernels
are fp32, and bf16 matrix products are what the CPU speeds up (on a 2-core Zen 4 machine a
131072 x 32 by 32 x 32 product took 0.92 ms in bf16 against 4.58 ms in fp32).
"""

from __future__ import annotations

import contextlib
import functools

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (x86: avx512_bf16 or amx_bf16 among the
    flags of /proc/cpuinfo); False where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """precision.dtype=auto: bf16 on a CUDA device that supports it and on a CPU with bf16
    dot-product instructions (there: the decoder alone, see the module docstring), else fp32."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    if device.type == "cpu" and cpu_has_native_bf16():
        return "bf16"
    return "fp32"


class Precision:
    def __init__(self, dtype: str, device: torch.device):
        dtype = resolve_dtype(dtype, device)
        self.name = dtype
        self.dtype = _DTYPES[dtype]
        self.device_type = device.type
        self.decoder_only = device.type == "cpu" and dtype == "bf16"
        """bf16 on a CPU: the decoder's layers in training (``models.decoder.Decoder.train_dtype``),
        the rest of the field in fp32."""
        self.enabled = dtype != "fp32" and not self.decoder_only
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=dtype == "fp16")

    def autocast(self):
        if not self.enabled:
            return contextlib.nullcontext()
        # no weight-cast cache: a captured CUDA graph must recompute casts on every replay
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params, grad_clip: float | None,
             skip: torch.Tensor | None = None, grad_norm: torch.Tensor | None = None) -> None:
        """Clip (optionally) and apply the update. ``skip`` (a 0/1 float device tensor) cancels
        it on the device: the fused optimizer's ``found_inf`` input, or merged into the fp16
        GradScaler's own overflow flag. ``grad_norm``, the norm of the unscaled gradients when
        the caller measured it already, saves clipping a second pass."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)
            if skip is not None:
                _merge_into_scaler(self.scaler, optimizer, skip)
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
            self.scaler.step(optimizer)  # skipped when found_inf; the scale is lowered as for an overflow
            self.scaler.update()
            return
        if grad_clip is not None:
            if grad_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm, foreach=True)
            else:
                torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
        if skip is None:
            optimizer.step()
        elif getattr(optimizer, "_step_supports_amp_scaling", False):  # fused: skips on the device
            optimizer.grad_scale, optimizer.found_inf = None, skip
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
        elif not bool(skip):  # an optimizer without a device-side skip: one host sync per step
            optimizer.step()


def _merge_into_scaler(scaler: torch.amp.GradScaler, optimizer, skip: torch.Tensor) -> None:
    """OR ``skip`` into the overflow flags unscale_ just computed (GradScaler keeps them per
    optimizer and device); scaler.step then skips the update and update() lowers the scale."""
    states = getattr(scaler, "_per_optimizer_states", None)
    found = states[id(optimizer)].get("found_inf_per_device") if states else None
    if not found:
        raise RuntimeError("this torch's GradScaler keeps no per-device overflow flags; cannot merge the guard's flag")
    for t in found.values():
        t.copy_(torch.maximum(t, skip.to(device=t.device, dtype=t.dtype)))
