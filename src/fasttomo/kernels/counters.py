"""The kernel door's spy: how often each op took which path (a plain module, no imports of the
rest of ``fasttomo.kernels``, so the door and the custom ops both write here without a cycle).

``counters[op][path]`` with path 'triton', 'cpu' (``kernels/cpu.py``) or 'torch'; backward
passes count as '<op>_bwd'. Nothing is counted while torch.compile traces. ``reset()`` clears the
table in place (``dispatch.counters`` is the same dict).
"""

from __future__ import annotations

import torch

counters: dict[str, dict[str, int]] = {}


def count(op: str, path: str) -> None:
    if torch.compiler.is_compiling():
        return
    d = counters.setdefault(op, {})
    d[path] = d.get(path, 0) + 1


def reset() -> None:
    counters.clear()
