#!/usr/bin/env python
"""bench_plane_tv: the plane TV's fused kernels (forward: the value; backward: the gradient) at the
camera2k and flagship plane layouts, against the least bytes they must move (GPU).

The forward reads every plane element once; the backward reads it once and writes its gradient
once. ``--base-src DIR`` also times another tree's kernels (DIR/fasttomo/kernels/triton/tv.py, the
same launcher names) in the same process, interleaved, on the same data: an A/B of two commits on
one machine. Both are checked against the pure-torch twin. CUDA events, medians of ``--repeat``.
Prints a table and writes benchmarks/results/bench_plane_tv-<case>-<device>-<commit>.json.

    python scripts/bench_plane_tv.py [--cases camera2k flagship] [--repeat 50] [--base-src DIR]
        [--base-commit HASH] [--shapes ROWSxBW ...] [--out-dir DIR]
    TRITON_INTERPRET=1 python scripts/bench_plane_tv.py --device cpu --cases tiny --repeat 1   # no GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))

from fasttomo.kernels.layout import PlaneLayout  # noqa: E402

CASES = {  # (T, C, plane sides): the camera2k step's planes (66 M elements) and the flagship's (121 M)
    "camera2k": (2, 8, (256, 512, 1024)),
    "flagship": (8, 48, (50, 100, 200)),
    "tiny": (2, 8, (40, 70)),  # several strips a plane: for a run through Triton's interpreter on the CPU
}


def load_tv(src: Path):
    """Another tree's plane-TV module, imported under its own name."""
    spec = importlib.util.spec_from_file_location("tv_base", src / "fasttomo" / "kernels" / "triton" / "tv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Strips:
    """This tree's kernels launched with another strip (ROWS x BW)."""

    def __init__(self, mod, rows: int, bw: int):
        self.mod, self.strip = mod, (rows, bw)

    def plane_tv_forward(self, plane_data, layout):
        return self.mod.plane_tv_forward(plane_data, layout, self.strip)

    def plane_tv_backward(self, grad, plane_data, layout):
        return self.mod.plane_tv_backward(grad, plane_data, layout, self.strip)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["camera2k", "flagship"], choices=list(CASES))
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--base-src", type=Path, default=None, help="another tree's src/ to time beside this one")
    ap.add_argument("--base-commit", default="base", help="the name of --base-src's kernels in the table")
    ap.add_argument("--shapes", nargs="*", default=[],
                    help="also this tree's kernels with other strips, ROWSxBW each (e.g. 8x512 16x1024)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (the tiny case)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_plane_tv: needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from benchlib import cuda_times_ms, device_name, write_result
    from fasttomo.kernels import reference
    from fasttomo.kernels.triton import tv

    dev = torch.device(args.device)
    kernels = {"this tree": tv}
    if args.base_src is not None:
        kernels[args.base_commit] = load_tv(args.base_src)
    for shape in args.shapes:
        kernels[f"strips {shape}"] = Strips(tv, *map(int, shape.split("x")))
    for case in args.cases:
        T, C, sides = CASES[case]
        lay = PlaneLayout(T, C, tuple((s,) * 3 for s in sides))
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(lay.numel, device=dev, generator=gen)
        go = torch.tensor(1.7, device=dev)
        xr = x.clone().requires_grad_()
        ref = reference.plane_tv(xr, lay)
        (gref,) = torch.autograd.grad(ref, [xr], go)
        nbytes = lay.numel * 4
        rows = []
        times = {name: {"fwd": [], "bwd": []} for name in kernels}
        for _ in range(3):  # interleaved rounds: each tree's kernels in turn
            for name, mod in kernels.items():
                times[name]["fwd"] += cuda_times_ms(lambda mod=mod: mod.plane_tv_forward(x, lay), args.repeat, 3, dev)
                times[name]["bwd"] += cuda_times_ms(lambda mod=mod: mod.plane_tv_backward(go, x, lay), args.repeat, 3, dev)
        print(f"{case}: {lay.numel / 1e6:.1f} M elements ({nbytes / 1e6:.0f} MB)")
        print(f"  {'kernels':<16} {'fwd ms':>8} {'GB/s':>6} {'bwd ms':>8} {'GB/s':>6}  value err  grad err")
        for name, mod in kernels.items():
            fwd, bwd = statistics.median(times[name]["fwd"]), statistics.median(times[name]["bwd"])
            v, g = mod.plane_tv_forward(x, lay), mod.plane_tv_backward(go, x, lay)
            row = {"variant": name, "fwd_ms": fwd, "bwd_ms": bwd, "fwd_GBps": nbytes / fwd / 1e6,
                   "bwd_GBps": 2 * nbytes / bwd / 1e6,
                   "value_rel_err": float((v.double() - ref.detach().double()).abs() / ref.detach().double().abs()),
                   "grad_rel_err": float((g.double() - gref.double()).norm() / gref.double().norm())}
            rows.append(row)
            print(f"  {name:<16} {fwd:8.3f} {row['fwd_GBps']:6.0f} {bwd:8.3f} {row['bwd_GBps']:6.0f}"
                  f"  {row['value_rel_err']:.1e}  {row['grad_rel_err']:.1e}", flush=True)
        path = write_result("bench_plane_tv", case, device_name(dev), rows,
                            out_dir=Path(args.out_dir) if args.out_dir else None,
                            layout={"T": T, "C": C, "sides": list(sides), "elements": lay.numel},
                            note="GB/s: the least bytes moved (forward: the planes read once; backward: read "
                                 "once and the gradient written once) over the median time")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
