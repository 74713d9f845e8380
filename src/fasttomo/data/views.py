"""Per-view work on several CPU threads: the checks and statistics of a tilt series read every
pixel of the stack (2 GB at 2048^2 x 121), one view at a time, in numpy calls that release the
GIL. Each view is computed alone, so the results are those of a plain loop, whatever the number
of threads."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

import numpy as np

T = TypeVar("T")

VIEW_THREADS = 8
"""At most this many threads (and never more than the CPUs this process may run on)."""

SERIAL_BELOW = 1 << 22
"""A series of fewer pixels than this (a 2048^2 view) is done in a plain loop: for it a thread
pool costs more than it saves."""


def view_threads(n_views: int, pixels: int) -> int:
    """Threads for ``n_views`` views of ``pixels`` pixels in all: 1 below :data:`SERIAL_BELOW`
    pixels, else up to :data:`VIEW_THREADS`, the usable CPUs and the number of views."""
    if pixels < SERIAL_BELOW or n_views < 2:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(VIEW_THREADS, cpus, n_views))


def map_views(fn: Callable[[int], T], n_views: int, pixels: int) -> list[T]:
    """``[fn(0), ..., fn(n_views - 1)]``, on :func:`view_threads` threads; an exception of any
    call is raised here (the first view's in view order)."""
    threads = view_threads(n_views, pixels)
    if threads == 1:
        return [fn(i) for i in range(n_views)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fasttomo-views") as pool:
        return list(pool.map(fn, range(n_views)))


def permute_views(a, order) -> None:
    """Puts the views (first axis) of the array ``a`` in ``order`` in place: afterwards ``a[i]``
    holds what ``a[order[i]]`` held. Cycle by cycle, with one view's copy as the only extra memory
    (``np.argsort(order)`` puts them back)."""
    order = np.asarray(order)
    if sorted(order.tolist()) != list(range(len(a))):
        raise ValueError(f"permute_views: order must be a permutation of 0..{len(a) - 1}, got {order.tolist()}")
    done = order == np.arange(len(a))
    spare = None
    for start in range(len(a)):
        if done[start]:
            continue
        spare = np.empty_like(a[0]) if spare is None else spare
        spare[...] = a[start]
        i = start
        while order[i] != start:  # a[i] takes a[order[i]], read before it is written in its turn
            a[i] = a[order[i]]
            done[i] = True
            i = int(order[i])
        a[i] = spare
        done[i] = True
