"""Whole-step CUDA-graph capture: forward, backward and the Adam update recorded once, replayed
every later step.

Small steps (the embedded default: 49 k sample points) are bound by per-operation launch and
Python overhead on a GPU, not by the kernels; one graph replay removes that overhead. The captured
step is the eager step itself (``Trainer._step_body``), fed from static input buffers:

* the batch is copied into static tensors before each replay (5 tiny copies);
* the regularizer's random numbers are drawn OUTSIDE the graph from the same generator as in
  eager mode and copied in, so a captured run draws exactly the eager run's random stream;
* learning rates live in device tensors updated in place (Adam(capturable=True));
* the first ``WARMUP`` steps run eagerly on a side stream (kernel autotuning, lazy tables,
  allocator warm-up), as the CUDA-graph documentation of PyTorch prescribes.

A step can be captured only when it is free of host synchronization and of shape changes; see
:func:`capture_problem` for the rules. Anything else runs eagerly.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

log = logging.getLogger("fasttomo.train")

WARMUP = 3


def capture_problem(device: torch.device, world_size: int, *, dtype: str = "fp32", svd_rotations: bool = False,
                    drop_last: bool = True) -> str | None:
    """Why a training step cannot be captured, or None when it can: on ``device`` with
    ``world_size`` processes, autocast ``dtype`` (precision.dtype), learned frame rotations
    parametrized by SVD (``svd_rotations``) and the sampler's ``drop_last``."""
    if device.type != "cuda":
        return "the device is not CUDA"
    if world_size > 1:
        return "DDP runs are not captured (gradient all-reduce hooks)"
    if dtype == "fp16":
        return "fp16's GradScaler checks for inf/NaN on the host every step"
    if svd_rotations:
        return "learned 'svd' rotations run torch.linalg.svd, which synchronizes on CUDA (use model.rotation_param=quaternion)"
    if not drop_last:
        return "sampler.drop_last=false yields a short last batch (shapes must be fixed)"
    return None


class GraphedStep:
    """Callable like ``Trainer._step_body(batch, noise)``; captures on the first call after warm-up."""

    def __init__(self, body, optimizer: torch.optim.Optimizer, device: torch.device):
        self.body = body
        self.optimizer = optimizer
        self.device = device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self.replays = 0
        self._side = torch.cuda.Stream(device)
        self._batch = None
        self._noise = None
        self._out = None
        self.capture_seconds = 0.0  # wall time of the capture (synchronized), for the run's timeline
        tensor_lrs(optimizer, device)

    def __call__(self, batch, noise):
        self.calls += 1
        if self.calls <= WARMUP:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                out = self.body(batch, noise)
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            return out
        if self.graph is None:
            self._capture(batch, noise)
        self._feed(batch, noise)
        self.graph.replay()
        self.replays += 1
        return self._out

    def _feed(self, batch, noise) -> None:
        for f in dataclasses.fields(batch):
            src, dst = getattr(batch, f.name), getattr(self._batch, f.name)
            if src is not dst:
                dst.copy_(src, non_blocking=True)
        if noise is not None:
            self._noise.copy_(noise, non_blocking=True)

    def _capture(self, batch, noise) -> None:
        import time

        t = time.perf_counter()
        self._batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).clone()
                                                    for f in dataclasses.fields(batch)})
        self._noise = noise.clone() if noise is not None else None
        self.optimizer.zero_grad(set_to_none=True)  # grads are allocated inside the graph's pool
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self.body(self._batch, self._noise)
        self.graph = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t
        log.info("training step captured in a CUDA graph after %d eager warm-up steps", WARMUP)


def tensor_lrs(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Learning rates as device tensors (a captured Adam step reads them; set them with fill_)."""
    for group in optimizer.param_groups:
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), device=device, dtype=torch.float32)
