"""Benchmark fasttomo-trace's tracing: a volume rendered from ~10,000 known atoms, traced and scored.

    python scripts/bench_trace.py                      # 256^3, ~10,000 atoms, clean and 10 % noise
    python scripts/bench_trace.py --size 128 --atoms 1500 --device cpu

The atoms are an FCC sphere (nearest neighbours --nn voxels apart, Gaussian atoms of width --sigma
voxels, two species of peak density 1 and 2 at random) in the middle of a cube of --size voxels;
"noise10" adds Gaussian noise of 10 % of the clean maximum. Each variant is traced --repeat times
after --warmup runs (default 1: CUDA initialization, first kernels and, on the CPU too, the
first call's one-time costs excluded: measured on the 2-core CPU, the first trace of a process
took 19.5 s where the next took 0.97 s); the table gives the median
wall time of trace_volume (host array in, host arrays out, GPU synchronized) and the scores
against the true atoms. Writes benchmarks/results/bench_trace-<case>-<device>-<commit>.json.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchlib import device_name, write_result
from fasttomo.data.atoms import fcc_sphere
from fasttomo.trace.core import TraceParams, trace_volume
from fasttomo.data.gauss import render
from fasttomo.trace.score import score_trace


def make_case(size: int, atoms: int, nn: float, sigma: float, seed: int):
    lattice = nn * math.sqrt(2.0)
    radius = (3.0 * atoms / (4.0 * math.pi) * lattice ** 3 / 4.0) ** (1.0 / 3.0)
    if radius + 4 * sigma > size / 2 - 1:
        raise SystemExit(f"{atoms} atoms {nn} voxels apart need a sphere of radius {radius:.1f} voxels; --size {size} "
                         "is too small.")
    rng = np.random.default_rng(seed)
    xyz = fcc_sphere(radius, lattice, rotation=np.linalg.qr(rng.normal(size=(3, 3)))[0])  # any orientation
    zyx = xyz[:, ::-1] + (size - 1) / 2.0
    species = np.where(rng.uniform(size=len(zyx)) < 0.5, 2, 1)
    amp = species.astype(np.float64)
    vol = render((size,) * 3, torch.from_numpy(zyx), torch.from_numpy(amp), float(sigma)).float().numpy()
    return vol, zyx, species


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--atoms", type=int, default=10000)
    ap.add_argument("--nn", type=float, default=3.5, help="nearest-neighbour distance in voxels")
    ap.add_argument("--sigma", type=float, default=0.7, help="atom width in voxels")
    ap.add_argument("--voxel", type=float, default=0.8, help="voxel size in Angstrom (min_separation is 2 A)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--variants", default="clean,noise10")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    t0 = time.perf_counter()
    clean, zyx, species = make_case(args.size, args.atoms, args.nn, args.sigma, args.seed)
    t_render = time.perf_counter() - t0
    rows = []
    print(f"{len(zyx)} atoms in a {args.size}^3 volume (rendered in {t_render:.1f} s), device {device_name(dev)}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'variant':<10} {'median s':>9} {'min s':>7} {'atoms':>6} {'precision':>9} {'recall':>7} "
          f"{'RMSD vox':>8} {'species':>7}")
    for variant in args.variants.split(","):
        vol = clean
        if variant == "noise10":
            vol = clean + np.random.default_rng(args.seed + 1).normal(0, 0.1 * float(clean.max()),
                                                                      clean.shape).astype(np.float32)
        elif variant != "clean":
            raise SystemExit(f"unknown variant {variant!r}; use clean, noise10")
        prm = TraceParams(classes=2)
        for _ in range(args.warmup):
            trace_volume(vol, args.voxel, prm, device=dev)
        times, res = [], None
        for _ in range(args.repeat):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            res = trace_volume(vol, args.voxel, prm, device=dev)
            times.append(time.perf_counter() - t)
        sc = score_trace(res.xyz_A, zyx[:, ::-1] * args.voxel, voxel_size_A=args.voxel, traced_species=res.species,
                         true_species=species)
        row = {"variant": variant, "median_s": statistics.median(times), "min_s": min(times), "times_s": times,
               "n_true": int(len(zyx)), "n_traced": res.n, "n_candidates": res.stats["n_candidates"],
               "precision": sc["precision"], "recall": sc["recall"], "rmsd_voxels": sc["rmsd_voxels"],
               "species_accuracy": sc.get("species_accuracy"), "seconds_by_step": res.stats["seconds_by_step"]}
        rows.append(row)
        print(f"{variant:<10} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {res.n:>6d} {sc['precision']:>9.4f} "
              f"{sc['recall']:>7.4f} {sc['rmsd_voxels']:>8.4f} {sc.get('species_accuracy', float('nan')):>7.4f}")
    if not args.no_write:
        case = f"fcc{len(zyx)}-{args.size}-s{args.sigma:g}"
        if args.variants != "clean,noise10":
            case += "-" + args.variants.replace(",", "+")
        path = write_result("bench_trace", case, device_name(dev), rows,
                            out_dir=Path(args.out) if args.out else None, size=args.size, nn_voxels=args.nn,
                            sigma_voxels=args.sigma, voxel_A=args.voxel, torch_threads=torch.get_num_threads(),
                            render_seconds=t_render, warmup_runs=args.warmup,
                            load_average_1_5_15_min_at_end=list(os.getloadavg()))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
