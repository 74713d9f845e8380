"""Load the fused kernels in a background thread while a GPU run starts up.

A GPU run's first step paid about 1.8 s with a warm Triton cache on an H200 (b70b6da,
benchmarks/results/first_step-profile-NVIDIA-H200-b70b6da.json): importing triton and the kernel
module (about 0.8 s), and Triton's cache key, a hash of its own installation computed once per
process (0.4 s, ``triton.runtime.cache.triton_key``), before the first kernel came from the cache.
``start()`` runs that work in a daemon thread from the command's entry point, while the main thread
composes the config, opens the run folder and reads the data; the hashing and file reading release
the GIL, so they overlap. ``wait()`` joins the thread at the start of ``build`` (before the model
and the kernels are used), so nothing runs beside it from then on. Measured: the default run's
first step 1.9 s -> 0.8 s with a warm cache (b70b6da -> bb1bf7e, one H200).

A profile of that 0.8-1.0 s first step at 24b9dd2 (.gpu-style cProfile, one H200) still showed
Triton's gluon package imported at the first launch (0.15 s) and cuBLAS loaded by the first matrix
product (0.1 s, the fixed poses' table). The first thread imports gluon too, and ``warm_device``
(called by the pipeline once the run's device is known, before it reads the data) creates the
device's context and loads cuBLAS in a second thread. Any failure in a thread is ignored: the door
(``dispatch``) loads the kernels itself and the run reports a device problem where it matters.
"""

from __future__ import annotations

import threading

_thread: threading.Thread | None = None
_device_thread: threading.Thread | None = None


def _work() -> None:
    try:
        from fasttomo.kernels.triton import ops  # noqa: F401  imports triton, registers the ops

        try:
            # Triton 3.6 imports its gluon package at the first kernel launch (0.15 s)
            import triton.experimental.gluon  # noqa: F401
        except ImportError:
            pass
        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # another Triton layout: the first compile computes it instead
            return
        triton_key()  # functools.lru_cache: the first kernel launch finds it computed
    except Exception:  # noqa: BLE001  (a broken install is reported by the door, not here)
        pass


def _device_work(index: int) -> None:
    try:
        import torch

        dev = torch.device("cuda", index)
        a = torch.ones(16, 16, device=dev)  # creates the device's context
        a @ a  # loads cuBLAS (fp32)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            a @ a  # and its bf16 path
        torch.cuda.synchronize(dev)
    except Exception:  # noqa: BLE001  (the run reports a broken device where it uses it)
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


def warm_device(index: int) -> bool:
    """Once per process, in a second daemon thread: create CUDA device ``index``'s context and load
    cuBLAS (one tiny fp32 and one bf16 product) while the run reads its data; True if started.
    Called once the run knows it trains on that device (a CPU run never touches the GPU)."""
    global _device_thread
    if _device_thread is not None:
        return False
    _device_thread = threading.Thread(target=_device_work, args=(int(index),), name="fasttomo-device-prewarm",
                                      daemon=True)
    _device_thread.start()
    return True


def wait() -> None:
    """Join the background loads that were started (no-op otherwise)."""
    for t in (_thread, _device_thread):
        if t is not None:
            t.join()
