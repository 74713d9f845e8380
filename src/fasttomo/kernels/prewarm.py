"""Load the fused kernels in a background thread while a GPU run starts up.

A GPU run's first step paid about 1.8 s with a warm Triton cache on an H200 (b70b6da,
benchmarks/results/first_step-profile-NVIDIA-H200-b70b6da.json): importing triton and the kernel
module (about 0.8 s), and Triton's cache key, a hash of its own installation computed once per
process (0.4 s, ``triton.runtime.cache.triton_key``), before the first kernel came from the cache.
``start()`` runs that work in a daemon thread from the command's entry point, while the main thread
composes the config, opens the run folder and reads the data; the hashing and file reading release
the GIL, so they overlap. ``wait()`` joins the thread at the start of ``build`` (before the model
and the kernels are used), so nothing runs beside it from then on. Measured: the default run's
first step 1.9 s -> 0.8 s with a warm cache (b70b6da -> bb1bf7e, one H200). Any failure in the thread is ignored: the door
(``dispatch``) loads the kernels itself and reports a problem where it matters.
"""

from __future__ import annotations

import threading

_thread: threading.Thread | None = None


def _work() -> None:
    try:
        from fasttomo.kernels.triton import ops  # noqa: F401  imports triton, registers the ops

        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # another Triton layout: the first compile computes it instead
            return
        triton_key()  # functools.lru_cache: the first kernel launch finds it computed
    except Exception:  # noqa: BLE001  (a broken install is reported by the door, not here)
        pass


def start() -> bool:
    """Start the background load once per process when a CUDA device is visible; True if started."""
    global _thread
    if _thread is not None:
        return False
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001
        return False
    _thread = threading.Thread(target=_work, name="fasttomo-kernel-prewarm", daemon=True)
    _thread.start()
    return True


def wait() -> None:
    """Join the background load if one was started (no-op otherwise)."""
    if _thread is not None:
        _thread.join()
