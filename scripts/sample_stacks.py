#!/usr/bin/env python
"""sample_stacks: where a whole ``fasttomo-reconstruct`` process spends its start, thread by thread.

cProfile times functions (and, before Python 3.12, the main thread only); this samples the stack of
every thread about every 2 ms from a thread of its own while the run goes, then counts, for each
phase of the run's timeline (metrics.json: before the run's start, its start to training's, the
first step, the rest), which functions the main thread and the other threads were in. A function's
count is the number of samples with it anywhere on the stack; the sampling interval stretches when
threads hold the GIL, so compare shares within a phase, not counts across runs.

    python scripts/sample_stacks.py run  OUT.json  [overrides ...]   # one run, its samples to OUT.json
    python scripts/sample_stacks.py show OUT.json  METRICS.json [--top 20]

``run`` passes the overrides to the command (add ``hydra.run.dir=<dir>`` to know where metrics.json
lands); ``show`` prints the table. Used on a GPU machine for the default run's warm start
(benchmarks/README.md, "The embedded default run").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time


def run(out: str, overrides: list[str]) -> None:
    samples, stop = [], threading.Event()

    def sampler() -> None:
        me = threading.get_ident()
        while not stop.is_set():
            now = time.perf_counter()
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                stack = []
                while frame is not None and len(stack) < 60:
                    stack.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
                    frame = frame.f_back
                samples.append((now, tid, stack))
            time.sleep(0.002)

    main_tid = threading.get_ident()
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    sys.argv = ["fasttomo-reconstruct", *overrides]
    from fasttomo.cli.reconstruct import main

    try:
        main()
    except SystemExit:
        pass
    stop.set()
    thread.join()
    from fasttomo.timeline import since_start

    with open(out, "w") as f:
        json.dump({"main": main_tid, "samples": [(since_start(t), tid, s) for t, tid, s in samples]}, f)


def show(path: str, metrics: str, top: int) -> dict:
    with open(path) as f:
        d = json.load(f)
    with open(metrics) as f:
        tl = json.load(f)["timeline"]
    edges = [("before the run's start", 0.0, tl["process_to_run_start_s"]),
             ("run start to training", tl["process_to_run_start_s"], tl["process_to_training_start_s"]),
             ("first step", tl["process_to_training_start_s"], tl["process_to_first_step_s"]),
             ("the rest", tl["process_to_first_step_s"], float("inf"))]
    summary = {}
    for name, a, b in edges:
        for who in ("main", "other"):
            counts, n = collections.Counter(), 0
            for t, tid, stack in d["samples"]:
                if a <= t < b and (tid == d["main"]) == (who == "main"):
                    n += 1
                    counts.update(set(stack))
            shown = [(fn, c) for fn, c in counts.most_common()
                     if c < 0.97 * n and "importlib" not in fn and "threading.py" not in fn][:top]
            summary[f"{name} / {who}"] = {"samples": n, "top": shown}
            print(f"== {name} [{a:.2f}, {b:.2f}) s, {who} thread(s): {n} samples")
            for fn, c in shown:
                print(f"   {c:5d}  {100 * c / max(n, 1):5.1f} %  {fn}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("overrides", nargs="*")
    s = sub.add_parser("show")
    s.add_argument("samples")
    s.add_argument("metrics")
    s.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    if args.mode == "run":
        run(args.out, args.overrides)
    else:
        show(args.samples, args.metrics, args.top)


if __name__ == "__main__":
    main()
