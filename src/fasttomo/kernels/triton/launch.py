"""How the fused kernels' launchers launch: at once, or (in a compile-ahead job, ``ahead.py``)
compile only."""

from __future__ import annotations

import contextvars
import functools

import torch

COMPILE_ONLY: contextvars.ContextVar = contextvars.ContextVar("fasttomo_compile_only", default=None)
"""While ``ahead.start`` runs a plan's launchers: its collector (``.device``: the CUDA device to
compile for; ``.add(kernel, grid, args, kwargs)``: one launch to compile), else None."""


FP_FUSION = True
"""Multiply-adds contracted into one rounding (fma), as every kernel here was measured and checked:
Triton's default up to 3.9, which warns that 3.10 turns it off. Each launch says so unless it asks
otherwise (the rays' samples kernel rounds each product and sum, as its twin)."""


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` (with ``enable_fp_fusion=FP_FUSION`` unless given), or
    while ``ahead.start`` collects a plan: hand the launch to the collector, which compiles it
    (``JITFunction.warmup``) in its pool."""
    kwargs.setdefault("enable_fp_fusion", FP_FUSION)
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


def sum_parts(t: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``t.sum()`` (or over ``dim``) of a launch's partial results; while a plan is collected (its
    tensors are meta) only the result's shape: torch's meta reductions import sympy and torch's
    symbolic shapes (0.4 s on the 2-core CPU, 3.1 s in a warm H200 run, where torch compiles
    their sources), which a run never needs otherwise. For the same reason the launchers make
    their outputs with ``torch.empty`` of a shape, not ``torch.empty_like`` (whose meta path
    imports them too)."""
    if COMPILE_ONLY.get() is None:
        return t.sum() if dim is None else t.sum(dim=dim)
    return t.new_empty(() if dim is None else t.shape[:dim] + t.shape[dim + 1:])


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA device (asked once per device), 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
