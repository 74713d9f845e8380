"""count_locality: how many plane-gradient flushes a step's interpolation backward needs, by batch
layout and by how a kernel would merge them (the counting step of the performance
discipline in CONTRIBUTING.md, before a tiled backward is built).

The backward scatters, for every sample point, frame t, scale and plane kind, the output gradient
into the 4 corner texels of the point's cell. What one "flush" (one global atomic per channel
chunk) covers depends on the kernel:

    taps        one atomic per point and corner (no merging)
    runs        the shipped texel-run backward (kplanes_bwd_runs_kernel): rows of RUN consecutive
                points; when a point leaves its cell, the corners the new cell shares are carried
                and only the others are flushed (a move of one cell flushes 2, a diagonal 3, a jump 4)
    interleaved the same texel-run backward with each program's rays stored depth-major (sample s
                of every ray of the group, then s + 1: neighbouring rays at one depth in a row)
    sorted      the same texel-run backward walking the points in the order of a sort by cell
                (--sorted): by each frame's 3-D cell (one walk for the three planes), or by each
                frame's and plane kind's 2-D cell (a walk per plane kind); the sort's own cost and
                the extra gathers of a walk per plane kind are not counted
    tile        a kernel that accumulates one program's whole share in shared memory and flushes
                each distinct texel it touched once: the program owns GROUP rays (P x P patches of
                one view with sampler.patch_size=P, or GROUP consecutive rays of a pixel batch)

and the footprint column is what such a program must stage: the bounding box of the texels its
rays touch in one plane (median and 95th percentile, in texels and in KiB per 16-channel fp32
chunk; an H200 SM has 228 KiB of shared memory).

Counted on a real batch of the configured run (its sampler, poses, box and sample count) with the
field's T frames at initialization. Prints a table and writes one JSON record to
benchmarks/results/.

    python scripts/count_locality.py                                   # flagship shape
    python scripts/count_locality.py --case small128 --patches 1 4 8 16
    python scripts/count_locality.py --sorted --rays 8192 --run-lens 16 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

CASES = {
    "flagship": ["experiment=flagship"],
    "small128": ["data.width=128", "data.height=128", "model.n_rotations=4", "model.channels=16",
                 "model.resolutions=[128]", "sampler.batch_size=4096", "projector.samples_per_ray=128"],
    "default": [],
}
RUN = 16  # points per row of the texel-run backward (KPlanesTuning's default RUN)


def cells(q: np.ndarray, a: int, b: int, ra: int, rb: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer cell (i along axis a, j along axis b) of bilinear sampling with align_corners and
    border clamping: texel coordinate x = (q + 1) / 2 (r - 1), cell floor(x) in [0, r - 2]."""
    x = np.clip((q[..., a] + 1.0) * 0.5 * (ra - 1), 0, ra - 1)
    y = np.clip((q[..., b] + 1.0) * 0.5 * (rb - 1), 0, rb - 1)
    return np.minimum(np.floor(x), ra - 2).astype(np.int64), np.minimum(np.floor(y), rb - 2).astype(np.int64)


def run_flushes(ci: np.ndarray, cj: np.ndarray, run: int = RUN) -> int:
    """Flushes of the texel-run backward for points (rays, samples) in memory order, rows of ``run``."""
    ci, cj = ci.reshape(-1), cj.reshape(-1)
    n = ci.size
    start = (np.arange(n) % run) == 0
    di = np.abs(np.diff(ci, prepend=ci[0]))
    dj = np.abs(np.diff(cj, prepend=cj[0]))
    same = (di == 0) & (dj == 0)
    new = np.where(start, 4, np.where(same, 0, np.where((di <= 1) & (dj <= 1), np.where((di + dj) == 1, 2, 3), 4)))
    return int(new.sum())


def interleave(c: np.ndarray, group_rays: int) -> np.ndarray:
    """Points (rays, samples) reordered so that each group of ``group_rays`` consecutive rays (one
    patch) is stored depth-major: sample s of every ray of the group, then sample s + 1, ..."""
    b, s = c.shape
    g = b // group_rays
    return c[:g * group_rays].reshape(g, group_rays, s).transpose(0, 2, 1).reshape(-1, s)


def spread_bits(v: np.ndarray, dims: int) -> np.ndarray:
    """The bits of ``v`` (< 2^10) spaced ``dims`` apart, for a Morton key of ``dims`` axes."""
    v = v.astype(np.int64)
    out = np.zeros_like(v)
    for bit in range(10):
        out |= ((v >> bit) & 1) << (dims * bit)
    return out


def sorted_rows(q: np.ndarray, resolutions: list, plane_axes, runs: list[int]) -> list[dict]:
    """Texel-run flushes per tap for rows of each length in ``runs`` when the points are walked in
    sorted order, two ways, each scale (one launch each) with its own sort, in Morton order of
    the cell at that scale: "3d", each frame's points by their 3-D cell (one walk serves the three
    planes, as the shipped kernel's does); "2d", each frame and plane kind by the plane's 2-D cell
    (a walk per plane kind). q is (T, rays, S, 3)."""

    def morton(t: int, axes: tuple[int, ...], res) -> np.ndarray:
        key = np.zeros(q[t, ..., 0].size, dtype=np.int64)
        for k, a in enumerate(axes):
            key |= spread_bits(cells(q[t], a, a, res[a], res[a])[0].reshape(-1), len(axes)) << k
        return np.argsort(key, kind="stable")

    rows = []
    for res in resolutions:
        taps = 0
        lens = sorted(set(runs) | {RUN})  # memory order at the shipped row length gives runs_per_tap
        flushed = {(how, run): 0 for how in ("memory", "3d", "2d") for run in lens}
        for t in range(q.shape[0]):
            order3 = morton(t, (0, 1, 2), res)
            for a, b in plane_axes:
                ci, cj = cells(q[t], a, b, res[a], res[b])
                ci, cj = ci.reshape(-1), cj.reshape(-1)
                taps += 4 * ci.size
                for how, order in (("memory", slice(None)), ("3d", order3), ("2d", morton(t, (a, b), res))):
                    for run in (lens if how == "memory" else runs):
                        flushed[how, run] += run_flushes(ci[order], cj[order], run)
        memory = flushed["memory", RUN]
        row = {"variant": "sorted", "resolution_xyz": list(res), "points": int(q[0, ..., 0].size),
               "frames": int(q.shape[0]), "taps": taps, "runs_flushes": memory,
               "runs_per_tap": round(memory / taps, 4),
               "sort_keys_per_step_3d": int(q[..., 0].size) * len(resolutions),
               "sort_keys_per_step_2d": int(q[..., 0].size) * len(resolutions) * len(plane_axes)}
        for (how, run), f in flushed.items():
            if run in runs:
                row[f"{how}_run{run}_per_tap" if how == "memory" else f"sorted{how}_run{run}_per_tap"] = round(f / taps, 4)
        rows.append(row)
    return rows


def tile_stats(ci: np.ndarray, cj: np.ndarray, group_rays: int, ra: int, rb: int) -> tuple[int, np.ndarray]:
    """(distinct texels summed over the programs, bounding-box texel counts per program) for
    programs of ``group_rays`` consecutive rays; ci, cj are (rays, samples)."""
    g = ci.shape[0] // group_rays
    ci = ci[:g * group_rays].reshape(g, -1)
    cj = cj[:g * group_rays].reshape(g, -1)
    corners_i = np.concatenate([ci, ci + 1, ci, ci + 1], axis=1)
    corners_j = np.concatenate([cj, cj, cj + 1, cj + 1], axis=1)
    key = (np.arange(g)[:, None] * ra + corners_i) * rb + corners_j
    distinct = int(np.unique(key).size)
    box = (corners_i.max(1) - corners_i.min(1) + 1) * (corners_j.max(1) - corners_j.min(1) + 1)
    return distinct, box


def main(argv: list[str] | None = None) -> int:
    from benchlib import write_result
    from fasttomo.run.build import build
    from fasttomo.data.load import load_tiltseries
    from fasttomo.geometry.rays import ray_samples
    from fasttomo.kernels.layout import PLANE_AXES
    from fasttomo.cli.reconstruct import compose_config

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="flagship", choices=sorted(CASES))
    p.add_argument("--patches", type=int, nargs="+", default=[1, 4, 8, 16],
                   help="sampler.patch_size values (1: a pixel batch, programs of GROUP consecutive rays)")
    p.add_argument("--rays", type=int, default=2048, help="rays of the batch that are counted")
    p.add_argument("--sorted", action="store_true",
                   help="count only the texel runs over sorted points (a pixel batch; rows of each --run-lens)")
    p.add_argument("--run-lens", type=int, nargs="+", default=[16, 64], help="row lengths for --sorted")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    ts = None

    def batch_points(patch: int):
        """(the field's layout, sampling coordinates (T, rays, S, 3)) of a real batch."""
        nonlocal ts
        cfg = compose_config([*CASES[args.case], "logging=quiet", "output.dir=/tmp/count_locality",
                              "runtime=cpu", f"sampler.patch_size={patch}"])
        ts = ts if ts is not None else load_tiltseries(cfg.data)
        comps = build(cfg, ts)
        proj = comps.projector
        batch = comps.sampler.next_batch()
        n = min(args.rays, len(batch))
        with torch.no_grad():
            rot, shift = proj.poses(batch.tilt[:n], batch.row[:n])
            pts = ray_samples(batch.row[:n], batch.col[:n], rot, shift, proj.image_hw, proj.box,
                              proj.samples_per_ray).points  # (n, S, 3)
            m = proj.field.sampling_matrices().double()
            return proj.field.layout, torch.einsum("tij,bsj->tbsi", m, pts.double()).numpy()

    if args.sorted:
        layout, q = batch_points(1)
        rows = sorted_rows(q, layout.resolutions, PLANE_AXES, args.run_lens)
        print(f"count_locality case={args.case}: texel-run flushes per tap, rows of each length, points in "
              f"memory order or sorted (3d: each frame's, 2d: each frame's and plane kind's); {q.shape[1]} rays counted")
        cols = [(how, n) for how in ("memory", "3d", "2d") for n in args.run_lens]
        key = {c: (f"{c[0]}_run{c[1]}_per_tap" if c[0] == "memory" else f"sorted{c[0]}_run{c[1]}_per_tap") for c in cols}
        print(f"{'res':>5}" + "".join(f"{f'{how[:3]}/{n}':>9}" for how, n in cols))
        for r in rows:
            print(f"{max(r['resolution_xyz']):>5}" + "".join(f"{r[key[c]]:>9.3f}" for c in cols))
        print("sum  " + "".join(f"{sum(r[key[c]] for r in rows):>9.3f}" for c in cols))
        print(f"keys to sort a step: 3d {rows[0]['sort_keys_per_step_3d']}, 2d {rows[0]['sort_keys_per_step_2d']}")
        if not args.no_write:
            path = write_result("count_locality", f"{args.case}-sorted", "cpu", rows, run=RUN,
                                rays_counted=args.rays, note="counts, not timings: the device is where they were computed")
            print(f"wrote {path}")
        return 0

    rows = []
    for patch in args.patches:
        layout, q = batch_points(patch)
        # a patch batch: programs of one patch; a pixel batch: programs of as many consecutive rays
        groups = [patch * patch] if patch > 1 else sorted({x * x for x in args.patches if x > 1} or {64})
        mine = []
        for res in layout.resolutions:  # (rx, ry, rz) of each scale
            planes = [(cells(q[t], a, b, res[a], res[b]), res[a], res[b])
                      for t in range(q.shape[0]) for a, b in PLANE_AXES]
            taps = sum(4 * ci.size for (ci, _), _, _ in planes)
            runs = sum(run_flushes(ci, cj) for (ci, cj), _, _ in planes)
            for group in groups:
                inter = tiles = 0
                boxes = []
                for (ci, cj), ra, rb in planes:
                    inter += run_flushes(interleave(ci, group), interleave(cj, group))
                    d, box = tile_stats(ci, cj, group, ra, rb)
                    tiles += d
                    boxes.append(box)
                boxes = np.concatenate(boxes)
                mine.append({
                    "variant": f"patch{patch}" if patch > 1 else f"pixels-{group}",
                    "patch_size": patch, "group_rays": group, "resolution_xyz": list(res),
                    "points": int(n * q.shape[2]), "frames": int(q.shape[0]),
                    "taps": taps, "runs_flushes": runs, "interleaved_runs_flushes": inter, "tile_flushes": tiles,
                    "runs_per_tap": round(runs / taps, 4), "interleaved_runs_per_tap": round(inter / taps, 4),
                    "tile_per_tap": round(tiles / taps, 4),
                    "tile_per_runs": round(tiles / runs, 4),
                    "footprint_texels_median": int(np.median(boxes)),
                    "footprint_texels_p95": int(np.percentile(boxes, 95)),
                    "footprint_KiB_per_16ch_median": round(float(np.median(boxes)) * 64 / 1024, 1),
                    "footprint_KiB_per_16ch_p95": round(float(np.percentile(boxes, 95)) * 64 / 1024, 1),
                })
        rows += sorted(mine, key=lambda r: r["group_rays"])  # by group, each group's scales in order
    print(f"count_locality case={args.case}: flushes per tap (4 per point, frame and plane), {args.rays} rays counted")
    print(f"{'variant':<11}{'group':>6}{'res':>5}{'runs/tap':>10}{'inter/tap':>10}{'tile/tap':>10}{'tile/runs':>11}"
          f"{'box med':>9}{'box p95':>9}{'KiB p95':>9}")
    for r in rows:
        print(f"{r['variant']:<11}{r['group_rays']:>6}{max(r['resolution_xyz']):>5}{r['runs_per_tap']:>10.3f}"
              f"{r['interleaved_runs_per_tap']:>10.3f}{r['tile_per_tap']:>10.3f}"
              f"{r['tile_per_runs']:>11.3f}{r['footprint_texels_median']:>9}{r['footprint_texels_p95']:>9}"
              f"{r['footprint_KiB_per_16ch_p95']:>9.1f}")
    if not args.no_write:
        path = write_result("count_locality", args.case, "cpu", rows, run=RUN, rays_counted=args.rays,
                            note="counts, not timings: the device is where they were computed")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
