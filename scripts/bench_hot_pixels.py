#!/usr/bin/env python
"""bench_hot_pixels: what X-ray hits cost a reconstruction, and what data.hot_pixels=mask wins back.

The embedded phantom's series (``fasttomo-simulate``, 64 x 64, 61 views) is written to an MRC
file, then a copy with one X-ray hit in each of ``--views`` random views: a cluster of 3 to 6
pixels (an L, a square, a T, a 2 x 3 block in turn) raised by 10 to 20 times the view's 0.1-99.9 %
intensity range. Each variant reconstructs a file with the defaults and is scored against the
phantom's truth:

    clean   the series without hits
    mask    the hits, data.hot_pixels=mask (the default)
    keep    the hits, data.hot_pixels=keep

    python scripts/bench_hot_pixels.py [--views 40] [--seed 5] [--out-dir DIR]
    python scripts/bench_hot_pixels.py --suite   # the pixels masked in each bench_quality case's series

Rows: ``pearson``, ``fsc_mean`` and the FSC 0.5 crossing (A, null: never crossed) against the
truth, the masked pixels the log reports, the process's wall seconds. Prints a table, writes
benchmarks/results/bench_hot_pixels-phantom64-<device>-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

SHAPES = [[(0, 0), (0, 1), (1, 0)], [(0, 0), (0, 1), (1, 0), (1, 1)], [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2)],
          [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]]


def add_hits(src: Path, dst: Path, views: int, seed: int) -> int:
    """Copy the MRC ``src`` to ``dst`` with one cluster in each of ``views`` random views; returns
    the pixels raised."""
    from fasttomo.data.io.mrc import read_mrc, write_mrc

    raw = read_mrc(src)
    stack, voxel = raw.data.astype(np.float32), float(raw.voxel_size[0])
    rng = np.random.default_rng(seed)
    n, h, w = stack.shape
    raised = 0
    for k, v in enumerate(rng.choice(n, min(views, n), replace=False)):
        lo, hi = np.quantile(stack[v], (0.001, 0.999))
        r0, c0 = rng.integers(3, h - 5), rng.integers(3, w - 5)
        for dr, dc in SHAPES[k % 4]:
            stack[v, r0 + dr, c0 + dc] += (hi - lo) * rng.uniform(10.0, 20.0)
            raised += 1
    write_mrc(dst, stack, voxel, image_stack=True)
    return raised


def suite(out_dir: Path | None, device: str) -> None:
    """The pixels the hot-pixel rule masks in each bench_quality case's series (as that script
    writes it): where it masks none, the suite's inputs, and so its scores, do not depend on it."""
    import logging

    import bench_quality as bq
    from benchlib import write_result

    from fasttomo.data.io.mrc import read_mrc
    from fasttomo.data.prepare import hot_pixel_mask

    logging.disable(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="bench_hot_pixels-suite-"))
    rows = []
    for name in bq.CASES:
        files = bq.make_case(name, work)
        stack = read_mrc(files["stack"]).data.astype(np.float32)
        valid = hot_pixel_mask(stack, None, "mask", name, np.loadtxt(files["angles"]), 0.0)
        rows.append({"variant": name, "masked_pixels": 0 if valid is None else int((~valid).sum()),
                     "pixels": int(stack.size)})
        print(f"{name:22s} {rows[-1]['masked_pixels']:6d} of {stack.size} pixels masked", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(write_result("bench_hot_pixels", "quality-suite", device, rows, out_dir=out_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--views", type=int, default=40, help="views with one X-ray hit each")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=None, help="write the record here (default benchmarks/results)")
    ap.add_argument("--suite", action="store_true",
                    help="only count the pixels data.hot_pixels=mask masks in every bench_quality case's series")
    args = ap.parse_args()
    import torch
    from benchlib import device_name, write_result

    if args.suite:
        suite(args.out_dir, device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu")))
        return

    work = Path(tempfile.mkdtemp(prefix="bench_hot_pixels-"))
    exe = [sys.executable, "-m"]
    subprocess.run([*exe, "fasttomo.cli.simulate", f"out={work / 'clean'}", "format=mrc"], check=True,
                   capture_output=True)
    raised = add_hits(work / "clean.mrc", work / "hits.mrc", args.views, args.seed)
    shutil.copy(work / "clean.rawtlt", work / "hits.rawtlt")
    rows = []
    for variant, stem, mode in (("clean", "clean", "mask"), ("mask", "hits", "mask"), ("keep", "hits", "keep")):
        run_dir = work / f"run_{variant}"
        cmd = [*exe, "fasttomo.cli.reconstruct", "data=mrc", f"data.path={work / stem}.mrc",
               f"data.angles={work / stem}.rawtlt", f"data.hot_pixels={mode}",
               f"evaluation.truth={work}/clean_truth.mrc", "logging.progress=false", f"hydra.run.dir={run_dir}"]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        wall = time.perf_counter() - t0
        m = json.loads((run_dir / "metrics.json").read_text())
        log = (run_dir / "reconstruct.log").read_text()
        found = re.search(r"(\d+) hot pixels \([^)]*\)(?: and (\d+) pixels in (\d+) bright clusters)?", log)
        masked = (int(found.group(1)) + int(found.group(2) or 0)) if found else 0
        rows.append({"variant": variant, "pearson": round(m["pearson_global"], 4),
                     "fsc_mean": round(m["fsc"]["fsc_mean"], 4), "fsc05_A": m["fsc"].get("fsc05_A"),
                     "masked_pixels": masked, "process_wall_s": round(wall, 1)})
    print(f"{'variant':8} {'pearson':>8} {'fsc_mean':>9} {'fsc05_A':>8} {'masked':>7} {'wall_s':>7}")
    for r in rows:
        fsc05 = "never" if r["fsc05_A"] is None else f"{r['fsc05_A']:.1f}"
        print(f"{r['variant']:8} {r['pearson']:8.4f} {r['fsc_mean']:9.4f} {fsc05:>8} {r['masked_pixels']:7d} "
              f"{r['process_wall_s']:7.1f}")
    device = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    path = write_result("bench_hot_pixels", "phantom64", device, rows, out_dir=args.out_dir,
                        hits={"views": args.views, "seed": args.seed, "pixels_raised": raised})
    shutil.rmtree(work, ignore_errors=True)
    print(path)


if __name__ == "__main__":
    main()
