#!/usr/bin/env python
"""bench_default_run: the README's main job (the embedded default reconstruction) timed as a user
meets it, whole processes from interpreter start to exit.

In the same job it times ``import torch`` alone in a fresh interpreter (the floor every run pays),
then runs ``python -m fasttomo.cli.reconstruct logging.progress=false hydra.run.dir=<tmp>``:

    on a GPU   once with an empty Triton cache (a fresh TRITON_CACHE_DIR: the kernels compile) and
               ``--repeat`` times with that cache warm (a user's second run)
    on a CPU   ``--repeat`` times (no kernels are compiled there)

Each row: ``cache`` ("empty", "warm" or "n/a"), ``process_wall_s``, ``torch_import_s`` (the
median of this job's imports), ``beyond_torch_import_s``, the run's training seconds, steps,
Pearson to the phantom and its timeline (metrics.json), and the process's peak resident memory.

    python scripts/bench_default_run.py                 # CPU: one run; GPU: empty + one warm
    python scripts/bench_default_run.py --repeat 3
    python scripts/bench_default_run.py --repeat 2 --profile   # and one more warm run under cProfile

``--bytecode cached`` gives every child process (the imports of torch and the runs alike) one
Python bytecode cache (PYTHONPYCACHEPREFIX in the job's folder), filled by one untimed run with
its own Triton cache first: what a pip-installed environment has, where the interpreter would
otherwise compile every imported module from source in each process (an image whose packages
carry no .pyc files and cannot take them). The default, ``as-is``, leaves the interpreter as it
is. The record says which, and what the interpreter does (``bytecode_state``).

``--profile`` adds a run under cProfile (every thread under Python 3.12, only the main thread
before; on a GPU with the cache warm) after the timed ones: the record's ``profile`` lists the
functions with the most cumulative and the most own time, and the pstats file is kept in
``--out-dir`` when one is given, to see where the seconds beyond ``import torch`` go on a machine
this one cannot reach.

Prints a table, writes benchmarks/results/default_run-phantom[-pyc]-<device>-<commit>.json (-pyc:
``--bytecode cached``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))

from benchlib import timed_process, write_result  # noqa: E402

COMMAND = [sys.executable, "-m", "fasttomo.cli.reconstruct", "logging.progress=false"]


def timed(cmd: list[str], env: dict, cwd: Path) -> tuple[float, int, str]:
    """(wall seconds, peak resident bytes, output) of one child process."""
    log = cwd / "child.log"
    wall, peak, code = timed_process(cmd, env, cwd, log)
    text = log.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    return wall, peak, text


BYTECODE_STATE = """import importlib.util, json, os, sys
import torch
pyc = importlib.util.cache_from_source(torch.__file__)
print(json.dumps({"dont_write_bytecode": sys.dont_write_bytecode, "pycache_prefix": sys.pycache_prefix,
                  "torch_init_pyc_exists": os.path.exists(pyc),
                  "torch_dir_writable": os.access(os.path.dirname(torch.__file__), os.W_OK)}))
"""


def bytecode_state(env: dict, cwd: Path) -> dict:
    """Whether this interpreter, in the children's environment, finds or writes bytecode for torch."""
    _, _, out = timed([sys.executable, "-c", BYTECODE_STATE], env, cwd)
    return json.loads(out.strip().splitlines()[-1])


def torch_import_seconds(env: dict, cwd: Path) -> float:
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    _, _, out = timed([sys.executable, "-c", code], env, cwd)
    return float(out.strip().splitlines()[-1])


PROFILED = """import cProfile, sys
sys.argv = ["fasttomo-reconstruct", *sys.argv[1:]]
from fasttomo.cli.reconstruct import main
prof = cProfile.Profile()
prof.enable()
try:
    main()
except SystemExit:
    pass
prof.disable()
prof.dump_stats(STATS)
"""


def profile_rows(stats_path: Path, top: int = 40) -> dict:
    """The ``top`` functions by cumulative and by own seconds of a pstats file, as
    [file:line(function), cumulative s, own s, calls] rows."""
    import pstats

    st = pstats.Stats(str(stats_path))
    rows = [(f"{Path(f).name}:{ln}({fn})", round(ct, 4), round(tt, 4), nc)
            for (f, ln, fn), (_, nc, tt, ct, _) in st.stats.items()]
    return {"total_s": round(st.total_tt, 3),
            "by_cumulative": sorted(rows, key=lambda r: -r[1])[:top],
            "by_own": sorted(rows, key=lambda r: -r[2])[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1, help="warm-cache runs on a GPU, runs on a CPU")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--profile", action="store_true", help="one more run under cProfile (not timed)")
    ap.add_argument("--bytecode", choices=["as-is", "cached"], default="as-is",
                    help="cached: one primed PYTHONPYCACHEPREFIX for every child (see above)")
    args = ap.parse_args()

    import torch

    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if gpu else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bench_default_run_"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    caches = (["empty"] + ["warm"] * args.repeat) if gpu else ["n/a"] * args.repeat
    if args.bytecode == "cached":
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        timed([*COMMAND, f"hydra.run.dir={work / 'prime'}"], {**env, "TRITON_CACHE_DIR": str(work / "prime-triton")},
              work)  # untimed: fills the bytecode cache only (its Triton cache is its own)
    state = bytecode_state(env, work)
    if gpu:
        env["TRITON_CACHE_DIR"] = str(work / "triton-cache")  # empty before the first run
    imports = [torch_import_seconds(env, work)]
    rows = []
    for i, cache in enumerate(caches):
        out = work / f"run{i}"
        wall, peak, _ = timed([*COMMAND, f"hydra.run.dir={out}"], env, work)
        imports.append(torch_import_seconds(env, work))
        m = json.loads((out / "metrics.json").read_text())
        rows.append({"variant": f"default-{cache}-cache" if gpu else "default", "cache": cache,
                     "bytecode": args.bytecode,
                     "process_wall_s": round(wall, 2), "train_seconds": m.get("train_seconds"),
                     "steps": m.get("steps"), "pearson": m.get("pearson_global"),
                     "peak_host_GB": round(((m.get("timeline") or {}).get("peak_host_bytes") or peak) / 1e9, 3),
                     "timeline": m.get("timeline")})  # the run's own peak (VmHWM): wait4's carries this script's over
    profile = None
    if args.profile:
        if args.out_dir:
            Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        folder = Path(args.out_dir) if args.out_dir else work
        pyc = "" if args.bytecode == "as-is" else "-pyc"
        stats = folder / f"default_run_profile{pyc}-{device.replace(' ', '-')}.pstats"
        out = work / "profiled"
        code = PROFILED.replace("STATS", repr(str(stats)))
        timed([sys.executable, "-c", code, *COMMAND[3:], f"hydra.run.dir={out}"], env, work)
        profile = {"cache": "warm" if gpu else "n/a", "pstats": stats.name, **profile_rows(stats)}
        m = json.loads((out / "metrics.json").read_text())
        profile["timeline"] = m.get("timeline")
    t_import = statistics.median(imports)
    for r in rows:
        r["torch_import_s"] = round(t_import, 2)
        r["beyond_torch_import_s"] = round(r["process_wall_s"] - t_import, 2)
    print(f"bytecode: {args.bytecode}; {state}")
    print(f"import torch alone: {', '.join(f'{t:.2f}' for t in imports)} s (median {t_import:.2f})")
    print(f"{'cache':6s} {'process s':>9s} {'beyond import':>13s} {'train s':>8s} {'steps':>6s} {'pearson':>8s} "
          f"{'host GB':>8s}")
    for r in rows:
        print(f"{r['cache']:6s} {r['process_wall_s']:9.2f} {r['beyond_torch_import_s']:13.2f} "
              f"{r['train_seconds'] or 0:8.2f} {r['steps'] or 0:6d} {r['pearson'] or 0:8.4f} {r['peak_host_GB']:8.3f}")
    case = "phantom" if args.bytecode == "as-is" else "phantom-pyc"
    path = write_result("default_run", case, device, rows, out_dir=Path(args.out_dir) if args.out_dir else None,
                        command=f"python scripts/bench_default_run.py {' '.join(sys.argv[1:])}".strip(),
                        torch_import_s_all=[round(t, 3) for t in imports],
                        bytecode=args.bytecode, bytecode_state=state,
                        **({"profile": profile} if profile else {}),
                        run_command=" ".join(["python -m fasttomo.cli.reconstruct", *COMMAND[3:],
                                              "hydra.run.dir=<tmp>"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
