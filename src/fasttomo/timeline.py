"""Seconds since this process started (not since an import): the clock of the fixed costs.

``since_start()`` counts from the moment the operating system started the process (Linux:
``/proc/self/stat``), so interpreter start-up and imports are included; elsewhere it counts from
the first import of this module. Used for the run's ``timeline`` in metrics.json and by
``scripts/bench_step.py`` (process start to the first training step). ``peak_rss_bytes()`` is the
process's peak resident memory so far, recorded at the same phase borders.
"""

from __future__ import annotations

import os
import time


def _seconds_since_process_start() -> float | None:
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_AGO = _seconds_since_process_start()
PROCESS_START = time.perf_counter() - (_AGO or 0.0)
"""perf_counter() value at process start (at this module's import where the OS does not say)."""
EXACT = _AGO is not None


def since_start(t: float | None = None) -> float:
    """Seconds from process start to perf_counter() value ``t`` (default: now)."""
    return (time.perf_counter() if t is None else t) - PROCESS_START


def peak_rss_bytes() -> int | None:
    """The process's own peak resident memory so far (Linux: VmHWM of /proc/self/status), or
    None. Not getrusage's ru_maxrss on Linux: a process started by another (fork or vfork, then
    exec) reports the larger of its own peak and its parent's peak at the start there (a
    benchmark that simulated a 4096^2 series before starting the run passes on its 25 GB)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
        import sys

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(kb) * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError, ValueError):
        return None
