#!/usr/bin/env python
"""Benchmark the fused kernels against their pure-torch twins (GPU). Prints a table, writes JSON.

    PYTHONPATH=src python scripts/bench_kernels.py [--case flagship|small] [--out benchmarks/results]

Flagship shape (`experiment=flagship`): B=8192 rays x S=200 samples = 1.64 M points, T=8
rotations, C=48 channels, 3 scales at 50/100/200 (features 1152). Points are real ray samples (random pixel of a
random tilt of 61 over +-60 degrees, 200 samples along the beam), so consecutive points are
neighbours as in training. Times are medians of CUDA-event timings after warm-up; 'fwd+bwd' is
forward plus torch.autograd.grad with a fixed random output gradient. Achieved bandwidth counts the
fewest bytes the op must move (inputs read once, outputs written once) over the measured time,
against a measured device-to-device copy ceiling (bytes read + written).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from benchlib import write_result  # noqa: E402
from fasttomo.kernels import dispatch, reference  # noqa: E402
from fasttomo.kernels.layout import PlaneLayout  # noqa: E402

CASES = {
    "flagship": dict(B=8192, S=200, T=8, C=48, res=(50, 100, 200), vol=(256, 256, 256)),
    "small": dict(B=512, S=64, T=4, C=16, res=(16, 32), vol=(64, 64, 64)),
}


def time_ms(fn, warmup=3, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2], ts[0], ts[-1]


def copy_ceiling_gbs() -> float:
    x = torch.empty(512 * 2**20, device="cuda", dtype=torch.float32)  # 2 GiB
    y = torch.empty_like(x)
    med, _, _ = time_ms(lambda: y.copy_(x), warmup=3, reps=15)
    return 2 * x.numel() * 4 / (med * 1e-3) / 1e9


def ray_points(B, S, device, gen):
    ang = torch.deg2rad(torch.linspace(-60, 60, 61, device=device))
    th = ang[torch.randint(0, 61, (B,), device=device, generator=gen)]
    u = torch.rand(B, device=device, generator=gen) * 2 - 1
    v = torch.rand(B, device=device, generator=gen) * 2 - 1
    s = torch.linspace(-1, 1, S, device=device)[None, :] + (torch.rand(B, 1, device=device, generator=gen) - 0.5) * (2 / S)
    # IMOD convention: column u = x cos + z sin; the ray is along (sin, 0, cos) rotated -> (-sin, 0, cos)
    x = u[:, None] * torch.cos(th)[:, None] - s * torch.sin(th)[:, None]
    z = u[:, None] * torch.sin(th)[:, None] + s * torch.cos(th)[:, None]
    y = v[:, None].expand(B, S)
    return torch.stack((x, y, z), dim=-1).reshape(B * S, 3).contiguous()


def rotations(T, device, gen):
    q = torch.linalg.qr(torch.randn(T, 3, 3, device=device, generator=gen, dtype=torch.float64))[0]
    q[0] = torch.eye(3, device=device, dtype=torch.float64)
    return q.float().contiguous()


def bf16_planes_rows(row, pts, M, x, lay, gout, b_fwd, b_bwd_all, twin_fwd, twin_fb_ms, reps) -> None:
    """The kernels sampling a bf16 copy of the planes (8-byte gathers of a 16-channel chunk instead
    of 16-byte ones; widened to fp32 on load, gradients fp32), with the default tuning. The copy is
    made inside each timed call, as a step with precision.planes=bf16 makes it."""
    from fasttomo.kernels.triton import kplanes as kp

    with torch.no_grad():
        ref = kp.kplanes_forward(pts, M, x, lay, False)
        err = float((kp.kplanes_forward(pts, M, x.to(torch.bfloat16), lay, False) - ref).double().norm()
                    / ref.double().norm())
        del ref
    print(f"  bf16 planes: features' relative difference to fp32 planes {err:.2e}", flush=True)
    for out_bf16 in (False, True):
        m = time_ms(lambda: kp.kplanes_forward(pts, M, x.to(torch.bfloat16), lay, out_bf16), reps=reps)
        row(f"fused {'bf16' if out_bf16 else 'fp32'} out, bf16 planes", "tilted_kplanes", "fwd", *m, b_fwd,
            speedup_vs_twin=twin_fwd / m[0], rel_diff_to_fp32_planes=err)

    def fb():
        xb = x.to(torch.bfloat16)
        f = kp.kplanes_forward(pts, M, xb, lay, False)
        gp, dq, gm = kp.kplanes_backward(gout, pts, M, xb, lay, True, need_gm=True)
        torch.einsum("itn,tij->nj", dq, M)
        return f, gp
    m = time_ms(fb, reps=reps)
    row("fused default, bf16 planes (grads: all)", "tilted_kplanes", "fwd+bwd", *m, b_fwd + b_bwd_all,
        speedup_vs_twin=twin_fb_ms / m[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="flagship", choices=sorted(CASES))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--twin-reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    from fasttomo.kernels.triton import kplanes as kp
    from fasttomo.kernels.triton import ops  # noqa: F401

    cfg = CASES[args.case]
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    T, C = cfg["T"], cfg["C"]
    lay = PlaneLayout(T, C, tuple((r, r, r) for r in cfg["res"]))
    res = [v for r in lay.resolutions for v in r]
    N = cfg["B"] * cfg["S"]
    F = lay.n_features
    pts = ray_points(cfg["B"], cfg["S"], dev, gen)
    M = rotations(T, dev, gen)
    x = (torch.randn(lay.numel, device=dev, generator=gen) * 0.5 + 1.0)
    gout = torch.randn(N, F, device=dev, generator=gen)
    dispatch.configure("auto")
    rows = []
    ceiling = copy_ceiling_gbs()
    print(f"device {torch.cuda.get_device_name()}  copy ceiling {ceiling:.0f} GB/s  N={N} F={F} "
          f"planes={lay.numel * 4 / 1e6:.1f} MB  output={N * F * 4 / 1e9:.2f} GB", flush=True)

    # fewest bytes: fwd reads points, matrices, planes once and writes the features once
    b_fwd = N * 3 * 4 + lay.numel * 4 + N * F * 4
    # fwd+bwd: fwd + read grad_out + read points/planes again + write grad planes (+ its zeroing)
    # + grad points (N*3) and the dq intermediate (N*T*3 write + read)
    b_bwd_planes = N * F * 4 + N * 3 * 4 + 3 * lay.numel * 4
    b_bwd_all = b_bwd_planes + N * 3 * 4 + 2 * N * T * 3 * 4

    def row(variant, op, kind, med, lo, hi, nbytes=None, **extra):
        r = {"variant": variant, "op": op, "pass": kind, "median_ms": round(med, 4),
             "min_ms": round(lo, 4), "max_ms": round(hi, 4)}
        if op == "tilted_kplanes":
            r["points_per_s"] = N / (med * 1e-3)
        if nbytes is not None:
            r["min_bytes_GB"] = nbytes / 1e9
            r["achieved_GBps"] = nbytes / (med * 1e-3) / 1e9
            r["fraction_of_copy_ceiling"] = r["achieved_GBps"] / ceiling
        r.update(extra)
        rows.append(r)
        print(f"  {variant:<34} {kind:<8} {med:9.3f} ms" + (f"  {r.get('achieved_GBps', 0):7.0f} GB/s" if nbytes else ""), flush=True)

    # ---------------------------------------------------------------- correctness at full size
    pts_g = pts.clone().requires_grad_()
    M_g = M.clone().requires_grad_()
    x_g = x.clone().requires_grad_()
    with torch.no_grad():
        f_fused = torch.ops.fasttomo.tilted_kplanes(pts, M, x, T, C, res, False)
        f_ref = reference.tilted_kplanes(pts, M, x, lay)
        err_fwd = float((f_fused - f_ref).double().norm() / f_ref.double().norm())
        del f_fused, f_ref
    g_f = torch.autograd.grad(dispatch.tilted_kplanes(pts_g, M_g, x_g, lay), [pts_g, M_g, x_g], gout)
    g_r = torch.autograd.grad(reference.tilted_kplanes(pts_g, M_g, x_g, lay), [pts_g, M_g, x_g], gout)
    err_b = [float((a - b).double().norm() / b.double().norm()) for a, b in zip(g_f, g_r)]
    del g_f, g_r
    # the coordinate gradient of bilinear sampling jumps at texel edges, so two fp32 codes that round
    # q = M p differently disagree there; judge both against float64 on a subset (65536 points)
    sub = slice(0, 65536)
    ps, Ms, xs = (t.detach().clone().requires_grad_() for t in (pts[sub], M, x))
    gs = gout[sub]
    g_fs = torch.autograd.grad(dispatch.tilted_kplanes(ps, Ms, xs, lay), [ps, Ms, xs], gs)
    g_rs = torch.autograd.grad(reference.tilted_kplanes(ps, Ms, xs, lay), [ps, Ms, xs], gs)
    p64, M64, x64 = (t.detach().double().requires_grad_() for t in (ps, Ms, xs))
    g_64 = torch.autograd.grad(reference.tilted_kplanes(p64, M64, x64, lay), [p64, M64, x64], gs.double())
    err64 = {}
    for name, a_, b_, c_ in zip(("d_points", "d_matrices", "d_planes"), g_fs, g_rs, g_64):
        err64[name] = {"fused_vs_fp64": float((a_.double() - c_).norm() / c_.norm()),
                       "twin_vs_fp64": float((b_.double() - c_).norm() / c_.norm())}
    del g_fs, g_rs, g_64, p64, M64, x64
    print(f"subset parity vs float64 twin: {err64}", flush=True)
    print(f"full-size parity: rel err fwd {err_fwd:.2e}, d_points {err_b[0]:.2e}, "
          f"d_matrices {err_b[1]:.2e}, d_planes {err_b[2]:.2e}", flush=True)
    torch.cuda.empty_cache()

    # ---------------------------------------------------------------- op 1
    print("tilted_kplanes:")
    tr = args.twin_reps
    m = time_ms(lambda: reference.tilted_kplanes(pts, M, x, lay), warmup=1, reps=tr)
    row("twin", "tilted_kplanes", "fwd", *m, b_fwd)
    twin_fwd = m[0]

    def twin_fb():
        torch.autograd.grad(reference.tilted_kplanes(pts_g, M_g, x_g, lay), [pts_g, M_g, x_g], gout)
    m = time_ms(twin_fb, warmup=1, reps=tr)
    row("twin (grads: points, matrices, planes)", "tilted_kplanes", "fwd+bwd", *m, b_fwd + b_bwd_all)
    twin_fb_ms = m[0]

    def twin_fb_planes():
        torch.autograd.grad(reference.tilted_kplanes(pts, M, x_g, lay), [x_g], gout)
    m = time_ms(twin_fb_planes, warmup=1, reps=tr)
    row("twin (grads: planes only)", "tilted_kplanes", "fwd+bwd", *m, b_fwd + b_bwd_planes)
    twin_fbp_ms = m[0]
    torch.cuda.empty_cache()

    m = time_ms(lambda: torch.ops.fasttomo.tilted_kplanes(pts, M, x, T, C, res, False), reps=args.reps)
    row("fused fp32", "tilted_kplanes", "fwd", *m, b_fwd, speedup_vs_twin=twin_fwd / m[0])
    m = time_ms(lambda: torch.ops.fasttomo.tilted_kplanes(pts, M, x, T, C, res, True), reps=args.reps)
    row("fused bf16 out", "tilted_kplanes", "fwd", *m, b_fwd - N * F * 2, speedup_vs_twin=twin_fwd / m[0])

    for bn in (32, 128):
        tu = kp.KPlanesTuning(fwd_block_n=bn)
        m = time_ms(lambda: kp.kplanes_forward(pts, M, x, lay, False, tu), reps=args.reps)
        row(f"fused fp32 BN{bn}", "tilted_kplanes", "fwd", *m, b_fwd, speedup_vs_twin=twin_fwd / m[0])
    # (tag, tuning): each variant is a frozen KPlanesTuning passed down to the launchers (the
    # 'fused ... (grads: ...)' rows run forward + backward launchers + the two dq einsums, as the
    # custom op's autograd does); min_programs_per_sm=0 so the named strategy runs at any size
    variants = [
        ("pair-merge skip0", kp.KPlanesTuning(backward="pairs")),
        ("texel runs 8x16 w1", kp.KPlanesTuning(run_maxnreg=None, min_programs_per_sm=0)),
        ("texel runs 8x16 w1 maxnreg168", kp.KPlanesTuning(min_programs_per_sm=0)),
        ("texel runs 16x16 w2 maxnreg168", kp.KPlanesTuning(run_rows=16, run_warps=2,
                                                            min_programs_per_sm=0)),
        # longer rows: fewer flushes counted (rows of 64: 0.454 per tap against 0.571,
        # count_locality --sorted), more serial walk and dq registers per program
        ("texel runs 8x32 w1 maxnreg168", kp.KPlanesTuning(run_len=32, min_programs_per_sm=0)),
        ("texel runs 8x64 w1", kp.KPlanesTuning(run_len=64, run_maxnreg=None, min_programs_per_sm=0)),
    ]
    for tag, tu in variants:
        if kp.backward_strategy(N, T, pts.device, tu) == kp.backward_strategy(N, T, pts.device) \
                and dataclasses.replace(tu, min_programs_per_sm=kp.DEFAULT_TUNING.min_programs_per_sm) \
                == kp.DEFAULT_TUNING:
            tag += " [default]"
        try:
            def fb(tu=tu):
                f = kp.kplanes_forward(pts, M, x, lay, False, tu)
                gp, dq, gm = kp.kplanes_backward(gout, pts, M, x, lay, True, tu, need_gm=True)
                torch.einsum("itn,tij->nj", dq, M)
                return f, gp
            m = time_ms(fb, reps=args.reps)
            row(f"fused {tag} (grads: all)", "tilted_kplanes", "fwd+bwd", *m, b_fwd + b_bwd_all,
                speedup_vs_twin=twin_fb_ms / m[0])

            def fbp(tu=tu):
                return kp.kplanes_forward(pts, M, x, lay, False, tu), \
                    kp.kplanes_backward(gout, pts, M, x, lay, False, tu)
            m = time_ms(fbp, reps=args.reps)
            row(f"fused {tag} (grads: planes)", "tilted_kplanes", "fwd+bwd", *m, b_fwd + b_bwd_planes,
                speedup_vs_twin=twin_fbp_ms / m[0])
            for need_dq in (False, True):
                m = time_ms(lambda: kp.kplanes_backward(gout, pts, M, x, lay, need_dq, tu),
                            reps=args.reps)
                row(f"fused {tag} bwd kernels only ({'with' if need_dq else 'no'} dq)",
                    "tilted_kplanes", "bwd", *m, b_bwd_planes)
        except Exception as e:  # noqa: BLE001 - record a variant that fails to compile
            print(f"  variant {tag} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"variant": f"fused {tag}", "op": "tilted_kplanes", "error": str(e)[:500]})
    bf16_planes_rows(row, pts, M, x, lay, gout, b_fwd, b_bwd_all, twin_fwd, twin_fb_ms, args.reps)
    del gout
    torch.cuda.empty_cache()

    # ---------------------------------------------------------------- op 3: plane TV
    print("plane_tv:")
    dispatch.configure("torch")
    m = time_ms(lambda: dispatch.plane_tv(x, lay), reps=args.reps)
    row("twin", "plane_tv", "fwd", *m, lay.numel * 4)
    t0 = m[0]
    m = time_ms(lambda: torch.autograd.grad(dispatch.plane_tv(x_g, lay), [x_g]), reps=args.reps)
    row("twin", "plane_tv", "fwd+bwd", *m, 3 * lay.numel * 4)
    t1 = m[0]
    dispatch.configure("auto")
    m = time_ms(lambda: dispatch.plane_tv(x, lay), reps=args.reps)
    row("fused", "plane_tv", "fwd", *m, lay.numel * 4, speedup_vs_twin=t0 / m[0])
    m = time_ms(lambda: torch.autograd.grad(dispatch.plane_tv(x_g, lay), [x_g]), reps=args.reps)
    row("fused", "plane_tv", "fwd+bwd", *m, 3 * lay.numel * 4, speedup_vs_twin=t1 / m[0])

    # ---------------------------------------------------------------- op 2: volume TV
    print("volume_tv:")
    vol = torch.randn(cfg["vol"], device=dev, generator=gen, requires_grad=True)
    vb = vol.numel() * 4
    for kind in ("squared", "l1"):
        dispatch.configure("torch")
        m = time_ms(lambda: dispatch.volume_tv(vol.detach(), kind), reps=args.reps)
        row(f"twin {kind}", "volume_tv", "fwd", *m, vb)
        t0 = m[0]
        m = time_ms(lambda: torch.autograd.grad(dispatch.volume_tv(vol, kind), [vol]), reps=args.reps)
        row(f"twin {kind}", "volume_tv", "fwd+bwd", *m, 3 * vb)
        t1 = m[0]
        dispatch.configure("auto")
        m = time_ms(lambda: dispatch.volume_tv(vol.detach(), kind), reps=args.reps)
        row(f"fused {kind}", "volume_tv", "fwd", *m, vb, speedup_vs_twin=t0 / m[0])
        m = time_ms(lambda: torch.autograd.grad(dispatch.volume_tv(vol, kind), [vol]), reps=args.reps)
        row(f"fused {kind}", "volume_tv", "fwd+bwd", *m, 3 * vb, speedup_vs_twin=t1 / m[0])

    device = torch.cuda.get_device_name()
    extra = {
        "shape": {"points": N, "rays": cfg["B"], "samples": cfg["S"], "T": T, "C": C,
                  "resolutions": list(cfg["res"]), "features": F, "plane_MB": lay.numel * 4 / 1e6,
                  "volume": list(cfg["vol"])},
        "copy_ceiling_GBps": ceiling,
        "full_size_parity_rel_err_fused_vs_twin_fp32": {"fwd": err_fwd, "d_points": err_b[0],
                                                         "d_matrices": err_b[1], "d_planes": err_b[2]},
        "subset_65536_rel_err_vs_float64": err64,
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
    }
    out_dirs = [Path(args.out)] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for d in out_dirs:
        try:
            name = write_result("bench_kernels", args.case, device, rows, out_dir=d, **extra).name
        except OSError as e:
            print(f"could not write to {d}: {e}")
    print(f"\n{'op':<15} {'pass':<8} {'variant':<40} {'median ms':>10} {'speedup':>8} {'GB/s':>7}")
    for r in rows:
        if "median_ms" in r:
            sp = r.get("speedup_vs_twin")
            print(f"{r['op']:<15} {r['pass']:<8} {r['variant']:<40} {r['median_ms']:>10.3f} "
                  f"{(f'{sp:.1f}x' if sp else ''):>8} {r.get('achieved_GBps', float('nan')):>7.0f}")
    print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
