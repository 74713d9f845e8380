"""``torch.optim.Adam`` without the 3.6 s import of ``torch._dynamo`` at a run's start.

``torch.optim`` wraps ``Optimizer.add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` in ``torch._disable_dynamo`` and ``Adam.step`` in
``_use_grad_for_differentiable``; both wrappers import ``torch._dynamo`` on their first call, which
costs seconds at a run's start (3.6 s of a 12.5 s default run on an H200; benchmarks/README.md)
although nothing in a run is compiled.
This class calls torch's own methods through the functions those wrappers wrap
(``inspect.unwrap``): the same code, the same state and checkpoints, minus the wrappers, whose
only effect outside ``torch.compile`` is that import (and, for ``step``, running it under
``torch.no_grad``, which ``step`` here does itself). Never compile a function that calls these
methods (fasttomo does not): dynamo would trace into them instead of skipping them.
"""

from __future__ import annotations

import inspect

import torch

_Optimizer = torch.optim.Optimizer


def _raw(fn):
    return inspect.unwrap(fn)


class Adam(torch.optim.Adam):
    """torch.optim.Adam (same arguments, state and state_dict) without importing torch._dynamo."""

    def __init__(self, params, **kwargs) -> None:
        if kwargs.get("differentiable"):
            raise ValueError("fasttomo.train.adam.Adam: differentiable=True is not supported; use torch.optim.Adam")
        super().__init__(params, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        _raw(_Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _raw(_Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self):
        return _raw(_Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict) -> None:
        _raw(_Optimizer.load_state_dict)(self, state_dict)

    def step(self, closure=None):
        with torch.no_grad():  # what torch's wrapper does for differentiable=False
            return _raw(torch.optim.Adam.step)(self, closure)
