#!/usr/bin/env python
"""bench_half_volumes: are the half tomograms a run writes (``output.half_volumes=true``) the
ones it scored?

One bench_quality case (default ``noise5_128``) is written to files, then reconstructed once as a
user would (``python -m fasttomo.cli.reconstruct data=mrc ... output.half_volumes=true
evaluation.truth=...``). From the files the run wrote, this script computes:

    pearson_full, pearson_even, pearson_odd    each volume's Pearson correlation to the truth
    halfset_fsc_from_files                     the FSC of volume_even.mrc against volume_odd.mrc
                                                (every crossing in A: whole, measured region, wedge)
    halfset_fsc_of_run                         the same numbers from the run's metrics.json

and checks the issue's conditions: each half's Pearson within 0.02 of the full volume's, the FSC
from the files equal to the run's own (the curves to 1e-6).

    python scripts/bench_half_volumes.py                  # noise5_128
    python scripts/bench_half_volumes.py --size 32 --overrides optim.steps=30   # a CPU smoke run

Prints a table, writes benchmarks/results/bench_half_volumes-<case>-<device>-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))

from benchlib import write_result  # noqa: E402

PEARSON_TOLERANCE = 0.02


def main() -> None:
    import bench_quality as bq

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="noise5_128", choices=list(bq.CASES))
    ap.add_argument("--size", type=int, default=None, help="rescale the case to N x N pixels (bench_quality --size)")
    ap.add_argument("--overrides", default="", help="extra overrides of the run, e.g. optim.steps=30")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()

    import numpy as np
    import torch

    from fasttomo.data.io.volume import read_volume
    from fasttomo.quality.metrics import pearson
    from fasttomo.quality.scoring import pair_fsc

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_half_")).resolve()
    files = bq.make_case(args.case, work, bq.case_spec(args.case, args.size))
    out = work / "runs" / f"{args.case}-half-volumes"
    run_args = ["data=mrc", f"data.path={files['stack']}", f"data.angles={files['angles']}",
                f"data.thickness={files['thickness']}", f"evaluation.truth={files['truth']}",
                "output.half_volumes=true", "logging=quiet", f"hydra.run.dir={out}", *shlex.split(args.overrides)]
    if out.exists():
        import shutil

        shutil.rmtree(out)  # this script's own run folder of an earlier call
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fasttomo.cli.reconstruct", *run_args], capture_output=True,
                          text=True, cwd=work)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())

    truth = read_volume(files["truth"])[0]
    vols = {name: read_volume(out / f"volume{suffix}.mrc") for name, suffix in
            (("full", ""), ("even", "_even"), ("odd", "_odd"))}  # (volume, voxel size, attrs)
    headers_equal = all(v[1] == vols["full"][1] and v[0].shape == vols["full"][0].shape for v in vols.values())
    r = {name: pearson(v[0], truth) for name, v in vols.items()}
    angles = np.loadtxt(files["angles"])
    report, _ = pair_fsc(vols["even"][0], vols["odd"][0], vols["full"][1], (float(angles.min()), float(angles.max())))
    run_hs = metrics.get("half_sets") or {}
    flat = lambda d: {k: v for k, v in d.items() if isinstance(v, (int, float))}  # noqa: E731 - the crossings
    from_files, of_run = flat(report), flat(run_hs)
    fsc_equal = bool(of_run) and from_files.keys() == of_run.keys() and all(
        abs(from_files[k] - of_run[k]) <= 1e-6 * max(1.0, abs(of_run[k])) for k in of_run)
    row = {"variant": "field-default", "case": args.case, "process_seconds": round(wall, 2),
           "pearson_full": r["full"], "pearson_even": r["even"], "pearson_odd": r["odd"],
           "pearson_full_of_run": metrics.get("pearson_global"),
           "halfset_fsc_from_files": from_files, "halfset_fsc_of_run": of_run,
           "headers_equal": headers_equal, "halves_within_tolerance":
               all(abs(r[h] - r["full"]) <= PEARSON_TOLERANCE for h in ("even", "odd")),
           "fsc_from_files_equals_run": fsc_equal,
           "command": "fasttomo-reconstruct " + " ".join(shlex.quote(a) for a in run_args)}
    print(f"{'volume':8s} {'pearson':>8s}")
    for name in ("full", "even", "odd"):
        print(f"{name:8s} {r[name]:8.4f}")
    print(f"half-set FSC from the files {from_files}\nhalf-set FSC of the run    {of_run}")
    print(f"halves within {PEARSON_TOLERANCE} of the full volume: {row['halves_within_tolerance']}; "
          f"FSC equal: {fsc_equal}; headers equal: {headers_equal}")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    case = args.case + (f"-size{args.size}" if args.size else "")
    path = write_result("bench_half_volumes", case, device, [row],
                        out_dir=Path(args.out_dir) if args.out_dir else None, tolerance=PEARSON_TOLERANCE)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
