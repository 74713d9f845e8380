"""Seconds since this process started (not since an import): the clock of the fixed costs.

``since_start()`` counts from the moment the operating system started the process (Linux:
``/proc/self/stat``), so interpreter start-up and imports are included; elsewhere it counts from
the first import of this module. Used for the run's ``timeline`` in metrics.json and by
``scripts/bench_step.py`` (process start to the first training step). ``peak_rss_bytes()`` is the
process's peak resident memory so far, recorded at the same phase borders; ``peak_gpu_bytes()``
torch's peak allocation so far; ``phase_peaks()`` the peaks of both since the last phase border.
"""

from __future__ import annotations

import os
import sys
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


_SEEN = {"host": 0, "gpu": 0}  # the peaks of the phases before the last border (phase_peaks)
_HOST_RESETS = True  # False once the kernel refused to restart VmHWM: later host phases are not apart


def peak_rss_bytes() -> int | None:
    """The process's own peak resident memory so far, or None: the larger of VmHWM (Linux,
    /proc/self/status) and the peaks of the phases :func:`phase_peaks` closed. Not getrusage's
    ru_maxrss on Linux: a process started by another (fork or vfork, then exec) reports the
    larger of its own peak and its parent's peak at the start there (a benchmark that simulated
    a 4096^2 series before starting the run passes on its 25 GB)."""
    hwm = _vm_hwm()
    if hwm is not None:
        return max(hwm, _SEEN["host"])
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(kb) * (1 if sys.platform == "darwin" else 1024)
    except (ImportError, OSError, ValueError):
        return None


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _torch_peak(reset: bool) -> int | None:
    torch = sys.modules.get("torch")  # never imported here: a process without torch has no GPU peak
    if torch is None or not torch.cuda.is_initialized():
        return None
    peak = int(torch.cuda.max_memory_allocated())
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def peak_gpu_bytes() -> int | None:
    """torch's peak GPU allocation in this process so far (the current device), phases
    :func:`phase_peaks` closed included; None where CUDA was never initialized."""
    now = _torch_peak(False)
    return None if now is None else max(now, _SEEN["gpu"])


def phase_peaks() -> dict[str, int | None]:
    """``{"host": bytes, "gpu": bytes}``: the peaks since the last call (or the process start), then
    both counters start again from what is held now (VmHWM restarted through /proc/self/clear_refs,
    torch's peak statistics reset); :func:`peak_rss_bytes` and :func:`peak_gpu_bytes` still give
    the whole process's. ``host`` is None once the kernel did not restart VmHWM (the peak so far
    would not be this phase's); ``gpu`` None without CUDA."""
    global _HOST_RESETS
    host = _vm_hwm() if _HOST_RESETS else None
    gpu = _torch_peak(True)
    if host is not None:
        _SEEN["host"] = max(_SEEN["host"], host)
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")  # 5: reset the peak resident set size (Linux 4.0+)
        except OSError:
            _HOST_RESETS = False
    if gpu is not None:
        _SEEN["gpu"] = max(_SEEN["gpu"], gpu)
    return {"host": host, "gpu": gpu}
