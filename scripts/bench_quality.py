#!/usr/bin/env python
"""bench_quality: what volume does fasttomo give, by default, against its own SIRT?

Every case is written to files first (MRC stack + .rawtlt angles + ground-truth MRC, as a
microscopist would hand them over) and every method runs as a user runs it: a fresh
``python -m fasttomo.cli.reconstruct`` process with ``data=mrc`` and only the path, the angles and the
thickness given, plus the method's own overrides and ``evaluation.truth`` (scoring only: the truth
never enters the fit). Quality is the Pearson correlation to the truth (whole volume and
specimen), the FSC against the truth (0.5 and 0.143 crossings, in A) and, in the ``--eval`` runs,
the even/odd half-set FSC and the held-out-view reprojection correlation, which need no truth.
``fit_seconds`` is the time spent fitting (the run's training loop or SIRT iterations), without
process start, file reading or scoring, with a warm kernel compile cache (one short untimed run
goes first; ``--no-warmup`` skips it); the curves give quality against fit seconds.

Cases (``--cases``; 61 tilts each; noise = Gaussian with a standard deviation of the given
fraction of the clean projections' maximum):

    default64     the embedded phantom (64 x 64 x 32, +-60 degrees), clean, as files
    noise5_64     the same, 5 % noise (a noisy case small enough for a 2-core CPU)
    clean128      8 random ellipsoids in a 128^3 box, +-60 degrees, clean
    noise5_128    the same, 5 % noise
    noise10_128   the same, 10 % noise
    wedge70_128   the same specimen, +-70 degrees, 5 % noise
    pose128       the same, 5 % noise, every view but the reference shifted (uniform +-3 px) and
                  rotated in plane (uniform +-1 degree); the true poses are scored
    axis128       pose128 plus an error of the tilt-axis angle: every view's image, the reference's
                  too, rotated by 1 degree more
    cell128_d20   data.phantom=cell (vesicles with two-leaflet bilayers, actin-like filaments,
                  ribosomes, a crowded texture, gold) at 10 A/px, 128 x 128 x 64, +-60 degrees,
                  Poisson counts of 20 electrons per pixel per view (docs/specimens.md)
    cell128_d200  the same at 200 e/px/view
    catalyst128_d20   data.phantom=catalyst (porous support, heavy 1-10 nm Wulff particles) at
                  2.5 A/px, 128^3, 20 e/px/view
    catalyst128_d200  the same at 200 e/px/view
    cell256_d20   the cell at 256 x 256 x 128, 20 e/px/view
    cellpose128_d200      cell128_d200 with pose128's misalignment (+-3 px, +-1 degree in plane)
    catalystpose128_d200  catalyst128_d200 with the same misalignment

The specimen cases (a dose) always add the half-set run (``--eval``) and are scored by the FSC
to the truth (0.5 and 0.143 crossings in A and ``fsc_mean``, the mean FSC to Nyquist), the
half-set FSC (crossings and mean) and Pearson. ``--size N`` rescales every case to N x N pixels
and its thickness alike (the specimen cases scale their pixel size too, so they keep their
physical size) for a quick end-to-end check; ``--overrides`` adds overrides to every field run (e.g. ``optim.steps=50``).

Methods (``--methods``):

    field-default   fasttomo-reconstruct with nothing but the data (the defaults)
    field-best      the best documented recipe (experiment=quality; the misaligned cases add pose=refine)
    sirt            model=sirt, SIRT_ITERATIONS iterations, scored every iteration: the row is
                    the best iteration count (by Pearson to the truth), the curve has them all

``--eval CASE ...`` adds, for those cases, one run of field-default and of sirt with evaluation.half_sets=true and four
held-out views (HOLDOUT), whose half-set FSC and reprojection correlation fill the rows'
``halfset_*`` and ``holdout_*`` columns.

    python scripts/bench_quality.py                         # the whole suite but the specimens
    python scripts/bench_quality.py --cases noise5_128 --methods field-default sirt
    python scripts/bench_quality.py --variant big="model.channels=16 model.n_rotations=4"
    python scripts/bench_quality.py --cases cell128_d20 cell128_d200 catalyst128_d20 catalyst128_d200 cell256_d20
    python scripts/bench_quality.py --cases clean128 noise5_128 noise10_128 --methods field-default \
        --variant tv100="loss.plane_tv=1e-1" --jobs 3    # a sweep, one process per case at once
    BENCH_QUALITY_SIRT_ITERATIONS=10 python scripts/bench_quality.py --cases cell128_d20 --size 32 \
        --methods field-default sirt --overrides "optim.steps=50" --no-warmup   # an end-to-end check in minutes

Prints a table and a time-to-quality table, writes benchmarks/results/bench_quality-<case>-<device>-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from benchlib import write_result  # noqa: E402

CASES = {
    "default64": dict(phantom="default", width=64, height=64, thickness=32, tilt=60.0, noise=0.0),
    "noise5_64": dict(phantom="default", width=64, height=64, thickness=32, tilt=60.0, noise=0.05),
    "clean128": dict(phantom="ellipsoids", width=128, height=128, thickness=128, tilt=60.0, noise=0.0),
    "noise5_128": dict(phantom="ellipsoids", width=128, height=128, thickness=128, tilt=60.0, noise=0.05),
    "noise10_128": dict(phantom="ellipsoids", width=128, height=128, thickness=128, tilt=60.0, noise=0.10),
    "wedge70_128": dict(phantom="ellipsoids", width=128, height=128, thickness=128, tilt=70.0, noise=0.05),
    "pose128": dict(phantom="ellipsoids", width=128, height=128, thickness=128, tilt=60.0, noise=0.05,
                    shift=3.0, rotation=1.0),
    "axis128": dict(phantom="ellipsoids", width=128, height=128, thickness=128, tilt=60.0, noise=0.05,
                    shift=3.0, rotation=1.0, axis=1.0),
    "cell128_d20": dict(phantom="cell", width=128, height=128, thickness=64, tilt=60.0, noise=0.0, dose=20.0,
                        pixel_size=10.0),
    "cell128_d200": dict(phantom="cell", width=128, height=128, thickness=64, tilt=60.0, noise=0.0, dose=200.0,
                         pixel_size=10.0),
    "catalyst128_d20": dict(phantom="catalyst", width=128, height=128, thickness=128, tilt=60.0, noise=0.0,
                            dose=20.0, pixel_size=2.5),
    "catalyst128_d200": dict(phantom="catalyst", width=128, height=128, thickness=128, tilt=60.0, noise=0.0,
                             dose=200.0, pixel_size=2.5),
    "cell256_d20": dict(phantom="cell", width=256, height=256, thickness=128, tilt=60.0, noise=0.0, dose=20.0,
                        pixel_size=10.0),
    "cellpose128_d200": dict(phantom="cell", width=128, height=128, thickness=64, tilt=60.0, noise=0.0, dose=200.0,
                             pixel_size=10.0, shift=3.0, rotation=1.0),
    "catalystpose128_d200": dict(phantom="catalyst", width=128, height=128, thickness=128, tilt=60.0, noise=0.0,
                                 dose=200.0, pixel_size=2.5, shift=3.0, rotation=1.0),
}
N_TILTS = 61
SEED = 0
SIRT_ITERATIONS = int(os.environ.get("BENCH_QUALITY_SIRT_ITERATIONS", 300))
CURVE_EVERY = 100
HOLDOUT = [8, 23, 39, 54]
"""1-based views held out in the --eval runs (spread over the tilt range, not the reference)."""
RECIPES = {
    "field-default": [],
    "field-best": ["experiment=quality"],
}
"""The overrides of each field method (field-best: the best recipe bench_quality has found)."""
POSE_OVERRIDES = ["pose=refine"]


def case_spec(name: str, size: int | None = None) -> dict:
    """The case's specimen; ``size`` rescales it to size x size pixels, the thickness (and, for the
    specimen cases, the pixel size) by the same factor."""
    spec = dict(CASES[name])
    if size:
        f = spec["width"] / float(size)
        spec.update(width=int(size), height=max(2, int(round(spec["height"] / f))),
                    thickness=max(2, int(round(spec["thickness"] / f))))
        if spec.get("pixel_size") or spec.get("dose"):
            spec["pixel_size"] = spec.get("pixel_size", 10.0) * f
        if spec.get("shift"):
            spec["shift"] = spec["shift"] / f
    return spec


def make_case(name: str, work: Path, spec: dict | None = None) -> dict:
    """Write the case's stack, angles, truth (and true poses) once; returns their paths."""
    from fasttomo.config import DataConfig
    from fasttomo.data.io import write_tiltseries
    from fasttomo.data.io.volume import write_volume
    from fasttomo.data.phantom import make_tiltseries

    spec = CASES[name] if spec is None else spec
    folder = work / "cases"
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / name
    files = {"stack": f"{base}.mrc", "angles": f"{base}.rawtlt", "truth": f"{base}_truth.mrc",
             "poses": f"{base}_poses.json" if spec.get("shift") else None, "thickness": spec["thickness"]}
    if Path(files["truth"]).exists():
        return files
    kw = dict(width=spec["width"], height=spec["height"], thickness=spec["thickness"], n_tilts=N_TILTS,
              tilt_min=-spec["tilt"], tilt_max=spec["tilt"], noise=spec["noise"], phantom_seed=SEED)
    if spec["phantom"] != "default":
        kw.update(phantom=spec["phantom"], noise_relative_to="max")
    elif spec["noise"]:
        kw.update(noise_relative_to="max")
    if spec.get("shift"):
        kw.update(pose_error_shift=spec["shift"], pose_error_rotation=spec["rotation"],
                  tilt_axis_error=spec.get("axis", 0.0))
    if spec.get("dose"):
        kw.update(dose=spec["dose"])  # Poisson counts, inverted so that mass is bright (fasttomo.data.dose)
    if spec.get("pixel_size"):
        kw.update(pixel_size=spec["pixel_size"])
    ts = make_tiltseries(DataConfig(**kw))
    write_tiltseries(files["stack"], ts, "mrc", overwrite=True)
    write_volume(files["truth"], ts.ground_truth, ts.pixel_size, label=f"bench_quality {name} truth", attrs={},
                 fmt="mrc", overwrite=True)
    if files["poses"]:
        from fasttomo.data.io.poses import write_poses_json

        write_poses_json(files["poses"], ts.metadata["true_poses"], source={"bench_quality": name}, overwrite=True)
    return files


def cli_args(case: str, files: dict, method: str, overrides: list[str], work: Path, eval_run: bool,
             sirt_iterations: int = SIRT_ITERATIONS) -> tuple[str, Path, list[str]]:
    """(tag, run folder, fasttomo-reconstruct arguments) of one run."""
    tag = f"{case}-{method}" + ("-eval" if eval_run else "")
    out = work / "runs" / tag
    args = ["data=mrc", f"data.path={files['stack']}", f"data.angles={files['angles']}",
            f"data.thickness={files['thickness']}", *overrides, f"evaluation.truth={files['truth']}",
            *([f"evaluation.true_poses={files['poses']}"] if files.get("poses") else []),
            "logging=quiet", f"hydra.run.dir={out}"]
    if method.startswith("sirt"):
        args += ["model=sirt", f"model.iterations={sirt_iterations}", "evaluation.curve_every=1"]
    else:
        args += [f"evaluation.curve_every={CURVE_EVERY}"]
    if eval_run:
        args += ["evaluation.half_sets=true", "evaluation.holdout_views=[" + ",".join(map(str, HOLDOUT)) + "]",
                 "evaluation.curve_every=0"]
    return tag, out, args


def run_method(case: str, files: dict, method: str, overrides: list[str], work: Path, eval_run: bool,
               python: str, sirt_iterations: int = SIRT_ITERATIONS) -> dict:
    """One fasttomo-reconstruct process; returns its metrics.json (plus the command)."""
    tag, out, args = cli_args(case, files, method, overrides, work, eval_run, sirt_iterations)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    cmd = [python, "-m", "fasttomo.cli.reconstruct", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tag} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    m = json.loads((out / "metrics.json").read_text())
    m["_command"] = "fasttomo-reconstruct " + " ".join(shlex.quote(a) for a in args)
    m["_process_seconds"] = wall
    return m


def row_of(case: str, method: str, m: dict, files: dict) -> dict:
    """The result row of one run (the best SIRT iteration for sirt)."""
    row = {"method": method, "case": case, "command": m["_command"]}
    if "_process_seconds" in m:
        row["process_seconds"] = round(m["_process_seconds"], 2)
    if method.startswith("sirt"):
        best = max(m["curve"], key=lambda r: r.get("pearson_global", -1))
        row.update(method=f"sirt-{best['step']}", fit_seconds=best["fit_seconds"], pearson=best["pearson_global"],
                   pearson_fg=best["pearson_foreground"], iterations=best["step"],
                   pearson_final=m.get("pearson_global"), fit_seconds_final=m.get("fit_seconds"))
        for it in (50, 100):
            at = [r for r in m["curve"] if r["step"] == it]
            if at:
                row[f"pearson_at_{it}_iterations"] = at[0]["pearson_global"]
                row[f"fit_seconds_at_{it}_iterations"] = at[0]["fit_seconds"]
    else:
        row.update(fit_seconds=m["train_seconds"], pearson=m.get("pearson_global"), pearson_fg=m.get("pearson_foreground"),
                   steps=m.get("steps"), exported_step=m.get("exported_step"), plane_tv=m.get("plane_tv"))
    for k in ("fsc05_A", "fsc0143_A", "fsc05_measured_A", "fsc05_wedge_A", "psnr_db"):
        if k in m:
            row[k] = m[k]
    if isinstance(m.get("fsc"), dict) and "fsc_mean" in m["fsc"]:
        row["fsc_mean"] = m["fsc"]["fsc_mean"]          # the mean FSC to the truth, up to Nyquist
    row["curve"] = [{"fit_seconds": round(r["fit_seconds"], 4), "pearson": r.get("pearson_global")}
                    for r in m.get("curve", [])]
    if "pose_errors" in m:
        row["pose_errors"] = {k: v for k, v in m["pose_errors"].items() if k != "per_view"}
    return row


def add_eval(row: dict, m: dict) -> None:
    hs = m.get("half_sets") or {}
    for k in ("fsc05_A", "fsc0143_A"):
        if k in hs:
            row[f"halfset_{k}"] = hs[k]
    if isinstance(hs.get("fsc"), dict) and "fsc_mean" in hs["fsc"]:
        row["halfset_fsc_mean"] = hs["fsc"]["fsc_mean"]
    ho = m.get("holdout") or {}
    if "pearson_mean" in ho:
        row["holdout_pearson_mean"] = ho["pearson_mean"]
        row["holdout_pearson_min"] = ho["pearson_min"]


def time_to(curve: list[dict], level: float) -> float | None:
    for r in curve:
        if r.get("pearson") is not None and r["pearson"] >= level:
            return r["fit_seconds"]
    return None


def fmt(v, spec=".4f") -> str:
    return "-" if v is None else format(v, spec)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=[c for c in CASES if not CASES[c].get("dose")], choices=list(CASES),
                    help="cases to run (default: every case without a dose; name the specimen cases to run them)")
    ap.add_argument("--methods", nargs="*", default=["field-default", "field-best", "sirt"])
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=\"override override ...\": an extra field method (for recipe sweeps)")
    ap.add_argument("--eval", nargs="*", default=[], choices=list(CASES),
                    help="cases that also get the half-set FSC and held-out-view runs (field-default and sirt); "
                         "the specimen cases (with a dose) always do")
    ap.add_argument("--size", type=int, default=None,
                    help="rescale every case to SIZE x SIZE pixels and its thickness alike (the specimen cases their pixel "
                         "size too): a quick end-to-end check")
    ap.add_argument("--overrides", default="", help="\"override override ...\" added to every field run")
    ap.add_argument("--work", default=None, help="folder for case files and runs (default: a temp folder)")
    ap.add_argument("--out-dir", default=None, help="where the JSON record goes (default benchmarks/results)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip the short untimed run that fills the kernel compile cache before the first timed one")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run up to JOBS cases at once, each in its own bench_quality process on the same device (a "
                         "quality sweep in a fraction of the time; the record says so, as its fit times are contended)")
    return ap.parse_args()


def run_cases_in_parallel(args: argparse.Namespace, work: Path) -> tuple[list[dict], list[str]]:
    """One bench_quality process per case, at most ``args.jobs`` at a time, each with the same
    methods, variants and options; returns their rows (in case order) and the failed cases."""
    import tempfile

    forward = ["--methods", *args.methods, *[x for v in args.variant for x in ("--variant", v)],
               "--overrides", args.overrides, "--python", args.python]
    forward += ["--eval", *args.eval] if args.eval else []
    forward += ["--size", str(args.size)] if args.size else []
    forward += ["--no-warmup"] if args.no_warmup else []
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(tempfile.mkdtemp(prefix="jobs_", dir=work))
    pending, running, failed = list(args.cases), [], []
    while pending or running:
        while pending and len(running) < args.jobs:
            case = pending.pop(0)
            log = open(work / f"{case}.log", "w")
            cmd = [sys.executable, __file__, "--cases", case, *forward, "--work", str(work / case),
                   "--out-dir", str(out_dir / case)]
            running.append((case, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
            print(f"{case}: started (log {work / f'{case}.log'})", flush=True)
        time.sleep(0.5)
        for item in [r for r in running if r[1].poll() is not None]:
            case, proc, log = item
            running.remove(item)
            log.close()
            if proc.returncode != 0:
                failed.append(case)
                print(f"{case}: FAILED (exit {proc.returncode}); the end of its log:\n"
                      + (work / f"{case}.log").read_text()[-2000:], flush=True)
            else:
                print(f"{case}: done", flush=True)
    rows = []
    for case in args.cases:
        for path in sorted((out_dir / case).glob("bench_quality-*.json")):
            rows += json.loads(path.read_text())["results"]
    return rows, failed


def print_row(case: str, row: dict) -> None:
    print(f"{case:16s} {row['method']:16s} fit {row['fit_seconds']:7.2f} s  pearson {fmt(row['pearson'])}"
          f"  fg {fmt(row.get('pearson_fg'))}  fsc0.143 {fmt(row.get('fsc0143_A'), '.1f')} A"
          f"  fsc mean {fmt(row.get('fsc_mean'), '.3f')}"
          + ("" if "pose_errors" not in row else
             f"  rotations {row['pose_errors']['rotation_rms_deg']:.3f} deg RMS, shifts "
             f"{row['pose_errors']['shift_rms_px_gauge_free']:.3f} px gauge-free"), flush=True)


def print_table(rows: list[dict]) -> None:
    print("\n| case | method | fit s | Pearson | Pearson fg | FSC 0.5 (A) | FSC 0.143 (A) | FSC mean | half-set FSC 0.143 (A) "
          "| half-set FSC mean | held-out r | t(0.95) s | t(0.98) s | t(0.99) s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        c = r["curve"]
        print(f"| {r['case']} | {r['method']} | {r['fit_seconds']:.2f} | {fmt(r['pearson'])} | {fmt(r.get('pearson_fg'))} | "
              f"{fmt(r.get('fsc05_A'), '.1f')} | {fmt(r.get('fsc0143_A'), '.1f')} | {fmt(r.get('fsc_mean'), '.3f')} | "
              f"{fmt(r.get('halfset_fsc0143_A'), '.1f')} | {fmt(r.get('halfset_fsc_mean'), '.3f')} | "
              f"{fmt(r.get('holdout_pearson_mean'))} | {fmt(time_to(c, 0.95), '.2f')} | {fmt(time_to(c, 0.98), '.2f')} | "
              f"{fmt(time_to(c, 0.99), '.2f')} |")
        if "pose_errors" in r:
            print(f"|   poses | {json.dumps(r['pose_errors'])} |")


def main() -> None:
    args = parse_args()
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_quality_")).resolve()
    recipes = dict(RECIPES)
    for v in args.variant:
        name, _, ov = v.partition("=")
        recipes[name] = shlex.split(ov)
        if name not in args.methods:
            args.methods.append(name)
    extra = shlex.split(args.overrides)
    evals = set(args.eval) | {c for c in args.cases if CASES[c].get("dose")}
    specs = {c: case_spec(c, args.size) for c in args.cases}
    rows = []
    warm = args.no_warmup
    parallel = args.jobs > 1 and len(args.cases) > 1
    failed: list[str] = []
    if parallel:
        rows, failed = run_cases_in_parallel(args, work)
    for case in ([] if parallel else args.cases):
        files = make_case(case, work, specs[case])
        if not warm:
            # A fresh machine compiles the fused kernels in the first process (seconds, inside its
            # fit time); later processes load them from Triton's on-disk cache, as a user's second
            # run does. One short untimed run first, so every row is timed with a warm cache.
            run_method(case, files, "warmup", ["optim.steps=30", "evaluation.curve_every=0"], work, False, args.python)
            warm = True
        for method in args.methods:
            ov = [] if method.startswith("sirt") else list(recipes[method]) + extra
            if CASES[case].get("shift") and not method.startswith("sirt") and method != "field-default":
                ov += POSE_OVERRIDES
            m = run_method(case, files, method, ov, work, False, args.python)
            row = row_of(case, method, m, files)
            if case in evals and method in ("field-default", "sirt"):
                # SIRT at its best iteration count (the main run's), as a microscopist would stop it
                add_eval(row, run_method(case, files, method, ov, work, True, args.python,
                                         sirt_iterations=row.get("iterations", SIRT_ITERATIONS)))
            rows.append(row)
            print_row(case, row)
    print_table(rows)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    case = "-".join(args.cases) + (f"-size{args.size}" if args.size else "")  # one record per set of cases
    more = {"parallel_jobs": args.jobs, "note": f"up to {args.jobs} cases at once on the one device, each in its own "
            "process: fit_seconds and process_seconds are contended; the quality columns are not"} if parallel else {}
    path = write_result("bench_quality", case, device, rows, out_dir=Path(args.out_dir) if args.out_dir else None,
                        cases=specs, n_tilts=N_TILTS, recipes=recipes, overrides=extra,
                        sirt_iterations=SIRT_ITERATIONS, work=str(work), **more)
    print(f"\nwrote {path}")
    if failed:
        raise SystemExit(f"cases that failed (their rows are missing): {' '.join(failed)}")


if __name__ == "__main__":
    main()
