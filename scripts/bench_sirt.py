"""SIRT time per iteration on the GPU: the pure-torch twins against the fused Triton projector pair.

    python scripts/bench_sirt.py                              # 128^3, 61 tilts +-60, 100 iterations
    python scripts/bench_sirt.py --sweep                      # + forward / backprojection block shapes
    python scripts/bench_sirt.py --inplane --variants fused   # the 8-gather path (in-plane poses)
    python scripts/bench_sirt.py --size 32 --iterations 10    # CPU smoke run (twin only)

Case "128cube-61tilts": the built-in phantom in a 128^3 box (default_phantom(128, 128, 128)),
exact projections at 61 tilts over +-60 degrees, 128 x 128 images, step 0.5 voxel. For each variant
the table gives the forward projection (A x) and the backprojection (B y) in ms (CUDA events after
warm-up, medians), the median ms per SIRT iteration (events recorded by the callback, so the loop
itself is what is timed), the seconds for all iterations including SIRT's one-off weights (A 1,
B 1), and the Pearson correlation of the result with the voxelized truth. Goal on the H200: < 6.4 ms
per iteration (ASTRA's SIRT3D_CUDA takes 0.64 s per 100 iterations on this case).

Counts (128^3, 61 views, 128 x 128; counted with the twin's chord code):

* Rays 999,424; samples 2.40e8 (240 per ray: mean chord 120 voxels at step 0.5). Pure tilt
  (no in-plane rotation, image rows on voxel rows) makes every sample's y-weight exactly 0 and the
  kernel masks zero-weight taps: 4 gathers per sample (2 at 0 degrees), 9.5e8 gathered fp32 loads
  per forward projection (a plain trilinear kernel would issue 1.9e9).
* Backprojection: 2.10e6 voxels x 61 views, 2 gathers each (the row weight is 0 again): 2.6e8
  loads, and about 30 flops per (voxel, view): 3.8 GFLOP.
* Bytes that must move per iteration: volume 8.4 MB read + 8.4 MB written, stack 4.0 MB read
  twice, projections and residual ~16 MB, weights 12 MB: about 60 MB, 15 us at 4 TB/s. The
  volume and the stack sit in L2 (50 MB), so HBM is not the floor.
* The floor is gather throughput in L1: a warp's 32 rays are one image row, so at sample k its
  points lie on a line of slope tan(theta) in x-z; each z row is its own 128-byte line (z stride
  64 KB), so a gather instruction touches ~1 + 32 |sin theta| lines, ~16 on average over +-60
  degrees. About 4.9e8 L1 wavefronts per forward: ~2 ms at one wavefront per SM per clock
  (132 SMs, 1.98 GHz). Instruction issue (~60 per sample) adds ~0.5 ms if not hidden.

Expected on the H200: forward 1.5-3 ms, backprojection 0.1-0.3 ms, elementwise ~0.05 ms: 2-3.5 ms
per iteration, under the 6.4 ms goal. With in-plane poses (--inplane) every tap is live: 8 gathers
per sample, so the forward may take up to ~2x longer (its Pearson is meaningless: the data are the
pure-tilt projections). If the forward misses: a brick layout of the volume (a
128-byte line holding a 4 x 8 x-z patch, like a texture's block-linear layout) would cut the lines
per gather ~4x; two samples per loop iteration would add memory-level parallelism.

Writes one JSON record to benchmarks/results/ (and $OUT when set) unless --no-write.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.detach().double().flatten()
    b = b.detach().double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    from benchlib import cuda_times_ms, device_name, median, write_result
    from fasttomo.methods.sirt import sirt
    from fasttomo.methods.sirt.projectors import view_poses
    from fasttomo.data import phantom as P
    from fasttomo.geometry.poses import Poses
    from fasttomo.geometry.rays import Box
    from fasttomo.kernels import dispatch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=128, help="volume edge (cube) and image size")
    p.add_argument("--tilts", type=int, default=61)
    p.add_argument("--tilt-max", type=float, default=60.0, help="tilts span +-this many degrees")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--step", type=float, default=0.5)
    p.add_argument("--variants", nargs="+", default=["twin", "fused"], choices=["twin", "fused"])
    p.add_argument("--twin-iterations", type=int, default=10,
                   help="SIRT iterations of the (slow) twin; its seconds for --iterations are extrapolated")
    p.add_argument("--reps", type=int, default=20, help="timed repeats of each fused projector")
    p.add_argument("--twin-reps", type=int, default=3, help="timed repeats of each twin projector")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sweep", action="store_true", help="also time fused block shapes (GPU)")
    p.add_argument("--inplane", action="store_true",
                   help="small in-plane rotations (+-1 deg) and shifts (+-2 px) on every view: no zero-weight "
                        "taps, 8 gathers per sample (the phantom's data are still the pure-tilt ones)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = int(args.size)
    ph = P.default_phantom(n, n, n)
    angles = np.linspace(-args.tilt_max, args.tilt_max, args.tilts)
    stack = torch.from_numpy(P.project(ph, angles)).to(dev)
    truth = torch.from_numpy(P.voxelize(ph)).to(dev)
    poses = Poses(angles, int(np.argmin(np.abs(angles))), learn_rotations=args.inplane, learn_shifts=args.inplane)
    if args.inplane:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            poses.z1.copy_((torch.rand(args.tilts, generator=g) - 0.5) * np.deg2rad(2.0))
            poses.z3.copy_((torch.rand(args.tilts, generator=g) - 0.5) * np.deg2rad(2.0))
            poses.shifts.copy_((torch.rand(args.tilts, 2, generator=g) - 0.5) * 4.0)
    box = Box(ph.shape_zyx)
    rot, shift = view_poses(poses, None, dev)
    hw = (n, n)
    case = (f"{n}cube-{args.tilts}tilts" + ("" if args.tilt_max == 60 else f"-{args.tilt_max:g}deg")
            + ("-inplane" if args.inplane else ""))

    rows, notes = [], []
    for variant in args.variants:
        if variant == "fused" and dev.type != "cuda":
            notes.append("fused skipped: needs CUDA")
            continue
        dispatch.configure("triton" if variant == "fused" else "torch")
        its = args.iterations if variant == "fused" else min(args.iterations, args.twin_iterations)
        reps, warm = (args.reps, args.warmup) if variant == "fused" else (args.twin_reps, 1)
        x = truth.clone()
        y = stack.clone()
        fwd = cuda_times_ms(lambda: dispatch.ray_project(x, rot, shift, hw, args.step), reps, warm, dev)
        bp = cuda_times_ms(lambda: dispatch.voxel_backproject(y, rot, shift, box.shape_zyx), reps, warm, dev)
        sirt(stack, poses, box, 2, step=args.step)  # warm-up: compiles, allocator
        marks: list = []

        def mark(_i=None, _vol=None):
            if dev.type == "cuda":
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                marks.append(e)
            else:
                marks.append(time.perf_counter())

        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        mark()
        vol = sirt(stack, poses, box, its, step=args.step, callback=mark)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            gaps = [a.elapsed_time(b) for a, b in zip(marks[:-1], marks[1:])]
        else:
            gaps = [(b - a) * 1e3 for a, b in zip(marks[:-1], marks[1:])]
        total_s = sum(gaps) / 1e3  # first gap includes the weights A 1 and B 1
        per_iter = gaps[1:] if len(gaps) > 1 else gaps
        # all --iterations: measured for the fused path, extrapolated for a shortened twin run
        full_s = total_s + (args.iterations - its) * median(per_iter) / 1e3
        residual = dispatch.ray_project(vol, rot, shift, hw, args.step) - stack
        row = {
            "variant": variant,
            "forward_ms": round(median(fwd), 3),
            "backproject_ms": round(median(bp), 3),
            "iteration_ms": round(median(per_iter), 3),
            "iteration_min_ms": round(min(per_iter), 3),
            "seconds_total": round(full_s, 3),
            "seconds_total_measured": its == args.iterations,
            "iterations_run": its,
            "pearson": round(_pearson(vol, truth), 5),
            "residual_rel": round(float(residual.norm() / stack.norm()), 5),
        }
        if dev.type == "cuda":
            row["peak_mem_GB"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 3)
        rows.append(row)
    dispatch.configure("auto")

    sweep = []
    if args.sweep and dev.type == "cuda":
        from fasttomo.kernels.triton import tomo
        x = truth.contiguous()
        # rays per thread = bv * bu / (32 w): 1 (latency hidden by occupancy) or 2-4 (by ILP)
        for bv, bu, w in ((4, 32, 4), (2, 32, 2), (1, 32, 1), (8, 16, 4), (16, 8, 4), (2, 64, 4), (8, 32, 8),
                          (8, 32, 4), (4, 64, 4), (8, 64, 4), (16, 32, 4)):
            t = cuda_times_ms(lambda: tomo.ray_project(x, rot, shift, n, n, args.step, block_v=bv, block_u=bu,
                                                       warps=w), args.reps, args.warmup, dev)
            sweep.append({"variant": f"forward-{bv}x{bu}-w{w}", "forward_ms": round(median(t), 3)})
        for blk, w in ((256, 4), (128, 4), (512, 4), (512, 8), (1024, 8), (1024, 4)):
            t = cuda_times_ms(lambda: tomo.voxel_backproject(stack, rot, shift, n, n, n, block=blk, warps=w),
                              args.reps, args.warmup, dev)
            sweep.append({"variant": f"backproject-{blk}-w{w}", "backproject_ms": round(median(t), 3)})

    print(f"bench_sirt case={case} device={device_name(dev)} torch={torch.__version__} iterations={args.iterations}")
    print(f"{'variant':<10}{'fwd ms':>9}{'bp ms':>9}{'ms/iter':>10}{'s/' + str(args.iterations) + ' it':>10}"
          f"{'its run':>8}{'pearson':>9}{'resid':>9}")
    for r in rows:
        star = "" if r["seconds_total_measured"] else "*"
        print(f"{r['variant']:<10}{r['forward_ms']:>9.3f}{r['backproject_ms']:>9.3f}{r['iteration_ms']:>10.3f}"
              f"{r['seconds_total']:>9.3f}{star:1}{r['iterations_run']:>8}{r['pearson']:>9.4f}{r['residual_rel']:>9.4f}")
    if any(not r["seconds_total_measured"] for r in rows):
        print("* extrapolated from the shortened run (pearson/resid are at 'its run' iterations)")
    if len(rows) == 2:
        print(f"fused vs twin per iteration: {rows[0]['iteration_ms'] / rows[1]['iteration_ms']:.1f}x faster")
    for s in sweep:
        print(f"  sweep {s['variant']:<22}" + "".join(f"{k}={v}" for k, v in s.items() if k != "variant"))
    for note in notes:
        print(note)
    if not args.no_write:
        argv_used = sys.argv[1:] if argv is None else argv
        extra = {"iterations": args.iterations, "step": args.step, "tilts": args.tilts, "tilt_max_deg": args.tilt_max,
                 "goal_ms_per_iteration": 6.4, "sweep": sweep, "notes": notes}
        path = None
        for out in [None] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
            path = write_result("bench_sirt", case, device_name(dev), rows, argv=argv_used, out_dir=out, **extra)
        print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
