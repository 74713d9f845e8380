"""How the fused kernels' launchers launch: at once, or (in a compile-ahead job, ``ahead.py``)
compile only."""

from __future__ import annotations

import contextvars

import torch

COMPILE_ONLY: contextvars.ContextVar = contextvars.ContextVar("fasttomo_compile_only", default=None)
"""While ``ahead.start`` runs a plan's launchers: its collector (``.device``: the CUDA device to
compile for; ``.add(kernel, grid, args, kwargs)``: one launch to compile), else None."""


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or while ``ahead.start`` collects a plan: hand the launch
    to the collector, which compiles it (``JITFunction.warmup``) in its pool."""
    collector = COMPILE_ONLY.get()
    if collector is None:
        kernel[grid](*args, **kwargs)
    else:
        collector.add(kernel, grid, args, kwargs)


def device_of(t: torch.Tensor) -> torch.device:
    """The device a launcher decides for (the SM count of ``backward_strategy``): the tensor's, or
    while a plan is collected the device compiled for (its tensors are meta)."""
    collector = COMPILE_ONLY.get()
    return t.device if collector is None else collector.device
