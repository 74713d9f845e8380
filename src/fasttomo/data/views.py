"""Per-view work on several CPU threads: the checks and statistics of a tilt series read every
pixel of the stack (2 GB at 2048^2 x 121), one view at a time, in numpy calls that release the
GIL. Each view is computed alone, so the results are those of a plain loop, whatever the number
of threads."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

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
