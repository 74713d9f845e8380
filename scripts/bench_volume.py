"""Time of the field's volume evaluation (``Projector.volume``, what the export runs slab by slab)
for one slab of Z planes at several chunk sizes (points per field evaluation), and whether each
chunk size gives the values of the first bit for bit.

    python scripts/bench_volume.py                       # camera2k's field: 2048^2 x 64 planes, on the GPU
    python scripts/bench_volume.py --case small --chunks 16 18    # a CPU-sized check

The field is the one a run builds from the data's size (model.resolutions from the box), at its
initial values (the evaluation's cost does not depend on them); the phantom's few views only size
the box. Writes one JSON record to benchmarks/results/ (and $OUT when set).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

CASES = {
    # camera2k's image size: planes [256, 512, 1024], a slab of 64 planes of 2048^2 (1 GiB of float32);
    # the box is 64 thick (its largest side, 2048, sizes the planes)
    "camera2k": (["data.width=2048", "data.height=2048", "data.n_tilts=3", "data.thickness=64"], 64),
    "small": (["data.width=128", "data.height=128", "data.n_tilts=3", "data.thickness=16"], 16),
}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchlib import device_name, median, write_result
    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.data.load import load_tiltseries
    from fasttomo.run.build import build

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="camera2k", choices=sorted(CASES))
    p.add_argument("--chunks", nargs="+", type=int, default=[18, 19, 20, 21, 22], help="log2 of the points per chunk")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    overrides, planes = CASES[args.case]
    cfg = compose_config([*overrides, "logging=quiet", "output.dir=/tmp/bench_volume", *args.extra])
    comps = build(cfg, load_tiltseries(cfg.data))
    proj, dev = comps.projector, comps.device
    shape = (planes, comps.ts.height, comps.ts.width)

    def slab(chunk: int):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            v = proj.volume(shape, chunk=chunk, z_range=(0, planes))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return v, (time.perf_counter() - t0) * 1e3

    rows, first = [], None
    for log2 in args.chunks:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        v, _ = slab(1 << log2)  # warm-up
        ms = [slab(1 << log2)[1] for _ in range(args.repeats)]
        first = v if first is None else first
        rows.append({"variant": f"chunk 2^{log2}", "chunk_points": 1 << log2, "slab_planes": planes,
                     "slab_ms_median": round(median(ms), 1), "slab_ms_min": round(min(ms), 1),
                     "same_values_as_first": bool(torch.equal(v, first)),
                     "peak_gpu_GB": round(torch.cuda.max_memory_allocated(dev) / 1e9, 2) if dev.type == "cuda" else None})
    print(f"{'chunk':>8}  {'slab ms':>8}  {'min ms':>8}  {'same values':>11}  {'peak GB':>7}   "
          f"({planes} planes of {shape[1]} x {shape[2]}, resolutions {[r[0] for r in proj.field.layout.resolutions]}, {device_name(dev)})")
    for r in rows:
        print(f"{r['variant'][6:]:>8}  {r['slab_ms_median']:8.1f}  {r['slab_ms_min']:8.1f}  "
              f"{str(r['same_values_as_first']):>11}  {r['peak_gpu_GB'] if r['peak_gpu_GB'] is not None else '-':>7}")
    if not args.no_write:
        extra = {"resolutions": [r[0] for r in proj.field.layout.resolutions], "slab_shape_zyx": list(shape)}
        path = write_result("bench_volume", args.case, device_name(dev), rows, argv=argv, **extra)
        print(f"wrote {path}")
        if os.environ.get("OUT"):
            write_result("bench_volume", args.case, device_name(dev), rows, argv=argv, out_dir=Path(os.environ["OUT"]),
                         **extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
