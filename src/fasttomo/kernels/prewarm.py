"""Load the fused kernels in a background thread while a GPU run starts up.

Before the first kernel comes from Triton's cache, a GPU run pays for importing triton and the
kernel module (about 0.8 s on an H200), for Triton's cache key (a hash of its own installation,
about 0.4 s, read from Triton's cache folder where an earlier run left it:
``kernels/triton/key.py``). ``start()`` runs
that work, and the import of Triton's gluon package (otherwise paid at the first launch), in a
daemon thread from the command's entry point once the config is composed and valid (--help and
config errors never import torch), while the main thread opens the run folder and reads the data;
the hashing and file reading release the GIL, so they overlap. ``wait()`` joins the thread at
the start of ``build`` (before the model and the kernels are used), so nothing runs beside it from
then on. With a warm cache this brings the default run's first step on an H200 from about 1.9 s
to about 0.8 s (benchmarks/README.md).

``warm_device`` (called by the pipeline once the run's device is known, before it reads the data)
creates the device's context, loads cuBLAS (otherwise loaded by the first matrix product) and
makes Triton's CUDA driver object (its utility library; otherwise made at the first launch) in a
second thread. Any failure in a thread is ignored: the door
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
        from fasttomo.kernels.triton.key import remember_triton_key

        remember_triton_key()  # read from Triton's cache folder, or hashed once and left there
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
        import importlib.util

        if importlib.util.find_spec("triton") is not None:
            from triton.runtime import driver

            with torch.cuda.device(dev):
                driver.active.get_current_target()  # Triton's CUDA driver, else made at the first launch
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
