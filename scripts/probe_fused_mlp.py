#!/usr/bin/env python
"""probe_fused_mlp: what a fused decoder would save at camera scale, before it is built into the door.

The camera2k step (bench_step --case camera2k --profile) spends about 4 ms of its 14.6 ms (bf16,
one H100) in the decoder: Linear(F, H)-ReLU-Linear(H, H)-ReLU-Linear(H, 1) on 6.3 M points with
F = 48, H = 32 (model.hidden; the flagship's is 64), run by cuBLAS and torch's elementwise
kernels, which write and read every (N, H) activation through memory. This probe is the decoder
as two Triton kernels that keep the activations in registers (so F up to 128; the flagship's
F = 1152 is not for this design):

    forward   a program owns BLOCK_N points: x (BLOCK_N, F) -> z1 = x W1^T + b1 -> h1 = relu(z1)
              -> z2 = h1 W2^T + b2 -> h2 = relu(z2) -> out = h2 w3 + b3; writes out (N,) only
    backward  persistent programs (a few per SM) walk blocks of points: recompute z1, z2, then
              dz2 = dout w3 [z2 > 0], dh1 = dz2 W2, dz1 = dh1 [z1 > 0], dx = dz1 W1 (written), and
              sum dW1 = dz1^T x, dW2 = dz2^T h1, dw3 = h2^T dout and the biases' sums in registers;
              each program writes its partial sums once, added up by one torch reduction (the
              same order every call)

In bf16 the products take bf16 operands with fp32 sums and the activations are rounded to bf16
before the next product, as autocast does for the twin (``reference.decoder_mlp``; autocast also
rounds the biases, the last layer's weights and the output to bf16, which this keeps in fp32); in
fp32 the products are IEEE fp32 (no TF32), as torch's default. Parity against the twin under the
same precision (forward output, dL/dx and every weight's gradient through autograd), then
CUDA-event medians of the fused pair against the twin's forward and backward. Prints a table,
writes benchmarks/results/probe_fused_mlp-<case>-<device>-<commit>.json.

    python scripts/probe_fused_mlp.py                       # camera2k: N = 8192 x 768, F = 48, H = 32
    python scripts/probe_fused_mlp.py --points 6291456 --features 96     # other widths, F <= 128
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

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _layers(x, w1t, b1, w2t, b2, BF16: tl.constexpr, PREC: tl.constexpr):
    """(z1, h1, z2, h2) of a block; x (BN, FP), w1t (FP, H), w2t (H, H)."""
    z1 = tl.dot(x, w1t, input_precision=PREC) + b1[None, :]
    h1 = tl.maximum(z1, 0.0)
    if BF16:
        h1 = h1.to(tl.bfloat16)
    z2 = tl.dot(h1, w2t, input_precision=PREC) + b2[None, :]
    h2 = tl.maximum(z2, 0.0)
    return z1, h1, z2, h2


@triton.jit
def _weights(w1_ptr, w2_ptr, F, fo, ho, BF16: tl.constexpr):
    """W1^T (FP, H) and W2^T (H, H) from nn.Linear's (H, F) and (H, H), in the products' dtype."""
    fm = fo < F
    w1t = tl.load(w1_ptr + ho[None, :] * F + fo[:, None], mask=fm[:, None], other=0.0)
    w2t = tl.load(w2_ptr + ho[None, :] * ho.shape[0] + ho[:, None])
    if BF16:
        w1t = w1t.to(tl.bfloat16)
        w2t = w2t.to(tl.bfloat16)
    return w1t, w2t


@triton.jit
def mlp_fwd_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, b3_ptr, out_ptr, N, F,
                   FP: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                   PREC: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    fo = tl.arange(0, FP)
    ho = tl.arange(0, H)
    nm = n < N
    x = tl.load(x_ptr + n[:, None].to(tl.int64) * F + fo[None, :], mask=nm[:, None] & (fo < F)[None, :], other=0.0)
    w1t, w2t = _weights(w1_ptr, w2_ptr, F, fo, ho, BF16)
    b1 = tl.load(b1_ptr + ho)
    b2 = tl.load(b2_ptr + ho)
    z1, h1, z2, h2 = _layers(x, w1t, b1, w2t, b2, BF16, PREC)
    if BF16:
        h2 = h2.to(tl.bfloat16).to(tl.float32)
    out = tl.sum(h2 * tl.load(w3_ptr + ho)[None, :], axis=1) + tl.load(b3_ptr)
    tl.store(out_ptr + n, out, mask=nm)


@triton.jit
def mlp_bwd_kernel(x_ptr, dout_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, dx_ptr, part_ptr, N, F, NPROG,
                   FP: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                   PREC: tl.constexpr):
    pid = tl.program_id(0)
    fo = tl.arange(0, FP)
    ho = tl.arange(0, H)
    fm = fo < F
    w1t, w2t = _weights(w1_ptr, w2_ptr, F, fo, ho, BF16)
    b1 = tl.load(b1_ptr + ho)
    b2 = tl.load(b2_ptr + ho)
    w3 = tl.load(w3_ptr + ho)
    dw1 = tl.zeros([H, FP], dtype=tl.float32)
    dw2 = tl.zeros([H, H], dtype=tl.float32)
    db1 = tl.zeros([H], dtype=tl.float32)
    db2 = tl.zeros([H], dtype=tl.float32)
    dw3 = tl.zeros([H], dtype=tl.float32)
    db3 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for blk in range(pid, tl.cdiv(N, BLOCK_N), NPROG):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        xoff = n[:, None].to(tl.int64) * F + fo[None, :]
        x = tl.load(x_ptr + xoff, mask=nm[:, None] & fm[None, :], other=0.0)
        z1, h1, z2, h2 = _layers(x, w1t, b1, w2t, b2, BF16, PREC)
        dout = tl.load(dout_ptr + n, mask=nm, other=0.0)
        if BF16:
            h2 = h2.to(tl.bfloat16)
        dw3 += tl.sum(h2.to(tl.float32) * dout[:, None], axis=0)
        db3 += dout
        dz2 = tl.where(z2 > 0.0, dout[:, None] * w3[None, :], 0.0)
        if BF16:
            dz2 = dz2.to(tl.bfloat16)
        dh1 = tl.dot(dz2, tl.trans(w2t), input_precision=PREC)
        dz1 = tl.where(z1 > 0.0, dh1, 0.0)
        if BF16:
            dz1 = dz1.to(tl.bfloat16)
        dw2 += tl.dot(tl.trans(dz2), h1, input_precision=PREC)
        db2 += tl.sum(dz2.to(tl.float32), axis=0)
        dw1 += tl.dot(tl.trans(dz1), x, input_precision=PREC)
        db1 += tl.sum(dz1.to(tl.float32), axis=0)
        dx = tl.dot(dz1, tl.trans(w1t), input_precision=PREC)
        tl.store(dx_ptr + xoff, dx, mask=nm[:, None] & fm[None, :])
    # this program's partial sums: dW1 (H, FP), dW2 (H, H), db1, db2, dw3 (H each), db3
    base = part_ptr + pid.to(tl.int64) * (H * FP + H * H + 3 * H + 1)
    tl.store(base + ho[:, None] * FP + fo[None, :], dw1)
    base += H * FP
    tl.store(base + ho[:, None] * H + ho[None, :], dw2)
    base += H * H
    tl.store(base + ho, db1)
    tl.store(base + H + ho, db2)
    tl.store(base + 2 * H + ho, dw3)
    tl.store(base + 3 * H, tl.sum(db3, axis=0))


def _fp(F: int) -> int:
    return max(16, triton.next_power_of_2(F))


def fused_forward(x, w1, b1, w2, b2, w3, b3, bf16: bool, block_n: int = 128):
    N, F = x.shape
    H = w1.shape[0]
    out = torch.empty(N, device=x.device, dtype=torch.float32)
    mlp_fwd_kernel[(triton.cdiv(N, block_n),)](x, w1, b1, w2, b2, w3.reshape(-1), b3, out, N, F, FP=_fp(F), H=H,
                                                 BLOCK_N=block_n, BF16=bf16, PREC="tf32" if bf16 else "ieee",
                                                 num_warps=4)
    return out


def fused_backward(x, dout, w1, b1, w2, b2, w3, bf16: bool, programs: int, block_n: int = 32, warps: int = 4):
    """(dx, dW1, db1, dW2, db2, dW3, db3) with nn.Linear's shapes."""
    N, F = x.shape
    H = w1.shape[0]
    FP = _fp(F)
    dx = torch.empty(N, F, device=x.device, dtype=x.dtype)
    width = H * FP + H * H + 3 * H + 1
    part = torch.empty(programs, width, device=x.device, dtype=torch.float32)
    mlp_bwd_kernel[(programs,)](x, dout.contiguous(), w1, b1, w2, b2, w3.reshape(-1), dx, part, N, F, programs,
                                FP=FP, H=H, BLOCK_N=block_n, BF16=bf16, PREC="tf32" if bf16 else "ieee",
                                num_warps=warps)
    s = part.sum(0)
    dw1 = s[:H * FP].reshape(H, FP)[:, :F]
    o = H * FP
    dw2 = s[o:o + H * H].reshape(H, H)
    o += H * H
    db1, db2, dw3, db3 = s[o:o + H], s[o + H:o + 2 * H], s[o + 2 * H:o + 3 * H].reshape(1, H), s[o + 3 * H:]
    return dx, dw1, db1, dw2, db2, dw3, db3


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


def compare(x, params, dout, bf16: bool, programs: int) -> dict:
    ref = twin(x, params, bf16, dout)
    out = fused_forward(x, *params, bf16)
    got = (out, *fused_backward(x, dout, *params[:5], bf16, programs))
    names = ("out", "dx", "dW1", "db1", "dW2", "db2", "dW3", "db3")
    return {f"err_{k}": float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
            for k, a, b in zip(names, got, ref)}


def cpu_check() -> int:
    """fp32 only: the interpreter's products of bf16 operands are wrong (Triton 3.9: 2.7e10 off on
    a 16 x 16 product), so the bf16 path's parity is the GPU run's."""
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
    ap.add_argument("--cpu-check", action="store_true", help="Triton's interpreter on a tiny case (no GPU)")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    if args.cpu_check:
        return cpu_check()
    if _fp(args.features) > 128 or args.hidden not in (16, 32, 64, 128):
        raise SystemExit("probe_fused_mlp: a block's features and activations live in registers: --features up to "
                         "128 and --hidden a power of two from 16 to 128")

    from benchlib import cuda_times_ms, device_name, write_result

    dev = torch.device("cuda")
    programs = 4 * torch.cuda.get_device_properties(dev).multi_processor_count
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
            fused_forward(x, *params, bf16)
            fused_backward(x, dout, *params[:5], bf16, programs)

        row["twin_fwd_ms"] = statistics.median(cuda_times_ms(twin_fwd, args.repeat, 3, dev))
        row["twin_fwd_bwd_ms"] = statistics.median(cuda_times_ms(twin_fwd_bwd, args.repeat, 3, dev))
        row["fused_fwd_ms"] = statistics.median(cuda_times_ms(lambda: fused_forward(x, *params, bf16),
                                                               args.repeat, 3, dev))
        row["fused_fwd_bwd_ms"] = statistics.median(cuda_times_ms(fused_fwd_bwd, args.repeat, 3, dev))
        rows.append(row)
        errs = "  ".join(f"{k[4:]} {v:.1e}" for k, v in row.items() if k.startswith("err_"))
        print(f"{row['variant']}: twin fwd {row['twin_fwd_ms']:.3f} fwd+bwd {row['twin_fwd_bwd_ms']:.3f} ms | fused fwd "
              f"{row['fused_fwd_ms']:.3f} fwd+bwd {row['fused_fwd_bwd_ms']:.3f} ms | {errs}", flush=True)
    if args.sweep:
        x, params, dout = make(args.points, args.features, args.hidden, dev, True)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        for block_n in args.sweep_blocks:
            for warps in args.sweep_warps:
                for per_sm in (2, 4, 8, 16):
                    def bwd(block_n=block_n, warps=warps, per_sm=per_sm):
                        fused_backward(x, dout, *params[:5], True, per_sm * sms, block_n, warps)
                    ms = statistics.median(cuda_times_ms(bwd, args.repeat, 3, dev))
                    rows.append({"variant": f"bf16 backward {block_n} points a block, {warps} warps, {per_sm} an SM",
                                 "fused_bwd_ms": ms})
                    print(f"  backward: {block_n} points a block, {warps} warps, {per_sm} programs an SM: {ms:.3f} ms",
                          flush=True)
    case = args.case or f"n{args.points}-f{args.features}-h{args.hidden}"
    path = write_result("probe_fused_mlp", case, device_name(dev), rows,
                        out_dir=Path(args.out_dir) if args.out_dir else None, programs=programs)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
