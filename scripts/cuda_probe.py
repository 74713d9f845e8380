"""cuda_probe: what the CUDA probes (probe_smem_scatter.py, probe_smem_backward.py) share.

``compile_kernel`` compiles a kernel through torch's NVRTC route (``torch.cuda._compile_kernel``),
first loading NVRTC from the nvidia-cuda-nvrtc wheel beside torch where the process cannot find it
by its name (torch looks for ``libnvrtc.so.<major>`` on the library path only).

``build`` compiles a probe's CUDA C++ source for the CPU, to check its logic without a GPU. The
header below defines the CUDA names the probes use for a C++ compiler: every block runs with
one thread, so a block's strided loops run in order and its barriers hold; atomics are plain adds;
``extern __shared__`` buffers point at one host buffer (the source's declaration line is given to
:func:`build` to be replaced). The caller's ``glue`` defines ``extern "C"`` functions that set
``gridDim`` / ``blockIdx`` and call the kernels; ctypes loads the library.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import subprocess
import tempfile
from pathlib import Path


def shared_limit(probe: str) -> int:
    """The bytes of shared memory a probe's block may take on this GPU with this torch (blocks past
    48 KiB need ``set_shared_memory_config``, which older torches lack); exits naming what is
    missing where there is no GPU or no NVRTC route."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{probe}: needs a CUDA GPU (or --emulate)")
    if not hasattr(torch.cuda, "_compile_kernel"):
        raise SystemExit(f"{probe}: torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)")
    from torch.cuda._utils import _CudaKernel

    if not hasattr(_CudaKernel, "set_shared_memory_config"):
        return 48 * 1024 - 1
    return torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin


def compile_kernel(source: str, name: str, shared: int = 0):
    """``torch.cuda._compile_kernel(source, name)``, configured for ``shared`` bytes of dynamic shared
    memory a block where that is 48 KiB or more; where NVRTC is not found by its name, the wheel's
    library is loaded by its path (process-wide) and the compile tried once more."""
    import torch

    try:
        kernel = torch.cuda._compile_kernel(source, name)
    except OSError:
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
        folders = list(spec.submodule_search_locations or []) if spec else []
        libs = [lib for f in folders for lib in sorted(glob.glob(os.path.join(f, "lib", "libnvrtc.so*")))
                if "builtins" not in lib and ".alt." not in lib]
        if not libs:
            raise
        ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)
        kernel = torch.cuda._compile_kernel(source, name)
    if shared >= 48 * 1024:
        kernel.set_shared_memory_config(shared)
    return kernel

HEADER = r"""
#include <math.h>
#include <stdlib.h>
#include <cstddef>
#include <algorithm>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __align__(n)
#define __syncthreads()
struct Dim { unsigned x, y, z; };
static Dim threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static unsigned char* g_shared = nullptr;
using std::min;
static inline float atomicAdd(float* a, float v) { float o = *a; *a += v; return o; }
static inline int atomicAdd(int* a, int v) { int o = *a; *a += v; return o; }
static inline int __float2int_rn(float v) { return (int)nearbyintf(v); }
static void set_shared(size_t bytes) { g_shared = (unsigned char*)realloc(g_shared, bytes + 64); }
"""


def build(source: str, shared_decl: str, glue: str) -> ctypes.CDLL:
    """The library of ``source`` (its ``shared_decl`` line made a pointer to the host buffer) and
    ``glue``, compiled with $CXX (default c++)."""
    if shared_decl not in source:
        raise ValueError(f"cuda_emulation: {shared_decl!r} is not in the source")
    code = HEADER + source.replace(shared_decl, "unsigned char* raw = g_shared;") + glue
    work = Path(tempfile.mkdtemp(prefix="cuda_emulation_"))
    (work / "k.cpp").write_text(code)
    cxx = os.environ.get("CXX", "c++")
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", str(work / "k.cpp"), "-o", str(work / "k.so")],
                   check=True)
    return ctypes.CDLL(str(work / "k.so"))
