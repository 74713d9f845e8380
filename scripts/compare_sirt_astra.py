"""fasttomo's SIRT against ASTRA Toolbox's CPU 2-D SIRT on the same parallel-beam slice problem.

    python scripts/compare_sirt_astra.py                                   # astra importable here
    python scripts/compare_sirt_astra.py --astra-python /tmp/av/bin/python # astra in another venv

The problem: the y = 0 slice of the built-in phantom (default_phantom(64, 65, 32): a 32 x 64 x-z
slice; H = 65 so detector row 32 is v = 0), exact line integrals at 61 tilts over +-60 degrees.
fasttomo reconstructs it as a (32, 1, 64) volume; ASTRA as a 32 x 64 image with its 'linear'
(Joseph) and 'strip' (area) projectors, 'SIRT' algorithm, MinConstraint 0 (fasttomo's positivity).

Geometry mapping (verified at run time with an off-centre point, and the run stops if it fails):
ASTRA's 2-D parallel geometry projects the pixel at (row r, column c) of an (R, C) image to
u = x cos(theta) + y sin(theta), with x = c - (C-1)/2 and y = (R-1)/2 - r (row 0 at the top, y
up). fasttomo projects (x, z) to u = x cos(theta) + z sin(theta) with z = k - (Z-1)/2. So ASTRA's
image is fasttomo's (Z, X) slice with the z axis reversed (r = Z-1-k); the angles (radians) and
the detector (spacing 1, centred, index increasing with u) are the same.

Prints a table and writes one JSON record (benchmark "compare_sirt_astra", device "cpu").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ASTRA_CHILD = r'''
import json, sys, time
import numpy as np
import astra
d = np.load(sys.argv[1])
stack, angles = d["sino"], d["angles_rad"]
nz, nx, iters = int(d["nz"]), int(d["nx"]), int(d["iters"])
vg = astra.create_vol_geom(nz, nx)
pg = astra.create_proj_geom("parallel", 1.0, stack.shape[1], angles)
out = {}
# handedness check: fasttomo's (x, z) = (0, +10) is ASTRA row (nz-1)/2 - 10; at +30 deg u = +5
n = 31
pid = astra.create_projector("linear", astra.create_proj_geom("parallel", 1.0, n, np.deg2rad([30.0])),
                             astra.create_vol_geom(n, n))
img = np.zeros((n, n), np.float32); img[15 - 10, 15] = 1.0
sid, sino = astra.create_sino(img, pid)
u = np.arange(n) - 15
out["check_u_at_30deg"] = float((sino[0] * u).sum() / sino[0].sum())
astra.data2d.delete(sid); astra.projector.delete(pid)
for kind in ("linear", "strip"):
    pid = astra.create_projector(kind, pg, vg)
    truth = d["truth_astra"].astype(np.float32)
    sid, fp = astra.create_sino(truth, pid)
    astra.data2d.delete(sid)
    sino_id = astra.data2d.create("-sino", pg, stack.astype(np.float32))
    rec_id = astra.data2d.create("-vol", vg, 0.0)
    cfg = astra.astra_dict("SIRT")
    cfg["ProjectorId"], cfg["ProjectionDataId"], cfg["ReconstructionDataId"] = pid, sino_id, rec_id
    cfg["option"] = {"MinConstraint": 0.0}
    alg = astra.algorithm.create(cfg)
    t0 = time.perf_counter(); astra.algorithm.run(alg, iters); t1 = time.perf_counter()
    rec = astra.data2d.get(rec_id)
    out[kind] = {"seconds": t1 - t0, "fp_truth": fp.tolist(), "rec": rec.tolist()}
    astra.algorithm.delete(alg); astra.data2d.delete([sino_id, rec_id]); astra.projector.delete(pid)
print("ASTRA " + json.dumps(out))
'''


def _pearson(a, b) -> float:
    return float(np.corrcoef(np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64))[0, 1])


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchlib import write_result
    from fasttomo.methods.sirt import forward_project, sirt
    from fasttomo.data import phantom as P
    from fasttomo.geometry.poses import Poses
    from fasttomo.geometry.rays import Box

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--tilts", type=int, default=61)
    p.add_argument("--astra-python", default=None,
                   help="a python that imports astra (default: this one)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    nx, ny, nz = 64, 65, 32
    ph = P.default_phantom(nx, ny, nz)
    angles = np.linspace(-60, 60, args.tilts)
    stack = P.project(ph, angles)[:, (ny - 1) // 2: (ny - 1) // 2 + 1, :]  # the v = 0 row, (N, 1, X)
    truth = P.voxelize(ph)[:, (ny - 1) // 2, :]  # (Z, X) at y = 0

    box = Box((nz, 1, nx))
    poses = Poses(angles, int(np.argmin(np.abs(angles))))
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    x_ft = sirt(torch.from_numpy(stack), poses, box, args.iterations)[:, 0].numpy()
    t_ft = time.perf_counter() - t0
    fp_ft = forward_project(torch.from_numpy(truth[:, None, :]), poses, box, (1, nx))[:, 0].numpy()

    with tempfile.TemporaryDirectory() as tmp:
        npz = Path(tmp) / "problem.npz"
        np.savez(npz, sino=stack[:, 0], angles_rad=np.deg2rad(angles), nz=nz, nx=nx, iters=args.iterations,
                 truth_astra=truth[::-1])
        child = Path(tmp) / "astra_child.py"
        child.write_text(ASTRA_CHILD)
        py = args.astra_python or sys.executable
        proc = subprocess.run([py, str(child), str(npz)], capture_output=True, text=True, timeout=1800,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit("the ASTRA part failed (is astra importable by --astra-python?)")
        res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("ASTRA ")][-1][6:])

    check = res["check_u_at_30deg"]
    print(f"geometry check: fasttomo (x, z) = (0, +10) mapped into ASTRA lands at u = {check:+.3f} at +30 deg "
          f"(expected +5)")
    if abs(check - 5.0) > 0.05:
        raise SystemExit("geometry mapping check failed: the comparison would be mirrored")

    rows = [{"variant": "fasttomo-sirt", "seconds": round(t_ft, 3), "pearson_truth": round(_pearson(x_ft, truth), 5),
             "pearson_vs_astra_linear": None, "fp_truth_rel_to_exact": None}]
    exact = stack[:, 0]
    rows[0]["fp_truth_rel_to_exact"] = round(float(np.linalg.norm(fp_ft - exact) / np.linalg.norm(exact)), 5)
    recs = {}
    for kind in ("linear", "strip"):
        rec = np.asarray(res[kind]["rec"], dtype=np.float64)[::-1]  # back to fasttomo's z order
        recs[kind] = rec
        fp = np.asarray(res[kind]["fp_truth"])
        rows.append({
            "variant": f"astra-cpu-sirt-{kind}",
            "seconds": round(res[kind]["seconds"], 3),
            "pearson_truth": round(_pearson(rec, truth), 5),
            "pearson_vs_fasttomo": round(_pearson(rec, x_ft), 5),
            "rel_diff_vs_fasttomo": round(float(np.linalg.norm(rec - x_ft) / np.linalg.norm(rec)), 5),
            "fp_truth_rel_to_exact": round(float(np.linalg.norm(fp - exact) / np.linalg.norm(exact)), 5),
            "fp_truth_rel_to_fasttomo_fp": round(float(np.linalg.norm(fp - fp_ft) / np.linalg.norm(fp_ft)), 5),
        })
    rows[0]["pearson_vs_astra_linear"] = round(_pearson(x_ft, recs["linear"]), 5)
    rows[0]["pearson_mirrored_vs_astra_linear"] = round(_pearson(x_ft[::-1], recs["linear"]), 5)

    print(f"slice {nz} x {nx}, {args.tilts} tilts +-60 deg, {args.iterations} SIRT iterations, exact data")
    print(f"{'variant':<24}{'s':>8}{'r(truth)':>10}{'r(ft)':>8}{'fp err':>8}")
    for r in rows:
        r_ft = r.get("pearson_vs_fasttomo")
        print(f"{r['variant']:<24}{r['seconds']:>8.2f}{r['pearson_truth']:>10.4f}"
              f"{(f'{r_ft:.4f}' if r_ft is not None else '-'):>8}{r['fp_truth_rel_to_exact']:>8.4f}")
    print(f"fasttomo mirrored in z vs ASTRA linear: r = {rows[0]['pearson_mirrored_vs_astra_linear']:.4f} "
          "(what a handedness error would look like)")
    if not args.no_write:
        path = write_result("compare_sirt_astra", f"slice{nz}x{nx}-{args.tilts}tilts", "cpu", rows,
                            argv=sys.argv[1:] if argv is None else argv, iterations=args.iterations,
                            geometry_check_u_at_30deg=check,
                            astra_mapping="ASTRA image = fasttomo (Z, X) slice with z reversed; same angles, detector")
        print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
