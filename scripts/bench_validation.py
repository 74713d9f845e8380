#!/usr/bin/env python
"""bench_validation: what one validation pass costs, and how the chunk size changes it.

For each case a trainer is built and trained for a few steps, then the whole validation set is
evaluated the way ``Trainer.validate`` does it (fp32, no autograd) in chunks of 1, 4 and 16
training batches, and in the training autocast (bf16 on a GPU) for comparison, plus
``Trainer.validate`` itself (the chunk ``Trainer.val_chunk_rays`` picks). Median of ``--reps``
synchronized passes each. The loss sums are printed so a changed chunking can be seen to give the
same validation loss.

    python scripts/bench_validation.py --cases clean128 small128 default

Prints a table, writes benchmarks/results/bench_validation-<cases>-<device>-<commit>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from benchlib import device_name, write_result  # noqa: E402

CASES = {
    "default": [],
    "clean128": ["data.phantom=ellipsoids", "data.width=128", "data.height=128", "data.thickness=128"],
    "small128": ["data.phantom=ellipsoids", "data.width=128", "data.height=128", "model.n_rotations=4",
                 "model.channels=16", "model.resolutions=[128]", "sampler.batch_size=4096",
                 "projector.samples_per_ray=128"],
}
VARIANTS = [("1 batch", 1, False), ("4 batches", 4, False), ("16 batches", 16, False),
            ("autocast, 1 batch", 1, True), ("autocast, 16 batches", 16, True)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["clean128", "small128", "default"], choices=list(CASES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warm-steps", type=int, default=20)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()

    from fasttomo.run.build import build, make_trainer
    from fasttomo.data.load import load_tiltseries
    from fasttomo.cli.reconstruct import compose_config

    rows, dev = [], torch.device("cpu")
    for case in args.cases:
        cfg = compose_config(CASES[case] + ["logging=quiet", f"output.dir=/tmp/bench_validation_{case}",
                                            f"optim.steps={args.warm_steps + 1}"])
        tr = make_trainer(build(cfg, load_tiltseries(cfg.data)), None)
        dev = tr.device
        tr.fit(steps=args.warm_steps)
        bs = tr.sampler.batch_size

        def one_pass(rays: int, autocast: bool) -> float:
            total = torch.zeros((), device=dev, dtype=torch.float64)
            with torch.no_grad():
                for b in tr.sampler.val_batches(rays):
                    with tr.precision.autocast() if autocast else torch.autocast(dev.type, enabled=False):
                        pred = tr.projector(b.tilt, b.row, b.col)
                    total += tr.projector.pixel_errors(pred, b).sum().double()
            return float(total)

        def timed(fn) -> float:
            fn()
            _sync(dev)
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                _sync(dev)
                ts.append(1e3 * (time.perf_counter() - t0))
            return statistics.median(ts)

        for label, k, ac in VARIANTS:
            loss = one_pass(k * bs, ac)
            rows.append({"case": case, "variant": label, "chunk_rays": k * bs, "n_val": tr.sampler.n_val,
                         "ms": round(timed(lambda: one_pass(k * bs, ac)), 3), "loss_sum": loss})
        rows.append({"case": case, "variant": "Trainer.validate", "chunk_rays": tr.val_chunk_rays(),
                     "n_val": tr.sampler.n_val, "ms": round(timed(tr.validate), 3), "loss_mean": tr.validate()})
    print(f"{'case':10s} {'variant':22s} {'chunk rays':>10s} {'ms':>9s}  loss")
    for r in rows:
        print(f"{r['case']:10s} {r['variant']:22s} {r['chunk_rays']:10d} {r['ms']:9.3f}  "
              f"{r.get('loss_sum', r.get('loss_mean')):.8g}")
    path = write_result("bench_validation", "-".join(args.cases), device_name(dev), rows,
                        out_dir=Path(args.out_dir) if args.out_dir else None)
    print(f"wrote {path.name}")


if __name__ == "__main__":
    main()
