#!/usr/bin/env python
"""probe_smem_backward: the interpolation's backward for one coarse scale with the gradients of
its planes staged in shared memory (CUDA C++ through NVRTC), against the Triton texel-run backward.

docs/kernels.md ("Patch batches and a shared-memory backward") counts what staging the coarse
planes would save: a block that holds the three planes of one (frame, channel chunk) of scale 50
in shared memory flushes each texel once instead of once per texel run. Triton 3.6 cannot scatter
into shared memory; torch's NVRTC route can (``scripts/probe_smem_scatter.py`` times the scatter
alone). This is the whole backward of one scale as the flagship's training step needs it: the
plane gradients and the frame matrices' gradient (dL/dM_t, the sum of dL/dq p^T; no point
gradients, which only pose refinement asks for):

    block = (slice of the points, frame t, chunk of CH channels); shared memory: the xy, xz and yz
    planes of (t, chunk) as float (``smem``) or 32-bit fixed point (``fixed``: native integer adds,
    exact sums in any order); per point: q = M_t p, the 12 corner texels of the chunk from global
    memory, the product rule, the 48 / 4 x CH adds into the tile, dL/dq's part from the chunk's
    channels into the thread's 9 partial sums of dq p^T; then one global add per touched texel and
    the block's 9 sums into its own slot (summed on the host in a fixed order)

Parity against ``kplanes_backward`` (Triton, texel runs) on the same inputs, then CUDA-event
times of both. The flagship's points (8192 rays x 200 samples of random tilts), T = 8, C = 48, one
scale of 50 (or ``--scale``). Prints a table, writes
benchmarks/results/probe_smem_backward-<case>-<device>-<commit>.json.

    python scripts/probe_smem_backward.py                     # scale 50, CH 4, float and fixed
    python scripts/probe_smem_backward.py --scale 100 --chunk 1
    python scripts/probe_smem_backward.py --emulate           # no GPU: the same CUDA source compiled
                                                              # for the CPU (one thread a block) on a
                                                              # small case, against the torch twin
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))

from fasttomo.kernels.layout import PlaneLayout  # noqa: E402

SOURCE = r"""
#define C {channels}
#define CH {chunk}
struct AsFloat {{
  typedef float acc;
  __device__ float operator()(float v) const {{ return v; }}
  __device__ float back(float v) const {{ return v; }}
}};
struct AsFixed {{
  typedef int acc;
  float scale;
  __device__ int operator()(float v) const {{ return __float2int_rn(v * scale); }}
  __device__ float back(int v) const {{ return (float)v / scale; }}
}};

// grid_sample(align_corners=True, padding_mode='border') along one axis, as the Triton kernel:
// cell index in [0, size-2], fraction, and d(coordinate)/dq ((size-1)/2 inside, 0 clamped)
__device__ __forceinline__ void axis(float q, int size, int* i0, float* f, float* d) {{
  float sm1 = (float)(size - 1);
  float x = (q + 1.f) * 0.5f * sm1;
  float xc = fminf(fmaxf(x, 0.f), sm1);
  float i = fminf(floorf(xc), sm1 - 1.f);
  *i0 = (int)i;
  *f = xc - i;
  *d = (x > 0.f && x < sm1) ? sm1 * 0.5f : 0.f;
}}

// one plane's 4 corners of channel c: value, d/du, d/dv (u the column axis, v the row axis)
__device__ __forceinline__ void sample(const float* __restrict__ p, int row, float fu, float fv,
                                       float* s, float* su, float* sv) {{
  float v00 = p[0], v01 = p[C], v10 = p[row], v11 = p[row + C];
  *s = v00 * (1.f - fu) * (1.f - fv) + v01 * fu * (1.f - fv) + v10 * (1.f - fu) * fv + v11 * fu * fv;
  *su = (v01 - v00) * (1.f - fv) + (v11 - v10) * fv;
  *sv = (v10 - v00) * (1.f - fu) + (v11 - v01) * fu;
}}

template <typename T, typename Conv>
__device__ __forceinline__ void add4(T* b, int row, float fu, float fv, float g, const Conv& conv) {{
  atomicAdd(b, conv(g * (1.f - fu) * (1.f - fv)));
  atomicAdd(b + CH, conv(g * fu * (1.f - fv)));
  atomicAdd(b + row, conv(g * (1.f - fu) * fv));
  atomicAdd(b + row + CH, conv(g * fu * fv));
}}

template <typename Conv>
__device__ __forceinline__ void backward(const float* __restrict__ grad, const float* __restrict__ pts,
                                         const float* __restrict__ mats, const float* __restrict__ planes,
                                         float* __restrict__ gplanes, float* __restrict__ gm_part,
                                         int n, int f_cols, int col0, int off_xy, int off_xz, int off_yz,
                                         int rx, int ry, int rz, int per_block, Conv conv) {{
  typedef typename Conv::acc T;
  extern __shared__ __align__(16) unsigned char raw[];
  const int t = blockIdx.y, c0 = blockIdx.z * CH, n_rot = gridDim.y;
  const int a_xy = ry * rx * CH, a_xz = rz * rx * CH, a_yz = rz * ry * CH;
  T* t_xy = reinterpret_cast<T*>(raw);
  T* t_xz = t_xy + a_xy;
  T* t_yz = t_xz + a_xz;
  float* red = reinterpret_cast<float*>(t_yz + a_yz);  // the block's 9 sums of dq p^T
  for (int i = threadIdx.x; i < a_xy + a_xz + a_yz; i += blockDim.x) t_xy[i] = 0;
  for (int k = threadIdx.x; k < 9; k += blockDim.x) red[k] = 0.f;
  __syncthreads();
  const float* m = mats + t * 9;
  const float* b_xy = planes + off_xy + (size_t)t * ry * rx * C + c0;
  const float* b_xz = planes + off_xz + (size_t)t * rz * rx * C + c0;
  const float* b_yz = planes + off_yz + (size_t)t * rz * ry * C + c0;
  float gm[9] = {{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}};
  const int end = min(n, (int)blockIdx.x * per_block + per_block);
  for (int p = blockIdx.x * per_block + threadIdx.x; p < end; p += blockDim.x) {{
    float x = pts[3 * (size_t)p], y = pts[3 * (size_t)p + 1], z = pts[3 * (size_t)p + 2];
    int ix, iy, iz;
    float fx, fy, fz, dx, dy, dz;
    axis(m[0] * x + m[1] * y + m[2] * z, rx, &ix, &fx, &dx);
    axis(m[3] * x + m[4] * y + m[5] * z, ry, &iy, &fy, &dy);
    axis(m[6] * x + m[7] * y + m[8] * z, rz, &iz, &fz, &dz);
    const float* gp = grad + (size_t)p * f_cols + col0 + t * C + c0;
    float gx = 0.f, gy = 0.f, gz = 0.f;
    for (int c = 0; c < CH; ++c) {{
      float s1, s1u, s1v, s2, s2u, s2v, s3, s3u, s3v;
      sample(b_xy + (iy * rx + ix) * C + c, rx * C, fx, fy, &s1, &s1u, &s1v);
      sample(b_xz + (iz * rx + ix) * C + c, rx * C, fx, fz, &s2, &s2u, &s2v);
      sample(b_yz + (iz * ry + iy) * C + c, ry * C, fy, fz, &s3, &s3u, &s3v);
      float g = gp[c];
      float g1 = g * s2 * s3, g2 = g * s1 * s3, g3 = g * s1 * s2;
      add4(t_xy + (iy * rx + ix) * CH + c, rx * CH, fx, fy, g1, conv);
      add4(t_xz + (iz * rx + ix) * CH + c, rx * CH, fx, fz, g2, conv);
      add4(t_yz + (iz * ry + iy) * CH + c, ry * CH, fy, fz, g3, conv);
      gx += g1 * s1u + g2 * s2u;
      gy += g1 * s1v + g3 * s3u;
      gz += g2 * s2v + g3 * s3v;
    }}
    gx *= dx; gy *= dy; gz *= dz;
    gm[0] += gx * x; gm[1] += gx * y; gm[2] += gx * z;
    gm[3] += gy * x; gm[4] += gy * y; gm[5] += gy * z;
    gm[6] += gz * x; gm[7] += gz * y; gm[8] += gz * z;
  }}
  for (int k = 0; k < 9; ++k) atomicAdd(red + k, gm[k]);
  __syncthreads();
  // flush: one global add per touched texel of the three planes of (t, chunk)
  float* g_xy = gplanes + off_xy + (size_t)t * ry * rx * C + c0;
  float* g_xz = gplanes + off_xz + (size_t)t * rz * rx * C + c0;
  float* g_yz = gplanes + off_yz + (size_t)t * rz * ry * C + c0;
  for (int i = threadIdx.x; i < a_xy + a_xz + a_yz; i += blockDim.x) {{
    T v = t_xy[i];
    if (v == 0) continue;
    int j = i, c = i % CH;
    float* dst = g_xy;
    if (j >= a_xy + a_xz) {{ j -= a_xy + a_xz; dst = g_yz; }}
    else if (j >= a_xy) {{ j -= a_xy; dst = g_xz; }}
    atomicAdd(dst + (size_t)(j / CH) * C + c, conv.back(v));
  }}
  const size_t slot = (size_t)blockIdx.z * gridDim.x + blockIdx.x;
  for (int k = threadIdx.x; k < 9; k += blockDim.x) gm_part[(slot * n_rot + t) * 9 + k] = red[k];
}}

extern "C" __global__ void coarse_bwd(const float* __restrict__ grad, const float* __restrict__ pts,
                                      const float* __restrict__ mats, const float* __restrict__ planes,
                                      float* __restrict__ gplanes, float* __restrict__ gm_part, int n, int f_cols,
                                      int col0, int off_xy, int off_xz, int off_yz, int rx, int ry, int rz,
                                      int per_block) {{
  backward(grad, pts, mats, planes, gplanes, gm_part, n, f_cols, col0, off_xy, off_xz, off_yz, rx, ry, rz,
           per_block, AsFloat());
}}

extern "C" __global__ void coarse_bwd_fixed(const float* __restrict__ grad, const float* __restrict__ pts,
                                            const float* __restrict__ mats, const float* __restrict__ planes,
                                            float* __restrict__ gplanes, float* __restrict__ gm_part, int n,
                                            int f_cols, int col0, int off_xy, int off_xz, int off_yz, int rx,
                                            int ry, int rz, int per_block, double scale) {{
  backward(grad, pts, mats, planes, gplanes, gm_part, n, f_cols, col0, off_xy, off_xz, off_yz, rx, ry, rz,
           per_block, AsFixed{{(float)scale}});
}}
"""

# the kernels' launch on the CPU (scripts/cuda_probe.py): blocks one after another
GLUE = r"""
extern "C" void run(const char* which, int gx, int gy, int gz, size_t shared, void** a, double scale) {
  set_shared(shared);
  gridDim = Dim{(unsigned)gx, (unsigned)gy, (unsigned)gz};
  for (int z = 0; z < gz; ++z) for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
    blockIdx = Dim{(unsigned)x, (unsigned)y, (unsigned)z};
    const float** f = (const float**)a;
    int* i = (int*)a[6];
    if (which[0] == 'f')
      coarse_bwd_fixed(f[0], f[1], f[2], f[3], (float*)a[4], (float*)a[5], i[0], i[1], i[2], i[3], i[4], i[5],
                       i[6], i[7], i[8], i[9], scale);
    else
      coarse_bwd(f[0], f[1], f[2], f[3], (float*)a[4], (float*)a[5], i[0], i[1], i[2], i[3], i[4], i[5], i[6],
                 i[7], i[8], i[9]);
  }
}
"""


def shared_bytes(rx: int, ry: int, rz: int, chunk: int) -> int:
    """The tile of the three planes of one (frame, chunk), 4 bytes a value, and the 9 sums."""
    return (ry * rx + rz * rx + rz * ry) * chunk * 4 + 9 * 4


def launch_args(lay: PlaneLayout, n: int, per_block: int) -> list[int]:
    (_, rx, ry, rz, oxy, oxz, oyz), = list(lay.scales())
    return [n, lay.n_features, 0, oxy, oxz, oyz, rx, ry, rz, per_block]


def emulate(args) -> int:
    """The CUDA source compiled for the CPU, run on a small case, against the torch twin's gradients."""
    from fasttomo.kernels import reference

    torch.manual_seed(0)
    T, C, R, chunk = 3, 4, (6, 5, 7), 2
    lay = PlaneLayout(T, C, (R,))
    n = 300
    pts = (torch.rand(n, 3, dtype=torch.float64) * 2.4 - 1.2)  # some outside the box: clamped
    mats = torch.linalg.qr(torch.randn(T, 3, 3, dtype=torch.float64))[0]
    planes = torch.randn(lay.numel, dtype=torch.float64)
    grad = torch.randn(n, lay.n_features, dtype=torch.float64)
    m_ = mats.clone().requires_grad_()
    x_ = planes.clone().requires_grad_()
    (reference.tilted_kplanes(pts, m_, x_, lay) * grad).sum().backward()
    from cuda_probe import build

    lib = build(SOURCE.format(channels=C, chunk=chunk), "extern __shared__ __align__(16) unsigned char raw[];", GLUE)
    blocks = 4
    per_block = -(-n // blocks)
    f32 = {k: v.float().contiguous() for k, v in dict(grad=grad, pts=pts, mats=mats, planes=planes).items()}
    errors = {}
    for which, scale in (("smem", 0.0), ("fixed", 2.0 ** 16)):
        gplanes = torch.zeros(lay.numel)
        parts = torch.zeros(blocks * (C // chunk), T, 9)
        ints = (ctypes.c_int * 10)(*launch_args(lay, n, per_block))
        ptrs = [f32["grad"], f32["pts"], f32["mats"], f32["planes"], gplanes, parts]
        arr = (ctypes.c_void_p * 7)(*[t.data_ptr() for t in ptrs], ctypes.cast(ints, ctypes.c_void_p))
        lib.run(which.encode(), blocks, T, C // chunk, ctypes.c_size_t(shared_bytes(*R, chunk)), arr,
                ctypes.c_double(scale))
        gm = parts.double().sum(0).reshape(T, 3, 3)
        errors[which] = {
            "planes": float((gplanes.double() - x_.grad).norm() / x_.grad.norm()),
            "matrices": float((gm - m_.grad).norm() / m_.grad.norm())}
    print(f"emulated on the CPU, T={T} C={C} chunk={chunk} resolution {R}, {n} points, "
          f"relative errors against the float64 twin: {errors}")
    ok = all(e["planes"] < 1e-4 and e["matrices"] < 1e-4 for e in errors.values())
    print("parity: ok" if ok else "parity: FAILED")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=50, help="the plane resolution (cubic)")
    ap.add_argument("--chunk", type=int, default=4, help="channels a block (its tile: 3 planes x chunk)")
    ap.add_argument("--slices", type=int, default=11, help="blocks a (frame, chunk): each flushes its tile once")
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--emulate", action="store_true", help="check the CUDA source on the CPU (no GPU)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.emulate:
        return emulate(args)

    from bench_kernels import ray_points, rotations
    from benchlib import cuda_times_ms, device_name, write_result

    from cuda_probe import compile_kernel, shared_limit

    limit = shared_limit("probe_smem_backward")
    from fasttomo.kernels.triton import kplanes as kp

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    T, C, S = 8, 48, args.scale
    if C % args.chunk:
        raise SystemExit(f"probe_smem_backward: --chunk {args.chunk} does not divide C = {C}")
    lay = PlaneLayout(T, C, ((S, S, S),))
    pts = ray_points(8192, 200, dev, gen)
    n = pts.shape[0]
    mats = rotations(T, dev, gen)
    planes = torch.randn(lay.numel, device=dev, generator=gen) * 0.5 + 1.0
    grad = torch.randn(n, lay.n_features, device=dev, generator=gen)
    smem = shared_bytes(S, S, S, args.chunk)
    if smem > limit:
        raise SystemExit(f"probe_smem_backward: scale {S} with --chunk {args.chunk} needs {smem} bytes of shared "
                         f"memory a block; this torch and device allow {limit}: take a smaller --chunk")
    chunks = C // args.chunk
    per_block = -(-n // args.slices)
    grid, block = (args.slices, T, chunks), (args.threads, 1, 1)
    parts = torch.empty(args.slices * chunks, T, 9, device=dev)
    gplanes = torch.empty(lay.numel, device=dev)
    try:
        k_float = compile_kernel(SOURCE.format(channels=C, chunk=args.chunk), "coarse_bwd", smem)
        k_fixed = compile_kernel(SOURCE.format(channels=C, chunk=args.chunk), "coarse_bwd_fixed", smem)
    except Exception as exc:  # noqa: BLE001
        raise SystemExit(f"probe_smem_backward: NVRTC compile or configure failed: {type(exc).__name__}: {exc}")
    ints = launch_args(lay, n, per_block)
    # fixed point: a texel of a block holds at most about n / slices x 4 corners of |g| max|plane|^2 terms
    bound = float(grad.abs().max() * planes.abs().max() ** 2)
    scale = float(2 ** 24 / bound)

    def triton_call():
        return kp.kplanes_backward(grad, pts, mats, planes, lay, need_dq=False, need_gm=True)

    def ours(kernel, extra):
        def call():
            gplanes.zero_()
            kernel(grid=grid, block=block, args=[grad, pts, mats, planes, gplanes, parts, *ints, *extra],
                   shared_mem=smem)
            return gplanes, parts.sum(0).reshape(T, 3, 3)
        return call

    ref_planes, _, ref_gm = triton_call()
    torch.cuda.synchronize()
    rows = []
    for name, call in (("smem", ours(k_float, [])), ("fixed", ours(k_fixed, [scale]))):
        gp, gm = call()
        torch.cuda.synchronize()
        rows.append({"variant": name, "scale": S, "chunk": args.chunk, "slices": args.slices, "threads": args.threads,
                     "shared_bytes": smem, "err_planes": float((gp - ref_planes).norm() / ref_planes.norm()),
                     "err_matrices": float((gm - ref_gm).norm() / ref_gm.norm()),
                     "median_ms": statistics.median(cuda_times_ms(call, args.repeat, 3, dev))})
    rows.append({"variant": "triton texel runs", "scale": S, "median_ms": statistics.median(
        cuda_times_ms(triton_call, args.repeat, 3, dev))})
    print(f"one scale of {S}, T={T}, C={C}, {n} points; shared memory {smem} bytes a block")
    for r in rows:
        errs = f"  planes {r['err_planes']:.1e}  matrices {r['err_matrices']:.1e}" if "err_planes" in r else ""
        print(f"  {r['variant']:<18} {r['median_ms']:8.3f} ms{errs}")
    path = write_result("probe_smem_backward", f"scale{S}-chunk{args.chunk}", device_name(dev), rows,
                        out_dir=Path(args.out_dir) if args.out_dir else None, fixed_scale=scale)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
