#!/usr/bin/env python
"""bench_cli: how long the answers that need no reconstruction take, as a user meets them.

Each command is a whole ``python -m fasttomo.cli.<entry> ...`` process, from interpreter start to
exit, run ``--repeat`` times (median, min, max); the exit code each must give is checked, and
whether the process imported torch (``-X importtime``: help and config errors must not):

    help            fasttomo-reconstruct --help
    help-key        fasttomo-reconstruct --help optim.steps
    config-error    fasttomo-reconstruct optim.stepz=3 (a mistyped key: exit 2)
    simulate-help   fasttomo-simulate --help

    python scripts/bench_cli.py --repeat 5

Prints a table, writes benchmarks/results/bench_cli-start-<device>-<commit>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import write_result  # noqa: E402

COMMANDS = {  # name -> (module, arguments, exit code it must give)
    "help": ("fasttomo.cli.reconstruct", ["--help"], 0),
    "help-key": ("fasttomo.cli.reconstruct", ["--help", "optim.steps"], 0),
    "config-error": ("fasttomo.cli.reconstruct", ["optim.stepz=3"], 2),
    "simulate-help": ("fasttomo.cli.simulate", ["--help"], 0),
}


def one(module: str, args: list[str], env: dict, cwd: str) -> tuple[float, int, bool]:
    """(wall seconds, exit code, whether torch was imported) of one process."""
    cmd = [sys.executable, "-X", "importtime", "-m", module, *args]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    torch_imported = any(line.rstrip().endswith("| torch") for line in res.stderr.splitlines())
    return wall, res.returncode, torch_imported


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_cli_") as cwd:
        one("fasttomo.cli.reconstruct", ["--help"], env, cwd)  # the byte-code cache, once, untimed
        for name, (module, cli_args, code) in COMMANDS.items():
            runs = [one(module, cli_args, env, cwd) for _ in range(args.repeat)]
            walls = [w for w, _, _ in runs]
            bad = [c for _, c, _ in runs if c != code]
            if bad:
                raise SystemExit(f"{name}: exit code {bad[0]}, expected {code}")
            rows.append({"variant": name, "command": " ".join([module.rsplit(".", 1)[1], *cli_args]),
                         "median_s": round(statistics.median(walls), 3), "min_s": round(min(walls), 3),
                         "max_s": round(max(walls), 3), "exit_code": code,
                         "imports_torch": any(t for _, _, t in runs)})
    print(f"{'command':15s} {'median s':>9s} {'min s':>7s} {'max s':>7s}  torch")
    for r in rows:
        print(f"{r['variant']:15s} {r['median_s']:9.3f} {r['min_s']:7.3f} {r['max_s']:7.3f}  "
              f"{'imported' if r['imports_torch'] else 'not imported'}")
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"  # the machine; no run uses it
    path = write_result("bench_cli", "start", device, rows, out_dir=Path(args.out_dir) if args.out_dir else None,
                        python=sys.version.split()[0], cpus=os.cpu_count())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
