"""The whole chain on the atomic phantom: simulate -> reconstruct (fasttomo's default field) -> trace.

    python scripts/bench_trace_chain.py                       # 64^3, radius 12 A (429 atoms)
    python scripts/bench_trace_chain.py --width 96 --radius 18

Runs the three real commands as processes:
  fasttomo-simulate    data.phantom=nanoparticle (two species, contrast 2), 61 tilts over +-70
                       degrees, 2 % noise (std 0.02 x the clean projections' maximum) -> the true
                       atoms <out>_atoms.csv
  fasttomo-reconstruct the same data, every other setting the default
  fasttomo-trace       volume=<run>/volume.mrc truth=<out>_atoms.csv classes=2
and writes benchmarks/results/bench_trace_chain-np<width>-<device>-<commit>.json with the
reconstruction's Pearson correlation and time and the trace's precision, recall, RMSD and species
accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchlib import write_result


def run(cmd: list[str], log: Path) -> float:
    t = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", *cmd], stdout=f, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        print(log.read_text()[-3000:])
        raise SystemExit(f"{' '.join(cmd[:1])} failed with exit code {r.returncode} (log: {log})")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--radius", type=float, default=12.0, help="particle radius in Angstrom")
    ap.add_argument("--noise", type=float, default=0.02)
    ap.add_argument("--work", default="chain_work", help="folder for the files of the three commands")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--reconstruct", nargs="*", default=[], help="extra fasttomo-reconstruct overrides")
    args = ap.parse_args()
    work = Path(args.work) / f"np{args.width}"
    work.mkdir(parents=True, exist_ok=False)
    data = ["data.phantom=nanoparticle", f"data.width={args.width}", f"data.height={args.width}",
            f"data.particle.radius={args.radius}", "data.particle.species=2", "data.n_tilts=61", "data.tilt_min=-70",
            "data.tilt_max=70", f"data.noise={args.noise}", "data.noise_relative_to=max"]
    sim = ["fasttomo.cli.simulate", f"out={work}/np", *data]
    rec = ["fasttomo.cli.reconstruct", *data, *args.reconstruct, f"hydra.run.dir={work}/rec"]
    tr = ["fasttomo.cli.trace", f"volume={work}/rec/volume.mrc", f"truth={work}/np_atoms.csv", "classes=2",
          f"hydra.run.dir={work}/trace"]
    t_sim = run(sim, work / "simulate.log")
    t_rec = run(rec, work / "reconstruct.log")
    t_tr = run(tr, work / "trace.log")
    rm = json.loads((work / "rec" / "metrics.json").read_text())
    tm = json.loads((work / "trace" / "metrics.json").read_text())
    t = tm["truth"]
    row = {"variant": f"np{args.width}-r{args.radius:g}", "n_true": t["n_true"], "n_traced": t["n_traced"],
           "precision": t["precision"], "recall": t["recall"], "rmsd_A": t["rmsd_A"], "rmsd_voxels": t["rmsd_voxels"],
           "species_accuracy": t.get("species_accuracy"), "match_radius_A": t["match_radius_A"],
           "reconstruct_pearson": rm.get("pearson_global"), "reconstruct_wall_s": rm.get("wall_seconds",
                                                                                          rm.get("wall_time_s")),
           "reconstruct_process_s": t_rec, "trace_s": tm["seconds"], "trace_device": tm["device"],
           "trace_process_s": t_tr, "simulate_process_s": t_sim, "voxel_A": tm["voxel_size_A"]}
    print(json.dumps(row, indent=2))
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    cmd = " && ".join("python -m " + " ".join(c) for c in (sim, rec, tr))
    path = write_result("bench_trace_chain", f"np{args.width}", dev, [row], out_dir=Path(args.out) if args.out
                        else None, command=f"python scripts/bench_trace_chain.py {' '.join(sys.argv[1:])}",
                        commands=cmd, load_average_1_5_15_min_at_end=list(os.getloadavg()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
