"""Batch-build time: device-resident sampler vs the per-pixel DataLoader path.

    python scripts/bench_sampler.py                       # 61x200x200 random stack, B=8192, auto device
    python scripts/bench_sampler.py --device cpu --workers 0 2

Times ``next_batch()`` (batch ready on the device) after warm-up; medians over many batches.
On CUDA the device sampler is timed with CUDA events (it issues only asynchronous kernels), the
DataLoader path with wall time up to a synchronize (it is host-bound). Prints a table and writes
one JSON file per run to benchmarks/results/ (schema: CONTRIBUTING.md "Benchmark records").
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchlib import RESULTS, device_name, write_result
from fasttomo.config import SamplerConfig
from fasttomo.data.sampler import build_sampler
from fasttomo.data.tiltseries import TiltSeries

def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def time_sampler(sampler, n_batches: int, warmup: int, device: torch.device) -> list[float]:
    """Per-batch build time in ms."""
    for _ in range(warmup):
        sampler.next_batch()
    times = []
    if device.type == "cuda" and sampler.kind == "device":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n_batches)]
        for start, end in events:
            start.record()
            sampler.next_batch()
            end.record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in events]
    for _ in range(n_batches):
        t0 = time.perf_counter()
        b = sampler.next_batch()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            b.target.sum()  # touch the result (CPU ops are synchronous anyway)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=3, default=[61, 200, 200], metavar=("N", "H", "W"))
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--device-batches", type=int, default=500, help="timed batches of the device sampler")
    p.add_argument("--dataloader-batches", type=int, default=150, help="timed batches of the DataLoader path")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="+", default=[0], help="DataLoader num_workers variants")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    dev_name = device_name(device)
    rng = np.random.default_rng(0)
    n, h, w = args.shape
    ts = TiltSeries(stack=rng.random((n, h, w), dtype=np.float32), angles=np.linspace(-60, 60, n))
    ts.valid = None
    case = f"{n}x{h}x{w}-b{args.batch_size}"

    variants = [("device", SamplerConfig(kind="device", batch_size=args.batch_size), args.device_batches)]
    for nw in args.workers:
        variants.append((f"dataloader_w{nw}", SamplerConfig(kind="dataloader", batch_size=args.batch_size,
                                                            num_workers=nw), args.dataloader_batches))
    rows = []
    for name, cfg, nb in variants:
        sampler = build_sampler(ts, cfg, seed=0, device=device)
        t0 = time.perf_counter()
        times = time_sampler(sampler, nb, args.warmup, device)
        med = statistics.median(times)
        rows.append({
            "variant": name,
            "median_ms": round(med, 4),
            "mean_ms": round(statistics.fmean(times), 4),  # includes the once-per-epoch reshuffle
            "p10_ms": round(_pct(times, 10), 4),
            "p90_ms": round(_pct(times, 90), 4),
            "n_batches": nb,
            "rays_per_s": round(args.batch_size / (med / 1e3), 1),
            "wall_seconds": round(time.perf_counter() - t0, 3),
        })
    base = rows[0]["median_ms"]
    for r in rows:
        r["slowdown_vs_device_x"] = round(r["median_ms"] / base, 2)

    print(f"bench_sampler  case={case}  device={dev_name}  torch={torch.__version__}")
    print(f"{'variant':<16}{'median ms':>12}{'p10 ms':>10}{'p90 ms':>10}{'batches':>9}{'Mrays/s':>10}{'x device':>10}")
    for r in rows:
        print(f"{r['variant']:<16}{r['median_ms']:>12.3f}{r['p10_ms']:>10.3f}{r['p90_ms']:>10.3f}"
              f"{r['n_batches']:>9d}{r['rays_per_s'] / 1e6:>10.2f}{r['slowdown_vs_device_x']:>10.1f}")

    if not args.no_write:
        path = write_result("bench_sampler", case, dev_name, rows, argv=argv, out_dir=Path(args.out),
                            cpu_threads=torch.get_num_threads(), shape=[n, h, w], batch_size=args.batch_size)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
