#!/usr/bin/env python
"""probe_smem_scatter: can this GPU image accumulate the interpolation's plane gradients in shared
memory, and how fast is that against global atomics?

The texel-run backward is bound by its global fp32 atomics (docs/kernels.md). The counts say a
backward that stages a whole coarse plane (scale 50 or 100) in shared memory and flushes it once
would issue a small fraction of them, but Triton 3.6 (the device image's) has no scatter into
shared memory. torch compiles CUDA C++ at run time through NVRTC (``torch.cuda._compile_kernel``,
a private API): this probe asks whether that works here, and
times the scatter at the heart of such a backward, alone:

    bilinear scatter of N points x C channels into T planes of S x S texels (channels innermost),
    weights and gradients given, every point's 4 corners:
      smem    ``--blocks`` blocks a plane, each a slice of the points: the plane in shared memory,
              zeroed, the points' adds (atomicAdd on shared memory: a compare-and-swap loop in
              sm_90's machine code, not one instruction), one global atomic per touched texel
      fixed   smem with the tile in 32-bit fixed point (2^22 / max|g|), whose shared adds are native
              integer instructions; its sums do not depend on their order
      global  the same adds straight into global memory, one point a thread on a grid of its own
              (what a backward without staging pays)
      torch   index_add_ of the 4 corners (the reference, and torch's own cost)

Points are uniform in the plane (independent pixels at a coarse scale), one thread a point, so the
lanes of a warp hit unrelated texels. The parity check compares each kernel with a float64
index_add_. Prints a table (with each kernel's adds a second), writes
benchmarks/results/probe_smem_scatter-coarse-planes-<device>-<commit>.json.

    python scripts/probe_smem_scatter.py                    # scale 50 (C 16) and 100 (C 4), T 8
    python scripts/probe_smem_scatter.py --points 1638400 --sizes 50 --channels 16
    python scripts/probe_smem_scatter.py --emulate    # no GPU: the CUDA source compiled for the CPU
                                                      # (scripts/cuda_probe.py) against the reference

At the flagship (1.64 M points, T = 8, C = 48, 3 plane kinds) a scale's whole backward scatter is
the measured call times 3 kinds x 48 / C channel passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SOURCE = r"""
#define CH {channels}
struct AsFloat {{  // the value as it is
  __device__ float operator()(float v) const {{ return v; }}
}};
struct AsFixed {{  // 32-bit fixed point: integer adds on shared memory are one native instruction on
  float scale;     // sm_90 (float adds a compare-and-swap loop), and exact, so their order does not matter
  __device__ int operator()(float v) const {{ return __float2int_rn(v * scale); }}
}};

// point p of plane t: its 4 bilinear corners, CH channels each, added into the plane at dst
// (the block's shared tile or the global output: inlined, so each keeps its own address space)
template <typename T, typename Conv>
__device__ __forceinline__ void add_corners(const float* __restrict__ uv, const float* __restrict__ g, T* dst,
                                            int t, int n, int p, int size, Conv conv) {{
  float x = uv[(size_t)(t * n + p) * 2] * (size - 1);
  float y = uv[(size_t)(t * n + p) * 2 + 1] * (size - 1);
  int x0 = min((int)x, size - 2), y0 = min((int)y, size - 2);
  float fx = x - x0, fy = y - y0;
  float w00 = (1.f - fx) * (1.f - fy), w01 = fx * (1.f - fy), w10 = (1.f - fx) * fy, w11 = fx * fy;
  const float* gp = g + (size_t)(t * n + p) * CH;
  T* b = dst + (y0 * size + x0) * CH;
#pragma unroll
  for (int c = 0; c < CH; ++c) {{
    float v = gp[c];
    atomicAdd(b + c, conv(w00 * v));
    atomicAdd(b + CH + c, conv(w01 * v));
    atomicAdd(b + size * CH + c, conv(w10 * v));
    atomicAdd(b + size * CH + CH + c, conv(w11 * v));
  }}
}}

// one block: a slice of one plane's points into the plane staged in shared memory, then one global
// add per touched texel (scale 0: float tile; else a fixed-point tile of value x scale)
template <typename T, typename Conv>
__device__ __forceinline__ void staged(const float* __restrict__ uv, const float* __restrict__ g,
                                       float* __restrict__ out, int n, int size, int per_block, Conv conv,
                                       float scale) {{
  extern __shared__ __align__(16) unsigned char raw[];
  T* tile = reinterpret_cast<T*>(raw);
  const int texels = size * size * CH;
  const int t = blockIdx.y;
  for (int i = threadIdx.x; i < texels; i += blockDim.x) tile[i] = 0;
  __syncthreads();
  const int end = min(n, (int)blockIdx.x * per_block + per_block);
  for (int p = blockIdx.x * per_block + threadIdx.x; p < end; p += blockDim.x)
    add_corners(uv, g, tile, t, n, p, size, conv);
  __syncthreads();
  float* o = out + (size_t)t * texels;
  for (int i = threadIdx.x; i < texels; i += blockDim.x) {{
    T v = tile[i];
    if (v != 0) atomicAdd(o + i, scale == 0.f ? (float)v : (float)v / scale);
  }}
}}

extern "C" __global__ void scatter_smem(const float* __restrict__ uv, const float* __restrict__ g,
                                        float* __restrict__ out, int n, int size, int per_block) {{
  staged<float>(uv, g, out, n, size, per_block, AsFloat(), 0.f);
}}

extern "C" __global__ void scatter_smem_fixed(const float* __restrict__ uv, const float* __restrict__ g,
                                              float* __restrict__ out, int n, int size, int per_block,
                                              double scale) {{  // a Python float arrives as a double
  staged<int>(uv, g, out, n, size, per_block, AsFixed{{(float)scale}}, (float)scale);
}}

extern "C" __global__ void scatter_global(const float* __restrict__ uv, const float* __restrict__ g,
                                          float* __restrict__ out, int n, int size, int per_block) {{
  float* o = out + (size_t)blockIdx.y * size * size * CH;
  const int end = min(n, (int)blockIdx.x * per_block + per_block);
  for (int p = blockIdx.x * per_block + threadIdx.x; p < end; p += blockDim.x)
    add_corners(uv, g, o, blockIdx.y, n, p, size, AsFloat());
}}
"""


# the kernels' launch on the CPU (scripts/cuda_probe.py): blocks one after another
GLUE = r"""
extern "C" void run(const char* which, int gx, int gy, size_t shared, void** a, int n, int size, int per_block,
                    double scale) {
  set_shared(shared);
  gridDim = Dim{(unsigned)gx, (unsigned)gy, 1};
  for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
    blockIdx = Dim{(unsigned)x, (unsigned)y, 0};
    const float* uv = (const float*)a[0];
    const float* g = (const float*)a[1];
    float* out = (float*)a[2];
    if (which[0] == 's') scatter_smem(uv, g, out, n, size, per_block);
    else if (which[0] == 'f') scatter_smem_fixed(uv, g, out, n, size, per_block, scale);
    else scatter_global(uv, g, out, n, size, per_block);
  }
}
"""


def emulate() -> int:
    """The CUDA source compiled for the CPU, each kernel on a small case, against :func:`reference`."""
    import ctypes

    from cuda_probe import build

    gen = torch.Generator().manual_seed(0)
    t_n, n, size, ch, blocks = 3, 500, 6, 4, 4
    uv = torch.rand(t_n, n, 2, generator=gen)
    uv[0, :5] = 1.0  # on the far border: the last cell, fraction 1
    g = torch.randn(t_n, n, ch, generator=gen)
    ref = reference(uv, g, size)
    lib = build(SOURCE.format(channels=ch), "extern __shared__ __align__(16) unsigned char raw[];", GLUE)
    errs = {}
    for which in ("smem", "fixed", "global"):
        out = torch.zeros(t_n, size, size, ch)
        arr = (ctypes.c_void_p * 3)(uv.data_ptr(), g.data_ptr(), out.data_ptr())
        per_block = -(-n // blocks)
        lib.run(which.encode(), blocks, t_n, ctypes.c_size_t(size * size * ch * 4), arr, n, size, per_block,
                ctypes.c_double(2.0 ** 20))
        errs[which] = float((out.double() - ref).norm() / ref.norm())
    ok = all(e < (1e-5 if w == "fixed" else 1e-6) for w, e in errs.items())
    print(f"emulated on the CPU, {t_n} planes of {size}^2 x {ch}, {n} points each: relative errors against "
          f"the float64 reference {errs}\nparity: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def reference(uv: torch.Tensor, g: torch.Tensor, size: int, dtype=torch.float64) -> torch.Tensor:
    """(T, size, size, C) by index_add_ of the four corners (the same corner and weight rules)."""
    t_n, n, _ = uv.shape
    c = g.shape[-1]
    x = uv[..., 0].to(dtype) * (size - 1)
    y = uv[..., 1].to(dtype) * (size - 1)
    x0 = x.floor().clamp(max=size - 2).long()
    y0 = y.floor().clamp(max=size - 2).long()
    fx, fy = x - x0, y - y0
    out = torch.zeros(t_n * size * size, c, dtype=dtype, device=uv.device)
    base = torch.arange(t_n, device=uv.device)[:, None] * size * size
    gd = g.to(dtype)
    for dy, dx, w in ((0, 0, (1 - fx) * (1 - fy)), (0, 1, fx * (1 - fy)), (1, 0, (1 - fx) * fy), (1, 1, fx * fy)):
        idx = (base + (y0 + dy) * size + x0 + dx).reshape(-1)
        out.index_add_(0, idx, (w[..., None] * gd).reshape(-1, c))
    return out.reshape(t_n, size, size, c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=1_638_400, help="points a plane (the flagship's batch)")
    ap.add_argument("--frames", type=int, default=8, help="planes (the flagship's T)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 100])
    ap.add_argument("--channels", type=int, nargs="+", default=None,
                    help="channels a pass, one per size (default: the most of 16, 8, 4, 2 that fit 200 KiB, "
                         "or 48 KiB where torch cannot configure more)")
    ap.add_argument("--blocks", type=int, default=16, help="blocks a plane (each flushes its tile once)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--emulate", action="store_true", help="check the CUDA source on the CPU (no GPU)")
    args = ap.parse_args()
    if args.emulate:
        raise SystemExit(emulate())

    from benchlib import cuda_times_ms, device_name, write_result

    from cuda_probe import compile_kernel, shared_limit

    optin = shared_limit("probe_smem_scatter")
    large = optin >= 48 * 1024
    limit = min(optin, 200 * 1024)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"torch {torch.__version__}, NVRTC through torch.cuda._compile_kernel; shared memory a block up to "
          f"{limit} bytes ({'configurable' if large else 'not configurable past 48 KiB in this torch'})")
    for k, size in enumerate(args.sizes):
        if args.channels:
            ch = args.channels[k]
        else:
            ch = next((c for c in (16, 8, 4, 2) if size * size * c * 4 <= limit), 1)
        smem = size * size * ch * 4
        if smem > limit:
            raise SystemExit(f"probe_smem_scatter: {size}^2 x {ch} channels need {smem} bytes of shared memory; "
                             f"this torch allows {limit} a block")
        src = SOURCE.format(channels=ch)
        try:
            k_smem = compile_kernel(src, "scatter_smem", smem)
            k_glob = compile_kernel(src, "scatter_global")
            k_fixed = compile_kernel(src, "scatter_smem_fixed", smem)
        except Exception as exc:  # noqa: BLE001  (the answer to the probe's first question)
            raise SystemExit(f"probe_smem_scatter: NVRTC compile failed: {type(exc).__name__}: {exc}") from exc
        t_n, n = args.frames, args.points
        uv = torch.rand(t_n, n, 2, device=dev, generator=gen)
        g = torch.randn(t_n, n, ch, device=dev, generator=gen)
        out = torch.zeros(t_n, size, size, ch, device=dev)
        per_block = -(-n // args.blocks)
        grid, block = (args.blocks, t_n, 1), (256, 1, 1)
        grid_g = (-(-n // 256), t_n, 1)  # global atomics want every SM busy: one point a thread

        def smem_call():
            out.zero_()
            k_smem(grid=grid, block=block, args=[uv, g, out, n, size, per_block], shared_mem=smem)

        # fixed point: 2^22 / max|g| leaves a block's texel +-512 max|g| (2^31 / scale) of range
        scale = float(2 ** 22 / g.abs().max().item())

        def fixed_call():
            out.zero_()
            k_fixed(grid=grid, block=block, args=[uv, g, out, n, size, per_block, scale], shared_mem=smem)

        def global_call():
            out.zero_()
            k_glob(grid=grid_g, block=block, args=[uv, g, out, n, size, 256])

        def torch_call():
            return reference(uv, g, size, dtype=torch.float32)

        ref = reference(uv, g, size)
        errs = {}
        for name, fn in (("smem", smem_call), ("fixed", fixed_call), ("global", global_call)):
            fn()
            torch.cuda.synchronize()
            errs[name] = float((out.double() - ref).norm() / ref.norm())
        times = {name: statistics.median(cuda_times_ms(fn, args.repeat, 3, dev))
                 for name, fn in (("smem", smem_call), ("fixed", fixed_call), ("global", global_call),
                                  ("torch", torch_call))}
        passes = 3 * -(-48 // ch)
        adds = t_n * n * 4 * ch  # per call
        rows.append({"size": size, "channels_per_pass": ch, "shared_bytes": smem, "points": n, "frames": t_n,
                     "blocks_per_plane": args.blocks, "smem_ms": times["smem"], "fixed_ms": times["fixed"],
                     "rel_err_fixed": errs["fixed"], "fixed_scale": scale, "global_ms": times["global"],
                     "torch_ms": times["torch"], "rel_err_smem": errs["smem"], "rel_err_global": errs["global"],
                     "adds_per_call": adds, "smem_G_adds_per_s": adds / times["smem"] / 1e6,
                     "global_G_adds_per_s": adds / times["global"] / 1e6, "flagship_passes": passes,
                     "flagship_smem_ms": times["smem"] * passes, "flagship_global_ms": times["global"] * passes})
    print(f"{'size':>4s} {'C':>3s} {'smem KiB':>8s} {'smem ms':>8s} {'fixed ms':>8s} {'global ms':>9s} "
          f"{'torch ms':>8s} {'G adds/s smem':>13s} {'global':>7s} {'err smem':>9s} {'err fixed':>9s} "
          f"{'err glob':>9s} {'x passes':>8s} {'smem':>7s} {'global':>7s}")
    for r in rows:
        print(f"{r['size']:4d} {r['channels_per_pass']:3d} {r['shared_bytes'] / 1024:8.1f} {r['smem_ms']:8.3f} "
              f"{r['fixed_ms']:8.3f} {r['global_ms']:9.3f} {r['torch_ms']:8.3f} {r['smem_G_adds_per_s']:13.0f} "
              f"{r['global_G_adds_per_s']:7.0f} {r['rel_err_smem']:9.1e} {r['rel_err_fixed']:9.1e} "
              f"{r['rel_err_global']:9.1e} "
              f"{r['flagship_passes']:8d} {r['flagship_smem_ms']:7.2f} {r['flagship_global_ms']:7.2f}")
    path = write_result("probe_smem_scatter", "coarse-planes", device_name(dev), rows,
                        out_dir=Path(args.out_dir) if args.out_dir else None, shared_limit_bytes=limit)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
