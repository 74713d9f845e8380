"""glibc malloc settings for CPU training (Linux): keep the step's large buffers in the heap.

A CPU training step allocates and frees tens of tensors of a few MB each. With glibc's defaults
such blocks are served by mmap (or returned to the system by heap trimming) and every reuse
touches fresh pages: on the embedded default run (2 cores) about 14,000 page faults and 33 ms of
system time per 87 ms step. Raising the mmap threshold to its maximum (32 MiB on 64-bit) and the
trim threshold to 1 GiB keeps those blocks in the heap: 0-90 faults and 6-8 ms of system time per
step, and the CPU step about 40 % faster (benchmarks/README.md). The price: up to the trim
threshold of freed memory stays with the process until it exits.

The settings are process-wide and are applied once, by :func:`tune_cpu_allocator`, which the
builder calls for a CPU run. ``FASTTOMO_MALLOC_TUNING=0`` turns it off; other C libraries (musl,
macOS, Windows) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Blocks above this still come from mmap (glibc's largest accepted value on 64-bit: 32 MiB)."""
TRIM_THRESHOLD = 1 << 30
"""Free memory at the top of the heap is returned to the system only beyond this."""

_applied: bool | None = None


def tune_cpu_allocator() -> bool:
    """Apply the settings once per process; True when they are in effect (glibc on Linux, not
    turned off by FASTTOMO_MALLOC_TUNING=0)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("FASTTOMO_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("malloc tuning for CPU training: %s", "on" if _applied else "refused by the C library")
    return _applied
