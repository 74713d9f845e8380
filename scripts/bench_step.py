"""Training-step time of the full pipeline (sampler -> poses -> rays -> field -> loss -> backward
-> Adam), for several variants of one configuration, in one process or under torchrun.

    python scripts/bench_step.py                                  # flagship, default variants
    python scripts/bench_step.py --case small128                  # 4096 rays x 128, T=4, C=16, 128
    python scripts/bench_step.py --case default --steps 20        # the embedded default config
    python scripts/bench_step.py --case camera2k --variants triton-bf16 --profile 5   # where it goes
    python scripts/bench_step.py --variants triton-fp32 triton-bf16-eager --extra pose=refine
    torchrun --standalone --nproc-per-node=2 scripts/bench_step.py --variants triton-fp32-eager

A variant is <backend>-<precision>[-graph|-eager]: backend torch|triton|auto, precision
fp32|bf16|fp16; without a suffix runtime.cuda_graph stays auto, i.e. the step is captured in a
CUDA graph where fasttomo-reconstruct would capture it (the variant a real run uses: each row
says ``cuda_graph``). Each step is timed with CUDA events after warm-up (wall time on the CPU);
the table shows the median ms per step, rays/s and sample points/s over all ranks, and peak memory.
Every variant also gets a per-phase breakdown from separate EAGER steps (CUDA events at the phase
borders: sampler, forward incl. losses and regularizers, backward, optimizer incl. the guard); in
eager steps the GPU also waits for Python to launch kernels, so the phases of a small problem add
up to more than its captured step. ``process_to_first_step_s`` is the time from process start
(interpreter and imports included) to the end of the first variant's first step (synchronized):
with a warm Triton cache it is what a user waits before training starts. ``--loss-tail N`` adds each
variant's mean training loss over its last N steps and its loss every 10 steps: with one seed the
variants draw the same batches, so a whole run's parity between them (``--steps 195 --warmup 5``
is 200 steps) reads against the spread over seeds.
Writes one JSON record to benchmarks/results/ (and $OUT when set) on rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from fasttomo import timeline  # noqa: F401  (imported first: the process clock)

CASES = {
    "flagship": ["experiment=flagship"],
    # the 128^3 shape of the upstream small benchmark
    "small128": ["data.width=128", "data.height=128", "model.n_rotations=4", "model.channels=16",
                 "model.resolutions=[128]", "sampler.batch_size=4096", "projector.samples_per_ray=128"],
    "default": [],
    # the camera2k series' sized step (docs/camera-scale.md: 8192 rays x 768 samples, planes
    # 256/512/1024 over a box four times wider than thick, T = 2, C = 8) on the embedded phantom's
    # 64 x 64 images with a box of the same shape: the points, planes and sample spacing in texels
    # are camera2k's, the images are small
    "camera2k": ["data.thickness=16", "model.resolutions=[256,512,1024]", "projector.samples_per_ray=768",
                 "sampler.batch_size=8192"],
}
PHASES = ("sampler", "forward", "backward", "optimizer")


def _phase_times(trainer, comps, steps: int) -> dict:
    """Median ms per phase over ``steps`` eager steps (CUDA events; wall clock on the CPU)."""
    dev = comps.device
    cuda = dev.type == "cuda"
    rows: dict[str, list[float]] = {p: [] for p in PHASES}
    graph, trainer.cuda_graph = trainer.cuda_graph, False  # phases of the eager body (the Trainer's own switch)
    try:
        for _ in range(steps):
            marks: dict[str, object] = {}

            def mark(name, marks=marks):
                if cuda:
                    e = torch.cuda.Event(enable_timing=True)
                    e.record()
                    marks[name] = e
                else:
                    marks[name] = time.perf_counter()

            trainer.phase_mark = mark
            mark("sampler")
            batch = comps.sampler.next_batch()
            trainer.train_step(batch)
            if cuda:
                torch.cuda.synchronize(dev)
            order = ("sampler", "forward", "backward", "optimizer", "done")
            for a, b in zip(order, order[1:]):
                ta, tb = marks[a], marks[b]
                rows[a].append(ta.elapsed_time(tb) if cuda else (tb - ta) * 1e3)
    finally:
        trainer.phase_mark = None
        trainer.cuda_graph = graph
    return {f"{p}_ms": round(sorted(v)[len(v) // 2], 3) for p, v in rows.items()}


def _annotation(event) -> bool:
    """A device-side range of a ``record_function`` (the optimizer's ``Optimizer.step#Adam.step``
    spans its fused Adam kernels): counted as a kernel it would count their time twice."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("Optimizer.")


def _profile(trainer, comps, steps: int, top: int = 25) -> dict:
    """``steps`` EAGER steps under torch.profiler: the ``top`` ops (aten, fasttomo, autograd nodes) by
    their own time per step, each with its input shapes (GPU time on CUDA, CPU time on the CPU:
    there the native kernels called from Python are no op and not listed) and, on CUDA, the ``top``
    kernels (memcpy and memset too) by GPU time with the sum of every kernel's time per step
    (against the captured step's time: what is left is launch gaps the graph does not remove) and,
    apart, the part of that sum the copies and fills take."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dev = comps.device
    cuda = dev.type == "cuda"
    graph, trainer.cuda_graph = trainer.cuda_graph, False
    try:
        trainer.train_step(comps.sampler.next_batch())  # the eager body's own first launches, unprofiled
        if cuda:
            torch.cuda.synchronize(dev)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(steps):
                trainer.train_step(comps.sampler.next_batch())
            if cuda:
                torch.cuda.synchronize(dev)
    finally:
        trainer.cuda_graph = graph
    ops = []
    for e in prof.key_averages(group_by_input_shape=True):
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        # host-side ops (aten, fasttomo, autograd nodes), not the kernels (device-side records, whose
        # names have "::" too) nor runtime calls
        if us > 0 and e.device_type == DeviceType.CPU and "::" in e.key:
            ops.append([e.key, str(e.input_shapes)[:160], e.count / steps, us / steps / 1e3])
    ops.sort(key=lambda r: -r[3])
    out = {"steps": steps, "ops_time": "GPU" if cuda else "CPU",
           "ops_top": [[n, shp, round(c, 2), round(t, 4)] for n, shp, c, t in ops[:top]]}
    if cuda:
        per_name: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type != DeviceType.CUDA or _annotation(e):  # host-side records; ranges, not kernels
                continue
            acc = per_name.setdefault(e.name, [0, 0.0])
            acc[0] += 1
            acc[1] += e.time_range.elapsed_us()
        rows = sorted(([n, c / steps, t / steps / 1e3] for n, (c, t) in per_name.items()), key=lambda r: -r[2])
        copies = sum(r[2] for r in rows if r[0].startswith(("Memcpy", "Memset")))
        out.update(kernel_ms_per_step=round(sum(r[2] for r in rows), 3), copy_ms_per_step=round(copies, 3),
                   launches_per_step=round(sum(r[1] for r in rows), 1),
                   top=[[n[:160], round(c, 2), round(t, 4)] for n, c, t in rows[:top]])
    return out


def main(argv: list[str] | None = None) -> int:
    from benchlib import cuda_times_ms, device_name, median, write_result
    from fasttomo.run.build import build, make_trainer
    from fasttomo.data.load import load_tiltseries
    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.train.distributed import all_reduce_mean, dist_info, init_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="flagship", choices=sorted(CASES))
    p.add_argument("--variants", nargs="+", default=["torch-fp32-eager", "triton-fp32", "triton-bf16",
                                                      "triton-bf16-eager"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--phase-steps", type=int, default=10, help="eager steps timed per phase (0: none)")
    p.add_argument("--profile", type=int, default=0,
                   help="eager steps under torch.profiler per variant: the ops (with their input shapes) by "
                        "their own GPU time (CPU time on the CPU) and, on CUDA, the kernels (memcpy and memset "
                        "too) by GPU time (one process only; 0: none)")
    p.add_argument("--loss-tail", type=int, default=0,
                   help="also record the mean training loss of each variant's last N steps and its loss "
                        "every 10 steps (a parity check between variants over a whole run: --steps 195 "
                        "--warmup 5 is 200 steps)")
    p.add_argument("--extra", nargs="*", default=[], help="more config overrides for every variant")
    p.add_argument("--label", default="", help="appended to the record's case name (an A/B's two sides)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, local_rank = dist_info()
    rows = []
    dev = None
    first_step_s = None
    for variant in args.variants:
        parts = variant.split("-")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("graph", "eager")):
            p.error(f"variant {variant!r}: expected <backend>-<precision>[-graph|-eager]")
        backend, prec = parts[:2]
        graph = {"graph": "on", "eager": "off"}.get(parts[2] if len(parts) == 3 else "", "auto")
        ov = [*CASES[args.case], "logging=quiet", "output.dir=/tmp/bench_step", f"kernels.backend={backend}",
              f"precision={prec}", f"runtime.cuda_graph={graph}", *args.extra]
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
            # a captured step returns the same output buffer every replay: keep a copy for the curve
            losses.append(loss.detach().clone() if args.loss_tail else loss)
            state["step"] += 1

        if first_step_s is None:
            one_step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            first_step_s = timeline.since_start()
        times = cuda_times_ms(one_step, args.steps, args.warmup, dev)
        ms = median(times)
        if world > 1:  # the slowest rank sets the pace
            ms = float(all_reduce_mean(torch.tensor([ms], device=dev)).item())
        rays = comps.sampler.batch_size * world  # the resolved batch (cfg may say null: automatic)
        row = {
            "variant": variant,
            "cuda_graph": bool(trainer.cuda_graph),
            "median_ms": round(ms, 3),
            "min_ms": round(min(times), 3),
            "max_ms": round(max(times), 3),
            "rays_per_s": round(rays / (ms / 1e3), 1),
            "points_per_s": round(rays * comps.projector.samples_per_ray / (ms / 1e3), 1),
            "world_size": world,
            "final_loss": float(all_reduce_mean(losses[-1]).item()),
            "loss_rank0": float(losses[-1].item()),
        }
        if dev.type == "cuda":
            row["peak_mem_GB"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 3)
        if args.loss_tail:
            curve = [float(v) for v in torch.stack([x.detach().float().reshape(()) for x in losses]).cpu()]
            row["steps_taken"] = len(curve)
            row["loss_tail_steps"] = min(args.loss_tail, len(curve))
            row["loss_tail_mean"] = sum(curve[-args.loss_tail:]) / row["loss_tail_steps"]
            row["loss_every_10"] = curve[9::10]
        if args.phase_steps and world == 1:
            row["phases_eager"] = _phase_times(trainer, comps, args.phase_steps)
        if args.profile and world == 1:
            row["kernels_eager"] = _profile(trainer, comps, args.profile)
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
        rows.append(row)
        del trainer, comps
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
    if rank == 0:
        print(f"bench_step case={args.case} device={device_name(dev)} world={world} torch={torch.__version__} "
              f"process start -> first step {first_step_s:.2f} s")
        print(f"{'variant':<20}{'graph':>6}{'median ms':>11}{'Mrays/s':>10}{'Gpts/s':>9}{'peak GB':>9}"
              f"{'loss':>12}  phases ms (eager: sampler/fwd/bwd/opt)")
        for r in rows:
            ph = r.get("phases_eager", {})
            print(f"{r['variant']:<20}{str(r['cuda_graph']):>6}{r['median_ms']:>11.2f}{r['rays_per_s'] / 1e6:>10.3f}"
                  f"{r['points_per_s'] / 1e9:>9.3f}{r.get('peak_mem_GB', 0.0):>9.2f}{r['final_loss']:>12.4e}  "
                  + "/".join(f"{ph.get(f'{q}_ms', float('nan')):.2f}" for q in PHASES))
        for r in rows:
            if "loss_tail_mean" in r:
                print(f"{r['variant']}: mean training loss of the last {r['loss_tail_steps']} of "
                      f"{r['steps_taken']} steps {r['loss_tail_mean']:.5e}")
        for r in rows:
            prof = r.get("kernels_eager")
            if not prof:
                continue
            if "top" in prof:
                print(f"{r['variant']}: kernels of an eager step {prof['kernel_ms_per_step']:.2f} ms in "
                      f"{prof['launches_per_step']:.0f} launches (copies and fills "
                      f"{prof.get('copy_ms_per_step', 0.0):.2f} ms of it); the most time:")
                for name, calls, ms in prof["top"]:
                    print(f"  {ms:8.3f} ms {calls:6.1f}x  {name[:100]}")
            print(f"{r['variant']}: the ops of an eager step by their own {prof['ops_time']} time:")
            for name, shapes, calls, ms in prof["ops_top"]:
                print(f"  {ms:8.3f} ms {calls:6.1f}x  {name} {shapes[:80]}")
        if not args.no_write:
            case = args.case if world == 1 else f"{args.case}-ddp{world}"
            case += f"-{args.label}" if args.label else ""
            argv_used = sys.argv[1:] if argv is None else argv
            for out in [None] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else []):
                path = write_result("bench_step", case, device_name(dev), rows, argv=argv_used, out_dir=out,
                                    steps=args.steps, warmup=args.warmup, overrides=args.extra,
                                    process_to_first_step_s=round(first_step_s, 3),
                                    process_start_exact=timeline.EXACT,
                                    env={k: v for k, v in os.environ.items() if k.startswith("FASTTOMO_")})
            print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
