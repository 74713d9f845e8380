#!/usr/bin/env python
"""probe_bwd_knockout: what bounds the texel-run backward, by knocking out one part at a time.

The shipped interpolation backward (``kplanes_bwd_runs_kernel``, texel runs) was designed as if
its global atomics bound it (docs/kernels.md). Two measurements disagree: rows of 64 points, which
the counts give 1.26x fewer flushes, were no faster than rows of 16, and one scale of 50 took as
long as one of 100 (6.13 / 6.22 ms, ``probe_smem_backward``) although scale 100 flushes 1.45x more
per tap. This probe times variants of the same kernel, each a copy of ``kernels/triton/kplanes.py``
with one textual change: knockouts (their results are wrong on purpose; only the times are kept)

    shipped          the source as is (through the same copy, so that only the change differs)
    stores           every texel-run atomic add a plain store (same addresses and masks)
    no_run_flushes   no flushes inside a row's walk (the row's last cell is still flushed)
    no_pick          the carried corner sums not picked (each step starts its 4 sums afresh)
    one_tap          each cell's 4 corner loads read one address (3 of 4 gathers hit the first)
    no_gathers       the corner values made from their offsets, no plane loads at all

and candidates, which compute the same result another way (checked against the shipped kernel):

    sep_pick         the carried sums shifted along u, then v (16 selects a plane, not 24)
    unroll2_nocap    the walk unrolled by 2, no register cap (208 registers, no spills)
    stages2_nocap    the walk software-pipelined in 2 stages, no register cap (203 registers;
                     both counts from a Triton 3.9 compile for sm_90a on the CPU)
    rows4            4 rows a program instead of 8
    rows8, rows16, rows32, rows32_w2, rows16_len32, len32, rows16_nocap
                     launch settings for planes of few channels (rows a program, points a row,
                     warps, register cap), each for every scale (the shipped tuning takes 16 rows
                     for scales of C <= 16 and planes up to 512 a side: KPlanesTuning)

at the flagship's points (8192 rays x 200 samples, T = 8, C = 48) on the flagship layout
(scales 50 / 100 / 200) and on each scale alone, with the gradients a training step asks for
(planes and frames: need_gm, no dL/dq). ``--case camera2k`` takes the camera2k step's shape
instead (8192 rays x 768 samples through a slab a quarter as thick as wide, T = 2, C = 8, scales
256 / 512 / 1024). CUDA events, medians of ``--repeat``. Prints a table and writes
benchmarks/results/probe_bwd_knockout-<case>-<device>-<commit>.json.

``--fwd-maxnreg R ...`` also times the forward (fp32 and bf16 features) under register caps,
interleaved with the shipped launch, and checks that each gives its bits.

``--floor`` times what a step's interpolation must at least pay in this design: the forward with
its feature store knocked out (stored only where a feature is NaN, so every gather and product is
still computed: the gathers' own time, which the backward repeats), beside the shipped forward
(fp32 and bf16 features) and backward, each with fp32 planes and with a bf16 copy of them.

    python scripts/probe_bwd_knockout.py [--case flagship|camera2k] [--repeat 20] [--out-dir DIR]
    python scripts/probe_bwd_knockout.py --cpu-check     # no GPU: every variant through Triton's
                                                         # interpreter on a tiny case
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))

from fasttomo.kernels.layout import PlaneLayout  # noqa: E402

ATOMIC_PO = re.compile(r"tl\.atomic_add\(po(.*), sem=\"relaxed\"\)")


def _stores(text: str) -> str:
    return ATOMIC_PO.sub(r"tl.store(po\1)", text)


def _no_run_flushes(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not ("tl.atomic_add(po" in line and "mask=(~(" in line))


def _no_pick(text: str) -> str:
    return re.sub(r"_pick\(acc00, acc01, acc10, acc11, [^)]*\)", "0.0", text.replace("def _pick(", "def _pick_unused("))


def _one_tap(text: str) -> str:
    for old in ("tl.load(p + C, mask", "tl.load(p + row_stride, mask", "tl.load(p + row_stride + C, mask"):
        text = text.replace(old, "tl.load(p, mask")
    return text


def _no_gathers(text: str) -> str:
    for i, name in enumerate(("v00", "v01", "v10", "v11")):
        text = re.sub(rf"{name} = tl\.load\([^\n]*\)\.to\(tl\.float32\)",
                      f"{name} = (p00[:, None] + c[None, :] + {i}).to(tl.float32) * 1e-6", text)
    return text


def _sep_pick(text: str) -> str:
    """The carried sums shifted along u, then along v: 16 selects a plane instead of 24 (the same
    values reach each corner, so the sums are the same bits)."""
    old = ("    n00 = _pick(acc00, acc01, acc10, acc11, du, dv) + g * (gu * gv)[:, None]\n"
           "    n01 = _pick(acc00, acc01, acc10, acc11, du + 1, dv) + g * (fu * gv)[:, None]\n"
           "    n10 = _pick(acc00, acc01, acc10, acc11, du, dv + 1) + g * (gu * fv)[:, None]\n"
           "    n11 = _pick(acc00, acc01, acc10, acc11, du + 1, dv + 1) + g * (fu * fv)[:, None]\n")
    new = ("    u0 = (du == 0)[:, None]\n"
           "    u1 = (du == 1)[:, None]\n"
           "    um = (du == -1)[:, None]\n"
           "    s00 = tl.where(u0, acc00, tl.where(u1, acc01, 0.0))\n"
           "    s01 = tl.where(u0, acc01, tl.where(um, acc00, 0.0))\n"
           "    s10 = tl.where(u0, acc10, tl.where(u1, acc11, 0.0))\n"
           "    s11 = tl.where(u0, acc11, tl.where(um, acc10, 0.0))\n"
           "    v0 = (dv == 0)[:, None]\n"
           "    v1 = (dv == 1)[:, None]\n"
           "    vm = (dv == -1)[:, None]\n"
           "    n00 = tl.where(v0, s00, tl.where(v1, s10, 0.0)) + g * (gu * gv)[:, None]\n"
           "    n01 = tl.where(v0, s01, tl.where(v1, s11, 0.0)) + g * (fu * gv)[:, None]\n"
           "    n10 = tl.where(v0, s10, tl.where(vm, s00, 0.0)) + g * (gu * fv)[:, None]\n"
           "    n11 = tl.where(v0, s11, tl.where(vm, s01, 0.0)) + g * (fu * fv)[:, None]\n")
    return text.replace(old, new)


def _loop(option: str):
    return lambda text: text.replace("for k in range(RUN):", f"for k in tl.range(RUN, {option}):")


# name: (change, lines of kplanes.py it changes or removes, KPlanesTuning fields, same result as shipped)
VARIANTS = {
    "shipped": (lambda t: t, 0, {}, True),
    # knockouts: one part removed or cheapened, the result wrong on purpose
    "stores": (_stores, 8, {}, False),
    "no_run_flushes": (_no_run_flushes, 4, {}, False),
    "no_pick": (_no_pick, 5, {}, False),
    "one_tap": (_one_tap, 3, {}, False),
    "no_gathers": (_no_gathers, 4, {}, False),
    # candidates: the same result, another way
    "sep_pick": (_sep_pick, 4, {}, True),
    "unroll2_nocap": (_loop("loop_unroll_factor=2"), 1, {"run_maxnreg": None}, True),
    "stages2_nocap": (_loop("num_stages=2"), 1, {"run_maxnreg": None}, True),
    "rows4": (lambda t: t, 0, {"run_rows": 4, "few_channel_rows": 0}, True),
    # launch settings for few channels a plane (the camera step's C = 8: a chunk of 8 rows x 8
    # channels gives the one warp 2 elements a thread), each for every scale (few_channel_rows 0);
    # rows8 is the shipped tuning before few_channel_rows
    "rows8": (lambda t: t, 0, {"few_channel_rows": 0}, True),
    "rows16": (lambda t: t, 0, {"run_rows": 16, "few_channel_rows": 0}, True),
    "rows32": (lambda t: t, 0, {"run_rows": 32, "few_channel_rows": 0}, True),
    "rows32_w2": (lambda t: t, 0, {"run_rows": 32, "run_warps": 2, "few_channel_rows": 0}, True),
    "rows16_len32": (lambda t: t, 0, {"run_rows": 16, "run_len": 32, "few_channel_rows": 0}, True),
    "len32": (lambda t: t, 0, {"run_len": 32, "few_channel_rows": 0}, True),
    "rows16_nocap": (lambda t: t, 0, {"run_rows": 16, "run_maxnreg": None, "few_channel_rows": 0}, True),
    # more warps an SM (the walk is latency-bound at 3 a scheduler: docs/kernels.md, "Hardware
    # counters"): 8 rows under 128 registers (4 warps a scheduler), 4 rows under 96 (5)
    "rows8_r128": (lambda t: t, 0, {"few_channel_rows": 0, "run_maxnreg": 128}, True),
    "rows4_r96": (lambda t: t, 0, {"run_rows": 4, "few_channel_rows": 0, "run_maxnreg": 96}, True),
}
# a variant of launch settings takes run_maxnreg as it was measured with (rows8_r128 measured the
# small-tile cap that came after it); the knockouts keep the shipped settings
for _fields in (v[2] for v in VARIANTS.values() if v[2]):
    _fields.setdefault("small_tile_maxnreg", None)


def variant_module(name: str, source: str, folder: Path):
    """A copy of the kernel module with variant ``name``'s change, imported from ``folder``."""
    change, expected = VARIANTS[name][:2]
    text = change(source)
    changed = sum(1 for line in difflib.ndiff(source.splitlines(), text.splitlines()) if line.startswith("- "))
    if changed != expected:
        raise SystemExit(f"probe_bwd_knockout: variant {name} should change {expected} lines of kplanes.py and "
                         f"changed {changed}: the kernel changed; update the probe's substitutions")
    return import_copy(name, text, folder)


def import_copy(name: str, text: str, folder: Path):
    """``text`` (a changed copy of kplanes.py) written to ``folder`` and imported."""
    path = folder / f"kplanes_knockout_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"kplanes_knockout_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def slab_points(B: int, S: int, half_thickness: float, device, gen) -> torch.Tensor:
    """B rays of S samples each through the slab |z| <= half_thickness of the [-1, 1] box, tilts
    over +-60 degrees as ``bench_kernels.ray_points`` draws them, each ray's chord wholly inside
    the box (|u| <= (1 - t |tan th|) cos th), the samples evenly spaced in z with a jitter."""
    ang = torch.deg2rad(torch.linspace(-60, 60, 61, device=device))
    th = ang[torch.randint(0, 61, (B,), device=device, generator=gen)]
    umax = (1 - half_thickness * torch.tan(th).abs()) * torch.cos(th)
    u = (torch.rand(B, device=device, generator=gen) * 2 - 1) * umax
    v = torch.rand(B, device=device, generator=gen) * 2 - 1
    z = (torch.linspace(-1, 1, S, device=device)[None, :]
         + (torch.rand(B, 1, device=device, generator=gen) - 0.5) * (2 / S)).clamp(-1, 1) * half_thickness
    x = u[:, None] / torch.cos(th)[:, None] - z * torch.tan(th)[:, None]
    y = v[:, None].expand(B, S)
    return torch.stack((x, y, z), dim=-1).reshape(B * S, 3).contiguous()


def cpu_check(kp, mods: dict) -> int:
    """Each variant on 128 points along rays (one scale, T = 2) through the interpreter."""
    from bench_kernels import ray_points, rotations

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    lay = PlaneLayout(2, 16, ((9, 8, 7),))
    pts, mats = ray_points(4, 32, cpu, gen), rotations(2, cpu, gen)
    planes = torch.randn(lay.numel, generator=gen)
    grad = torch.randn(pts.shape[0], lay.n_features, generator=gen)

    def grads(mod, fields):
        gp, _, gm = mod.kplanes_backward(grad, pts, mats, planes, lay, need_dq=False, need_gm=True,
                                         tuning=mod.KPlanesTuning(min_programs_per_sm=0, **fields))
        return gp, gm

    ref = grads(kp, {})
    bad = []
    for name, mod in mods.items():
        gp, gm = grads(mod, VARIANTS[name][2])
        err = max(float((gp - ref[0]).norm() / ref[0].norm()), float((gm - ref[1]).norm() / ref[1].norm()))
        same = VARIANTS[name][3]
        print(f"  {name:<15} {'candidate' if same else 'knockout':<9} relative difference {err:.1e}")
        if (err > 1e-6) if same else (err < 1e-3):
            bad.append(name)
    print("cpu check: " + ("ok" if not bad else "FAILED: " + ", ".join(bad)))
    return 1 if bad else 0


def _fwd_nostore(text: str) -> str:
    old = "        tl.store(out_row[:, None] + c[None, :], s, mask=m2)\n"
    return text.replace(old, "        tl.store(out_row[:, None] + c[None, :], s, mask=m2 & (s != s))\n")


def floor_rows(kp, nostore, pts, mats, planes, grad, lay, repeat, dev) -> dict:
    """The gathers' floor: the shipped forward and backward against the forward without its
    feature store, with fp32 planes and a bf16 copy (made once, outside the timed calls),
    interleaved three times."""
    from benchlib import cuda_times_ms

    calls = {}
    for ptag, pd in (("fp32planes", planes), ("bf16planes", planes.to(torch.bfloat16))):
        for bf16 in (False, True):
            ftag = "bf16out" if bf16 else "fp32out"
            calls[f"forward_{ptag}_{ftag}"] = lambda pd=pd, bf16=bf16: kp.kplanes_forward(pts, mats, pd, lay, bf16)
            calls[f"gathers_{ptag}_{ftag}"] = lambda pd=pd, bf16=bf16: nostore.kplanes_forward(pts, mats, pd, lay, bf16)
        calls[f"backward_{ptag}"] = lambda pd=pd: kp.kplanes_backward(grad, pts, mats, pd, lay, need_dq=False,
                                                                      need_gm=True)
    times = {name: [] for name in calls}
    for _ in range(3):
        for name, fn in calls.items():
            times[name] += cuda_times_ms(fn, repeat, 3, dev)
    return {f"{name}_ms": statistics.median(v) for name, v in times.items()}


def forward_caps(kp, pts, mats, planes, lay, caps, repeat, dev) -> dict:
    """The forward's times (fp32 and bf16 features) under each register cap beside the shipped
    launch's, interleaved, and whether each cap gives the shipped features' bits."""
    from benchlib import cuda_times_ms

    out = {}
    for bf16 in (False, True):
        tag = "bf16" if bf16 else "fp32"
        tunings = {"shipped": kp.KPlanesTuning(), **{f"maxnreg{c}": kp.KPlanesTuning(fwd_maxnreg=c) for c in caps}}
        ref = kp.kplanes_forward(pts, mats, planes, lay, bf16)
        times = {name: [] for name in tunings}
        for _ in range(3):
            for name, tu in tunings.items():
                times[name] += cuda_times_ms(lambda tu=tu: kp.kplanes_forward(pts, mats, planes, lay, bf16, tu),
                                             repeat, 3, dev)
        for name, tu in tunings.items():
            out[f"forward_{tag}_{name}_ms"] = statistics.median(times[name])
            if name != "shipped":
                out[f"forward_{tag}_{name}_same_bits"] = bool(torch.equal(
                    kp.kplanes_forward(pts, mats, planes, lay, bf16, tu), ref))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("flagship", "camera2k"), default="flagship")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--check", action="store_true",
                    help="only build every variant's source and import it (no GPU needed)")
    ap.add_argument("--cpu-check", action="store_true",
                    help="run every variant on a tiny case through Triton's interpreter (no GPU): candidates "
                         "must give the shipped kernel's gradients, knockouts other ones")
    ap.add_argument("--fwd-block-n", type=int, nargs="*", default=[],
                    help="also time the forward at these points a program (the shipped: 32)")
    ap.add_argument("--fwd-maxnreg", type=int, nargs="*", default=[],
                    help="also time the forward (fp32 and bf16 features) under these register caps, each "
                         "checked to give the shipped forward's bits (the shipped: the compiler's choice)")
    ap.add_argument("--floor", action="store_true",
                    help="also time the forward without its feature store (the gathers' own time) beside the "
                         "shipped forward and backward, with fp32 and bf16 planes")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.cpu_check:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    from fasttomo.kernels.triton import kplanes as kp

    source = Path(kp.__file__).read_text()
    folder = Path(tempfile.mkdtemp(prefix="probe_bwd_knockout_"))
    mods = {name: variant_module(name, source, folder) for name in args.variants}
    nostore = None
    if args.floor:
        text = _fwd_nostore(source)
        if text == source:
            raise SystemExit("probe_bwd_knockout: --floor found no feature store to knock out in kplanes.py")
        nostore = import_copy("fwd_nostore", text, folder)
    if args.check:
        print(f"{len(mods)} variants built and imported from {folder}")
        return 0
    if args.cpu_check:
        return cpu_check(kp, mods)

    from bench_kernels import ray_points, rotations
    from benchlib import cuda_times_ms, device_name, write_result

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.case == "flagship":
        T, C, scales = 8, 48, (50, 100, 200)
        pts = ray_points(8192, 200, dev, gen)
    else:
        T, C, scales = 2, 8, (256, 512, 1024)
        pts = slab_points(8192, 768, 0.25, dev, gen)
    mats = rotations(T, dev, gen)
    layouts = {args.case: PlaneLayout(T, C, tuple((s,) * 3 for s in scales))}
    layouts.update({f"scale{s}": PlaneLayout(T, C, ((s,) * 3,)) for s in scales})
    rows = []
    for case, lay in layouts.items():
        planes = torch.randn(lay.numel, device=dev, generator=gen) * 0.5 + 1.0
        grad = torch.randn(pts.shape[0], lay.n_features, device=dev, generator=gen)
        fwd_ms = statistics.median(cuda_times_ms(lambda: kp.kplanes_forward(pts, mats, planes, lay, False),
                                                 args.repeat, 3, dev))
        row = {"variant": case, "forward_ms": fwd_ms}
        for bn in args.fwd_block_n:
            tu = kp.KPlanesTuning(fwd_block_n=bn)
            row[f"forward_bn{bn}_ms"] = statistics.median(cuda_times_ms(
                lambda tu=tu: kp.kplanes_forward(pts, mats, planes, lay, False, tu), args.repeat, 3, dev))
        if nostore is not None:
            row.update(floor_rows(kp, nostore, pts, mats, planes, grad, lay, args.repeat, dev))
            print(f"  {case}: " + "  ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items()
                                            if k.startswith(("forward_", "gathers_", "backward_")) and k != "forward_ms"),
                  flush=True)
        if args.fwd_maxnreg:
            row.update(forward_caps(kp, pts, mats, planes, lay, args.fwd_maxnreg, args.repeat, dev))
        ref = None
        for name, mod in mods.items():
            tuning = mod.KPlanesTuning(**VARIANTS[name][2])

            def call(mod=mod, tuning=tuning):
                return mod.kplanes_backward(grad, pts, mats, planes, lay, need_dq=False, need_gm=True, tuning=tuning)
            if VARIANTS[name][3]:  # a candidate: its plane and frame gradients against the shipped kernel's
                gp, _, gm = call()
                ref = ref or kp.kplanes_backward(grad, pts, mats, planes, lay, need_dq=False, need_gm=True)
                row[f"{name}_err_planes"] = float((gp - ref[0]).norm() / ref[0].norm())
                row[f"{name}_err_frames"] = float((gm - ref[2]).norm() / ref[2].norm())
            row[f"{name}_ms"] = statistics.median(cuda_times_ms(call, args.repeat, 3, dev))
        rows.append(row)
        print(f"{case:<10} fwd {fwd_ms:6.2f} | " + "  ".join(f"{n} {row[f'{n}_ms']:6.2f}" for n in mods), flush=True)
        if args.fwd_maxnreg:
            print("  forward " + "  ".join(f"{k[8:-3]} {v:.3f}" for k, v in row.items()
                                           if k.startswith("forward_") and k.endswith("_ms") and "bn" not in k
                                           and k != "forward_ms")
                  + "  same bits: " + str(all(v for k, v in row.items() if k.endswith("_same_bits"))), flush=True)
    path = write_result("probe_bwd_knockout", args.case, device_name(dev), rows,
                        out_dir=Path(args.out_dir) if args.out_dir else None,
                        note="backward ms with need_gm (planes and frames), need_dq off; knockouts' results are wrong "
                             "on purpose, candidates' (sep_pick, unroll2_nocap, stages2_nocap and the launch settings rows*, len32) are checked "
                             "against the shipped kernel (err_*)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
