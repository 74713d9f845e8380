"""Would importing torch in a thread, while Hydra composes the run's config, start a run sooner?

A run's entry point composes the config (Hydra, omegaconf, the override parser) before anything
imports torch (``--help`` and config errors never load it). This times, in fresh processes taken
in turn, the two steps one after the other and with ``import torch`` in a thread beside the
composition, and ``import torch`` alone:

    python scripts/bench_import_overlap.py --repeat 5 [--out-dir DIR]

Rows: ``sequential_s`` and ``threaded_s`` (the process's own clock from its start to both steps
done) and ``torch_import_s``; the median of each. Where imports are bound by the CPU under the
GIL (the 2-core CPU, page cache warm) the thread cannot gain; where they wait on the disk it may.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys, time, threading
mode = sys.argv[1]
t0 = time.perf_counter()

def compose():
    from hydra import compose, initialize_config_dir
    from fasttomo.cli.reconstruct import register_schema, to_config
    from fasttomo.config import config_dir
    register_schema()
    with initialize_config_dir(config_dir(), version_base="1.3"):
        to_config(compose("reconstruct"), [])

if mode == "torch":
    import torch  # noqa: F401
elif mode == "sequential":
    compose()
    import torch  # noqa: F401
else:
    th = threading.Thread(target=lambda: __import__("torch"))
    th.start()
    compose()
    th.join()
    import torch  # noqa: F401
print(time.perf_counter() - t0)
"""


def once(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=None, help="write the record here (default benchmarks/results)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from benchlib import device_name, write_result
    import torch

    once("torch")  # the first process pays for a cold page cache
    times: dict[str, list[float]] = {"torch": [], "sequential": [], "threaded": []}
    for _ in range(args.repeat):
        for mode in times:
            times[mode].append(once(mode))
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"variant": "default config", "torch_import_s": med["torch"], "sequential_s": med["sequential"],
           "threaded_s": med["threaded"], "gain_s": med["sequential"] - med["threaded"],
           "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()}}
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, indent=1))
    device = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    path = write_result("bench_import_overlap", "default", device, [row], out_dir=args.out_dir,
                        note="fresh processes in turn; each row's numbers are medians of --repeat")
    print(path)


if __name__ == "__main__":
    main()
