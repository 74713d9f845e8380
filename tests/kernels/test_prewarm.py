"""kernels.prewarm: the background load of the fused kernels at a GPU run's start (fresh processes)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

CHILD = r"""
import json, sys
from fasttomo.kernels import prewarm
started = prewarm.start()
again = prewarm.start()
prewarm.wait()
out = {"started": started, "again": again, "ops_loaded": "fasttomo.kernels.triton.ops" in sys.modules}
if started:
    from triton.runtime.cache import triton_key
    out["key_cached"] = triton_key.cache_info().currsize == 1
    out["gluon_loaded"] = "triton.experimental.gluon" in sys.modules
out["device_started"] = prewarm.warm_device(0) if started else None
prewarm.wait()
if started:
    import torch
    out["context"] = torch.cuda.is_initialized()
print(json.dumps(out))
"""


def _child() -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU case (this machine has a GPU)")
def test_without_a_gpu_nothing_is_loaded():
    assert _child() == {"started": False, "again": False, "ops_loaded": False, "device_started": None}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton")),
                    reason="needs a CUDA GPU and triton")
def test_on_a_gpu_the_kernels_the_cache_key_and_the_device_are_ready_after_wait():
    assert _child() == {"started": True, "again": False, "ops_loaded": True, "key_cached": True, "gluon_loaded": True,
                        "device_started": True, "context": True}


# --------------------------------------------------------------------------------------- what it relies on
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_triton_internals_the_thread_warms_still_exist():
    """The thread's work (run here without a GPU, in a fresh process): it imports the op module and
    fills ``triton.runtime.cache.triton_key``'s functools cache, the private function a kernel
    launch calls; if Triton renames it or drops the cache, this fails and prewarm.py needs a look."""
    code = r"""
import json, sys
from triton.runtime.cache import triton_key
from fasttomo.kernels import prewarm
before = triton_key.cache_info().currsize
prewarm._work()
print(json.dumps({"before": before, "after": triton_key.cache_info().currsize,
                  "ops": "fasttomo.kernels.triton.ops" in sys.modules}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"before": 0, "after": 1, "ops": True}
