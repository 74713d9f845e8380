"""Training-step time of the full pipeline (sampler -> poses -> rays -> field -> loss -> backward
-> Adam), for several variants of one configuration, in one process or under torchrun.

    python scripts/bench_step.py                                  # flagship, default variants
    python scripts/bench_step.py --case default --steps 20        # the embedded default config
    python scripts/bench_step.py --variants triton-fp32 triton-bf16 --extra pose=refine
    torchrun --standalone --nproc-per-node=2 scripts/bench_step.py --variants triton-fp32

A variant is <backend>-<precision>: backend torch|triton|auto, precision fp32|bf16|fp16.
Each step is timed with CUDA events after warm-up (wall time on the CPU); the table shows the
median ms per step, rays/s and sample points/s over all ranks. Writes one JSON record to
benchmarks/results/ (and $OUT when set) on rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

CASES = {
    "flagship": ["experiment=flagship"],
    "default": [],
}


def main(argv: list[str] | None = None) -> int:
    from benchlib import cuda_times_ms, device_name, median, write_result
    from fasttomo.build import build, make_trainer
    from fasttomo.data.load import load_tiltseries
    from fasttomo.reconstruct import compose_config
    from fasttomo.train.distributed import all_reduce_mean, dist_info, init_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="flagship", choices=sorted(CASES))
    p.add_argument("--variants", nargs="+", default=["torch-fp32", "triton-fp32", "triton-bf16"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides for every variant")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, local_rank = dist_info()
    rows = []
    dev = None
    for variant in args.variants:
        backend, prec = variant.split("-")
        ov = [*CASES[args.case], "logging=quiet", "output.dir=/tmp/bench_step", f"kernels.backend={backend}",
              f"precision={prec}", *args.extra]
        cfg = compose_config(ov)
        ts = load_tiltseries(cfg.data)
        comps = build(cfg, ts, rank=rank, world_size=world, local_rank=local_rank)
        dev = comps.device
        trainer = make_trainer(comps, None)
        state = {"step": 0}
        losses = []

        def one_step():
            trainer._set_lr(state["step"])
            loss, _ = trainer.train_step(comps.sampler.next_batch())
            losses.append(loss)
            state["step"] += 1

        times = cuda_times_ms(one_step, args.steps, args.warmup, dev)
        ms = median(times)
        if world > 1:  # the slowest rank sets the pace
            ms = float(all_reduce_mean(torch.tensor([ms], device=dev)).item())
        rays = comps.sampler.batch_size * world  # the resolved batch (cfg may say null: automatic)
        row = {
            "variant": variant,
            "median_ms": round(ms, 3),
            "min_ms": round(min(times), 3),
            "max_ms": round(max(times), 3),
            "rays_per_s": round(rays / (ms / 1e3), 1),
            "points_per_s": round(rays * comps.projector.samples_per_ray / (ms / 1e3), 1),
            "world_size": world,
            "final_loss": float(all_reduce_mean(losses[-1]).item()),
            "loss_rank0": float(losses[-1].item()),
        }
        if world > 1:  # the replicas must agree: every rank's parameters and reduced loss
            import torch.distributed as dist

            local = torch.tensor([sum(float(p.detach().double().sum()) for p in comps.projector.parameters()),
                                  float(losses[-1])], device=dev, dtype=torch.float64)
            every = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(every, local)
            sums = [float(e[0]) for e in every]
            row["param_checksum_per_rank"] = sums
            row["param_checksum_max_diff"] = max(sums) - min(sums)
            row["local_loss_per_rank"] = [float(e[1]) for e in every]
        if dev.type == "cuda":
            row["peak_mem_GB"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
            torch.cuda.reset_peak_memory_stats(dev)
        rows.append(row)
        del trainer, comps
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"bench_step case={args.case} device={device_name(dev)} world={world} torch={torch.__version__}")
        print(f"{'variant':<16}{'median ms':>11}{'Mrays/s':>10}{'Gpts/s':>9}{'loss':>12}{'param diff':>12}")
        for r in rows:
            print(f"{r['variant']:<16}{r['median_ms']:>11.2f}{r['rays_per_s'] / 1e6:>10.3f}"
                  f"{r['points_per_s'] / 1e9:>9.3f}{r['final_loss']:>12.4e}{r.get('param_checksum_max_diff', 0.0):>12.3e}")
        if not args.no_write:
            case = args.case if world == 1 else f"{args.case}-ddp{world}"
            argv_used = sys.argv[1:] if argv is None else argv
            for out in [None] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
                path = write_result("bench_step", case, device_name(dev), rows, argv=argv_used, out_dir=out,
                                    steps=args.steps, warmup=args.warmup, overrides=args.extra)
            print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
