#!/usr/bin/env python
"""probe_fused_mlp: the fused decoder's kernels (``kernels/triton/mlp.py``) against the twin, alone.

Linear(F, H)-ReLU-Linear(H, H)-ReLU-Linear(H, 1) on N points, as the camera2k step runs it (6.3 M
points, F = 48, H = 32: model.hidden; the flagship's F = 1152 is not for this design). Parity
against the twin under the same precision (forward output, dL/dx and every weight's gradient
through autograd; in bf16 the twin runs under autocast, ``reference.decoder_mlp``), then
CUDA-event medians of the fused pair against the twin's forward and forward + backward, in bf16
(the path the door takes) and fp32 (which the door leaves to cuBLAS). ``--sweep`` also times the
backward's launch settings (points a block, warps, programs an SM, and with ``--sweep-stages``
the software pipeline's stages). Prints a table, writes
benchmarks/results/probe_fused_mlp-<case>-<device>-<commit>.json.

    python scripts/probe_fused_mlp.py                       # camera2k: N = 8192 x 768, F = 48, H = 32
    python scripts/probe_fused_mlp.py --points 6291456 --hidden 64       # other widths (the door's limits)
    python scripts/probe_fused_mlp.py --cpu-check           # no GPU: Triton's interpreter, a tiny fp32 case
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "src"))

if "--cpu-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from fasttomo.kernels.triton import mlp  # noqa: E402  (imports triton)


def twin(x, params, bf16: bool, dout):
    """The decoder as a run computes it (``reference.decoder_mlp``, autocast in bf16), forward and
    backward through autograd: (out, dx, dW1, db1, dW2, db2, dW3, db3)."""
    from fasttomo.kernels import reference

    xs = x.detach().requires_grad_(True)
    ps = [p.detach().requires_grad_(True) for p in params]
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = reference.decoder_mlp(xs, *ps)
    out.float().backward(dout)
    return (out.detach().float(), xs.grad, *(p.grad for p in ps))


def make(N: int, F: int, H: int, device, bf16: bool, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.rand(N, F, device=device, generator=g) * 2.0
    if bf16:
        x = x.to(torch.bfloat16)  # the interpolation's bf16 features under autocast
    params = [torch.randn(H, F, device=device, generator=g) * (2.0 / F) ** 0.5,
              torch.randn(H, device=device, generator=g) * 0.1,
              torch.randn(H, H, device=device, generator=g) * (2.0 / H) ** 0.5,
              torch.randn(H, device=device, generator=g) * 0.1,
              torch.randn(1, H, device=device, generator=g) * (1.0 / H) ** 0.5,
              torch.randn(1, device=device, generator=g) * 0.1]
    dout = torch.randn(N, device=device, generator=g)
    return x, params, dout


def compare(x, params, dout, bf16: bool, programs: int | None = None) -> dict:
    ref = twin(x, params, bf16, dout)
    out = mlp.mlp_forward(x, *params, bf16)
    got = (out, *mlp.mlp_backward(x, dout, *params[:5], bf16, programs=programs))
    names = ("out", "dx", "dW1", "db1", "dW2", "db2", "dW3", "db3")
    return {f"err_{k}": float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
            for k, a, b in zip(names, got, ref)}


def cpu_check() -> int:
    """fp32 only: the interpreter's products of bf16 operands multiply their bits
    (triton-lang/triton#11584); tests/kernels/test_kernels_interpret.py widens them to check the
    bf16 kernels' rounding points, their accuracy is the GPU run's."""
    x, params, dout = make(300, 20, 32, torch.device("cpu"), False)
    errs = compare(x, params, dout, False, programs=3)
    worst = max(errs.values())
    ok = worst < 1e-5
    print(f"  fp32: worst relative difference {worst:.1e} (tolerance 1e-5)")
    print("cpu check: " + ("ok" if ok else f"FAILED: {errs}"))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=8192 * 768)
    ap.add_argument("--features", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=32, help="H (the camera2k decoder's: 32; the flagship's: 64)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--case", default=None, help="the record's case name (default: from the shape)")
    ap.add_argument("--sweep", action="store_true",
                    help="bf16 only: also time the backward for --sweep-blocks points a block, --sweep-warps and 2-16 "
                         "programs an SM (its registers bound how many programs an SM holds)")
    ap.add_argument("--sweep-blocks", type=int, nargs="+", default=[32, 64], help="points a block (16 or more)")
    ap.add_argument("--sweep-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--sweep-programs", type=int, nargs="+", default=[2, 4, 8, 16], help="programs an SM")
    ap.add_argument("--sweep-stages", type=int, nargs="*", default=[],
                    help="also each of these software-pipeline stages of the backward's walk (Triton's default: 3)")
    ap.add_argument("--cpu-check", action="store_true", help="Triton's interpreter on a tiny case (no GPU)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.cpu_check:
        return cpu_check()
    if not (1 <= args.features <= mlp.MAX_FEATURES and args.hidden in mlp.HIDDEN):
        raise SystemExit(f"probe_fused_mlp: a block's features and activations live in registers: --features up to "
                         f"{mlp.MAX_FEATURES} and --hidden one of {list(mlp.HIDDEN)}")

    from benchlib import cuda_times_ms, device_name, write_result

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = mlp.BWD_PROGRAMS_PER_SM * sms
    rows = []
    for bf16 in (True, False):
        x, params, dout = make(args.points, args.features, args.hidden, dev, bf16)
        row = {"variant": "bf16" if bf16 else "fp32", **compare(x, params, dout, bf16, programs)}
        def twin_fwd():
            from fasttomo.kernels import reference

            with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=bf16):
                return reference.decoder_mlp(x, *params)

        def twin_fwd_bwd():  # fresh leaves each call: no add into old gradients, as after zero_grad
            twin(x, params, bf16, dout)

        def fused_fwd_bwd():
            mlp.mlp_forward(x, *params, bf16)
            mlp.mlp_backward(x, dout, *params[:5], bf16, programs=programs)

        row["twin_fwd_ms"] = statistics.median(cuda_times_ms(twin_fwd, args.repeat, 3, dev))
        row["twin_fwd_bwd_ms"] = statistics.median(cuda_times_ms(twin_fwd_bwd, args.repeat, 3, dev))
        row["fused_fwd_ms"] = statistics.median(cuda_times_ms(lambda: mlp.mlp_forward(x, *params, bf16),
                                                               args.repeat, 3, dev))
        row["fused_fwd_bwd_ms"] = statistics.median(cuda_times_ms(fused_fwd_bwd, args.repeat, 3, dev))
        rows.append(row)
        errs = "  ".join(f"{k[4:]} {v:.1e}" for k, v in row.items() if k.startswith("err_"))
        print(f"{row['variant']}: twin fwd {row['twin_fwd_ms']:.3f} fwd+bwd {row['twin_fwd_bwd_ms']:.3f} ms | fused fwd "
              f"{row['fused_fwd_ms']:.3f} fwd+bwd {row['fused_fwd_bwd_ms']:.3f} ms | {errs}", flush=True)
    if args.sweep:
        x, params, dout = make(args.points, args.features, args.hidden, dev, True)
        for block_n in args.sweep_blocks:
            for warps in args.sweep_warps:
                for per_sm in args.sweep_programs:
                    for stages in [None, *args.sweep_stages]:
                        def bwd(block_n=block_n, warps=warps, per_sm=per_sm, stages=stages):
                            mlp.mlp_backward(x, dout, *params[:5], True, programs=per_sm * sms, block_n=block_n,
                                             warps=warps, stages=stages)
                        ms = statistics.median(cuda_times_ms(bwd, args.repeat, 3, dev))
                        staged = "" if stages is None else f", {stages} stages"
                        rows.append({"variant": f"bf16 backward {block_n} points a block, {warps} warps, {per_sm} an SM"
                                                f"{staged}", "fused_bwd_ms": ms})
                        print(f"  backward: {block_n} points a block, {warps} warps, {per_sm} programs an SM{staged}: "
                              f"{ms:.3f} ms", flush=True)
    case = args.case or f"n{args.points}-f{args.features}-h{args.hidden}"
    path = write_result("probe_fused_mlp", case, device_name(dev), rows,
                        out_dir=Path(args.out_dir) if args.out_dir else None, programs=programs)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
