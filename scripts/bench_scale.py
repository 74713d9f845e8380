#!/usr/bin/env python
"""bench_scale: camera-sized tilt series, run as a user runs them -- where does the time go, what
memory does it take, and what quality comes out?

Every case is written to files first (MRC stack + .rawtlt angles, and the ground-truth MRC where
the case keeps one; projected on the GPU when there is one), then each method is a separate ``python -m fasttomo.cli.reconstruct`` process
with ``data=mrc`` and only the path, the angles and the thickness given, plus the method's own
overrides and ``evaluation.truth`` (scoring only). The numbers come from each run's metrics.json
(its ``timeline``) and the process itself:

    process_seconds   the process's wall time, interpreter start to exit
    step_seconds      training steps alone: the training time less the first step, validation and images
    fixed_seconds     start (process start to the run's start: imports, Hydra), data (reading,
                      preparing, building, up to the first training step), first_step (compile,
                      capture), validation, export (the volume evaluated and written), scoring
                      (against the truth), checkpoint (its copy to the host and the wait for its
                      background write), pictures (slices, loss, FSC and report pictures),
                      volume_disk (the wait for volume.mrc's last writes, fsync and rename, which
                      run on a thread from the export on), exit
                      (metrics.json, the closing summary, the interpreter's exit)
    pearson, pearson_fg, fsc05_A      against the truth (null without one)
    halfset_fsc0143_A                  with --half-sets (a second, even/odd run of each method), or
                                       --half-sets-in-row (the row's own run fits the halves too, after
                                       its export: fixed_seconds.half_sets, inside process_seconds)
    estimate_GB, estimate_over_peak    with --estimate: the dry run's memory estimate and its ratio to the
                                       measured peak (the GPU's; on a CPU the host's)

``--warmup`` runs each case once untimed first (30 steps, a 16 x 128 x 128 export), so that the first step of the rows
loads the kernels from Triton's on-disk cache instead of compiling them (rows say
``kernel_cache``). Each run's volumes are deleted once it is scored (the disk of a lent GPU machine holds one
camera4k volume at a time); its metrics.json and log stay in the work folder.
    peak_gpu_GB, peak_host_GB          torch's peak allocation; the process's peak resident memory
    peak_host_GB_at                    the process's peak resident memory when training starts, when
                                       the export starts and when it ends (the run's timeline)
    peak_GB_by_phase                   with half sets: the host and GPU peaks of the main run, each
                                       half's fit and volume, and their FSC, each phase's own
    peak_gpu_before_scoring_GB         torch's peak before the scoring against a truth, which copies the
                                       pair to the GPU only where it has room (the run's own need; the
                                       estimate is compared with it)

Cases (5 % noise relative to the clean projections' maximum; 8 random ellipsoids; +-60 degrees):

    tiny       64^2 x 21 views, thickness 32, 150 steps (a smoke run for a CPU)
    camera1k   1024^2 x 61 views, thickness 256
    camera2k   2048^2 x 121 views, thickness 512
    camera4k   4096^2 x 121 views, thickness 256 (no truth file: the box alone is 17 GB)

Methods (``--methods``):

    field-default   nothing but the data (the defaults, sized from it)
    field-best      the best recipe measured at camera size: the defaults with BEST_STEPS steps
                    (at 2048^2 on an H200, 10500: FSC 0.5 at 38.7 A against 45.4-54.2 A for 5250)
    sirt            model=sirt, scored every SIRT_CURVE_EVERY iterations up to SIRT_ITERATIONS: the
                    row is the best of them (by Pearson to the truth; the last without a truth)
    NAME            with --variant NAME="overrides": the defaults plus those overrides

    python scripts/bench_scale.py --cases tiny
    python scripts/bench_scale.py --cases camera1k camera2k --methods field-default sirt
    python scripts/bench_scale.py --cases camera2k --methods field-default --variant long="optim.steps=10500"

Prints a table, writes benchmarks/results/bench_scale-<case>-<device>-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))

from benchlib import timed_process, write_result  # noqa: E402

SEED = 0
VARIANTS: dict[str, str] = {}
"""--variant NAME="overrides": field runs of the defaults plus those overrides (filled by main)."""
SIRT_ITERATIONS = 50
SIRT_CURVE_EVERY = 10
"""SIRT is scored against the truth every this many iterations (the row: the best of them)."""
CASES = {
    "tiny": {"size": 64, "n_tilts": 21, "thickness": 32, "truth": True, "field": ["optim.steps=150"]},
    "camera1k": {"size": 1024, "n_tilts": 61, "thickness": 256, "truth": True},
    "camera2k": {"size": 2048, "n_tilts": 121, "thickness": 512, "truth": True},
    "camera4k": {"size": 4096, "n_tilts": 121, "thickness": 256, "truth": False},
}


BEST_STEPS = {"camera1k": 8000, "camera2k": 10500, "camera4k": 13000}
"""field-best's steps: twice what the defaults gave before they grew to 2000 steps per doubling."""


def best_recipe(case: str) -> list[str]:
    """field-best: the defaults with :data:`BEST_STEPS` steps (the best recipe measured at camera
    size: at 2048^2 x 121 on an H200, 10500 steps gave FSC 0.5 at 38.7 A against 45.4-54.2 A for
    5250 steps)."""
    return [f"optim.steps={BEST_STEPS[case]}"] if case in BEST_STEPS else []


def make_case(name: str, work: Path) -> dict:
    """Write the case's stack, angles and (if kept) truth once; returns their paths."""
    from fasttomo.config import DataConfig
    from fasttomo.data.io import write_tiltseries
    from fasttomo.data.io.volume import write_volume
    from fasttomo.data.phantom import make_tiltseries

    spec = CASES[name]
    folder = work / "cases" / name
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / name
    files = {"stack": f"{base}.mrc", "angles": f"{base}.rawtlt", "thickness": spec["thickness"],
             "truth": f"{base}_truth.mrc" if spec["truth"] else None}
    if Path(files["stack"]).exists() and Path(files["angles"]).exists():
        return files
    import torch

    ts = make_tiltseries(DataConfig(phantom="ellipsoids", width=spec["size"], height=spec["size"],
                                    thickness=spec["thickness"], n_tilts=spec["n_tilts"], tilt_min=-60.0,
                                    tilt_max=60.0, noise=0.05, noise_relative_to="max", phantom_seed=SEED),
                         device="cuda" if torch.cuda.is_available() else None, truth=spec["truth"])
    if files["truth"]:
        write_volume(files["truth"], ts.ground_truth, ts.pixel_size, label=f"bench_scale {name} truth", attrs={},
                     fmt="mrc", overwrite=True)
    write_tiltseries(files["stack"], ts, "mrc", overwrite=True)  # last: its presence means the case is whole
    return files


def cli_args(case: str, files: dict, method: str, work: Path, half_sets: bool) -> tuple[str, Path, list[str]]:
    """(tag, run folder, fasttomo-reconstruct arguments) of one run."""
    tag = f"{case}-{method}" + ("-halfsets" if half_sets else "")
    out = work / "runs" / tag
    args = ["data=mrc", f"data.path={files['stack']}", f"data.angles={files['angles']}",
            f"data.thickness={files['thickness']}", "logging=quiet", f"hydra.run.dir={out}"]
    if method == "warmup":  # untimed: compiles the case's kernels into Triton's on-disk cache; a small
        return tag, out, args + ["optim.steps=30", "output.volume_shape=[16,128,128]"]  # export: seconds, not GB
    if files["truth"]:
        args.append(f"evaluation.truth={files['truth']}")
    if method == "field-best":
        args += best_recipe(case)
    if method != "sirt":
        args += CASES[case].get("field", [])  # the tiny case's short fit (a CPU smoke run)
        args += shlex.split(VARIANTS.get(method, ""))
    else:
        args += ["model=sirt", f"model.iterations={SIRT_ITERATIONS}"]
        if files["truth"]:
            args.append(f"evaluation.curve_every={SIRT_CURVE_EVERY}")
    if half_sets:
        args += ["evaluation.half_sets=true", "evaluation.curve_every=0"]
    return tag, out, args


def run_method(case: str, files: dict, method: str, work: Path, half_sets: bool, python: str) -> dict:
    """One fasttomo-reconstruct process; returns its metrics.json plus the process's wall time and
    peak resident memory (os.wait4 of that child alone)."""
    tag, out, args = cli_args(case, files, method, work, half_sets)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    cmd = [python, "-m", "fasttomo.cli.reconstruct", *args]
    log = work / "runs" / f"{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    wall, peak, code = timed_process(cmd, env, work, log)
    if code != 0:
        raise SystemExit(f"{tag} failed (exit {code}):\n{log.read_text()[-3000:]}")
    m = json.loads((out / "metrics.json").read_text())
    for vol in out.glob("volume*.*"):
        vol.unlink()  # tens of GB at camera size: the next method needs the disk
    m["_command"] = "fasttomo-reconstruct " + " ".join(shlex.quote(a) for a in args)
    m["_process_seconds"] = wall
    m["_peak_host_bytes"] = peak
    return m


_UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def dry_estimate(case: str, files: dict, method: str, work: Path, half_sets: bool, python: str) -> float | None:
    """The dry run's memory estimate (bytes, on the run's device) of the method's command (with
    ``half_sets``, the command that fits them too), from its log line "memory on <device>
    (estimate): <n> <unit>"; None when it has none."""
    import re

    tag, out, args = cli_args(case, files, method, work, half_sets)
    log = work / "runs" / f"{tag}-dry.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    _, _, code = timed_process([python, "-m", "fasttomo.cli.reconstruct", *args, "dry_run=true"], env, work, log)
    found = re.search(r"\(estimate\): ([0-9.]+) (B|kB|MB|GB|TB)", log.read_text()) if code == 0 else None
    return float(found.group(1)) * _UNITS[found.group(2)] if found else None


def _waited(ckpt):
    """The run's seconds for its checkpoint: the copy to the host and the wait for its background write."""
    return ckpt.get("copy", 0.0) + ckpt.get("wait", 0.0) if isinstance(ckpt, dict) else ckpt


def _r(x, nd: int = 3):
    return None if x is None else round(float(x), nd)


def row_of(case: str, method: str, m: dict) -> dict:
    """The result row of one run (for sirt with a truth: the best iteration's quality)."""
    tl = m.get("timeline") or {}
    start = tl.get("process_to_run_start_s")
    train_start = tl.get("process_to_training_start_s")
    first, val, img = tl.get("first_step_s"), tl.get("validation_s") or 0.0, tl.get("images_s") or 0.0
    steps = None
    if m.get("train_seconds") is not None and first is not None:
        steps = m["train_seconds"] - first - val - img
    row = {"variant": method, "method": method, "case": case, "command": m["_command"],
           "process_seconds": _r(m["_process_seconds"], 2),
           "step_seconds": _r(steps),
           "fixed_seconds": {"start": _r(start), "data": _r(train_start - start if train_start is not None else None),
                             "first_step": _r(first), "validation": _r(val if first is not None else None),
                             "export": _r(tl.get("export_s", m.get("export_seconds"))),  # SIRT: export_seconds
                             "scoring": _r(tl.get("scoring_s")), "checkpoint": _r(_waited(tl.get("checkpoint_s"))),
                             "pictures": _r(tl.get("pictures_s")),
                             "volume_disk": _r((tl.get("volume_publish_s") or {}).get("wait")),
                             "half_sets": _r(m.get("half_sets_seconds")),
                             "exit": _r(m["_process_seconds"] - tl["process_to_end_s"]
                                        if tl.get("process_to_end_s") is not None else None)},
           "pearson": m.get("pearson_global"), "pearson_fg": m.get("pearson_foreground"),
           "fsc05_A": m.get("fsc05_A"), "halfset_fsc0143_A": None,
           "peak_gpu_GB": _r(tl["peak_gpu_bytes"] / 1e9) if tl.get("peak_gpu_bytes") else None,
           "peak_gpu_before_scoring_GB": (_r(tl["peak_gpu_bytes_before_scoring"] / 1e9)
                                          if tl.get("peak_gpu_bytes_before_scoring") else None),
           "peak_host_GB_at": {k: _r(v / 1e9) for k, v in (tl.get("peak_host_bytes_at") or {}).items() if v},
           "peak_GB_by_phase": {k: {d: _r(b / 1e9) if b else None for d, b in v.items()}
                                for k, v in (tl.get("peak_bytes_by_phase") or {}).items()},
           "peak_host_GB": _r((tl.get("peak_host_bytes") or m["_peak_host_bytes"]) / 1e9),  # the run's own
           "steps": m.get("steps"), "plane_tv": m.get("plane_tv")}
    if method == "sirt" and m.get("curve"):
        best = max(m["curve"], key=lambda r: r.get("pearson_global") or -1)
        row.update(method=f"sirt-{best['step']}", variant=f"sirt-{best['step']}", pearson=best.get("pearson_global"),
                   pearson_fg=best.get("pearson_foreground"), iterations=best["step"])
    if method == "sirt":
        row["step_seconds"] = _r(m.get("train_seconds"))
        row.setdefault("iterations", m.get("steps"))
    return row


def _fmt(v, spec: str) -> str:
    return format("-", f">{spec.split('.')[0]}") if v is None else format(v, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'case':9s} {'method':14s} {'process s':>9s} {'steps s':>8s} {'start':>6s} {'data':>7s} {'1st':>6s} "
            f"{'val':>6s} {'export':>7s} {'score':>6s} {'pearson':>8s} {'fg':>7s} {'FSC.5 A':>8s} {'host GB':>8s}")
    print(head)
    for r in rows:
        fx = r["fixed_seconds"]
        print(f"{r['case']:9s} {r['method']:14s} {_fmt(r['process_seconds'], '9.1f')} "
              f"{_fmt(r['step_seconds'], '8.1f')} "
              f"{_fmt(fx['start'], '6.1f')} {_fmt(fx['data'], '7.1f')} {_fmt(fx['first_step'], '6.1f')} "
              f"{_fmt(fx['validation'], '6.1f')} {_fmt(fx['export'], '7.1f')} {_fmt(fx['scoring'], '6.1f')} "
              f"{_fmt(r['pearson'], '8.4f')} {_fmt(r['pearson_fg'], '7.4f')} {_fmt(r['fsc05_A'], '8.1f')} "
              f"{_fmt(r['peak_host_GB'], '8.2f')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["camera1k", "camera2k", "camera4k"], choices=list(CASES))
    ap.add_argument("--methods", nargs="*", default=["field-default", "field-best", "sirt"],
                    choices=["field-default", "field-best", "sirt"])
    ap.add_argument("--variant", action="append", default=[], metavar='NAME="OVERRIDES"',
                    help="one more field method: the defaults plus these overrides (repeatable)")
    ap.add_argument("--half-sets", action="store_true", help="a second run per method with evaluation.half_sets=true "
                    "(fills halfset_fsc0143_A)")
    ap.add_argument("--half-sets-in-row", action="store_true", help="one run per method, with "
                    "evaluation.half_sets=true: the row's times and peaks are that run's, its process time holding the "
                    "two half fits too (fixed_seconds.half_sets): half the device time of --half-sets")
    ap.add_argument("--warmup", action="store_true", help="one untimed 30-step field run of each case first, so "
                    "that the rows' first steps load the kernels from a warm cache (a user's second run) instead of "
                    "compiling them (a fresh machine's first)")
    ap.add_argument("--estimate", action="store_true", help="a dry run of each method first: its memory estimate "
                    "beside the measured peak (estimate_GB, estimate_over_peak)")
    ap.add_argument("--work", default=None, help="folder for case files and runs (default: a temp folder)")
    ap.add_argument("--out-dir", default=None, help="where the JSON records go (default benchmarks/results)")
    ap.add_argument("--sirt-iterations", type=int, default=SIRT_ITERATIONS, metavar="N",
                    help=f"sirt's iteration count (default {SIRT_ITERATIONS}; with a truth, the best of every "
                         f"{SIRT_CURVE_EVERY} up to it)")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    globals()["SIRT_ITERATIONS"] = args.sirt_iterations  # cli_args and the record read it
    for v in args.variant:
        name, sep, overrides = v.partition("=")
        if not sep or not name or name in ("field-default", "field-best", "sirt", "warmup"):
            ap.error(f"--variant {v!r}: give NAME=\"overrides\" with a new name, e.g. long=\"optim.steps=10000\"")
        VARIANTS[name] = overrides
    methods = [*args.methods, *VARIANTS]

    import tempfile

    import torch

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_scale_")).resolve()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    all_rows = []
    for case in args.cases:
        files = make_case(case, work)
        rows = []
        if args.warmup and any(m != "sirt" for m in methods):
            run_method(case, files, "warmup", work, False, args.python)
        for method in methods:
            estimate = dry_estimate(case, files, method, work, args.half_sets_in_row, args.python) if args.estimate else None
            m = run_method(case, files, method, work, args.half_sets_in_row, args.python)
            row = row_of(case, method, m)
            row["kernel_cache"] = "warm" if args.warmup else "as found"
            if estimate is not None:  # the device's estimate against its measured peak (GPU; else the host's)
                peak = (row["peak_gpu_before_scoring_GB"] or row["peak_gpu_GB"]) if device != "cpu" else row["peak_host_GB"]
                row["estimate_GB"] = _r(estimate / 1e9)
                row["estimate_over_peak"] = _r(estimate / 1e9 / peak) if peak else None
            if args.half_sets:
                hs = run_method(case, files, method, work, True, args.python).get("half_sets") or {}
            elif args.half_sets_in_row:
                hs = m.get("half_sets") or {}
                row["half_sets_in_row"] = True
            if args.half_sets or args.half_sets_in_row:  # no crossing: at Nyquist or finer ("not crossed")
                row["halfset_fsc0143_A"] = hs.get("fsc0143_A")
                row["halfset_fsc0143_status"] = (hs.get("fsc") or {}).get("fsc0143_status")
            rows.append(row)
            print_table([row])
            # after every method, so that a case cut short keeps the rows it has
            path = write_result("bench_scale", case, device, rows,
                                out_dir=Path(args.out_dir) if args.out_dir else None, work=str(work), noise=0.05,
                                sirt_iterations=SIRT_ITERATIONS)
            print(f"wrote {path}")
            sys.stdout.flush()
        all_rows += rows
    print()
    print_table(all_rows)


if __name__ == "__main__":
    main()
