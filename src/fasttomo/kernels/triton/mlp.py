"""Triton kernels of the hybrid decoder, Linear(F, H)-ReLU-Linear(H, H)-ReLU-Linear(H, 1), fused.

Through cuBLAS and torch's elementwise kernels every (N, H) activation and its gradient goes
through memory; here they stay in registers, so F and H are small (``MAX_FEATURES``, ``HIDDEN``: the
door's ``fused_mlp_fits`` holds the same limits, as it imports no Triton):

    forward   a program owns BLOCK_N points: x (BLOCK_N, F) -> z1 = x W1^T + b1 -> h1 = relu(z1)
              -> z2 = h1 W2^T + b2 -> h2 = relu(z2) -> out = h2 w3 + b3; writes out (N,) only
    backward  persistent programs (a few per SM) walk blocks of points: recompute z1, z2, then
              dz2 = dout w3 [z2 > 0], dh1 = dz2 W2, dz1 = dh1 [z1 > 0], dx = dz1 W1 (written when
              asked for), and sum dW1 = dz1^T x, dW2 = dz2^T h1, dw3 = h2^T dout and the biases' sums
              in registers; each program writes its partial sums once, added up by one torch
              reduction (the same order every call: deterministic on one device)

``bf16``: the products take bf16 operands with fp32 sums and the activations are rounded to bf16
before the next product, as bf16 autocast does for the twin (``reference.decoder_mlp``); unlike
autocast, the biases, the last layer's weights and the output stay fp32 (the output is fp32). Else
the products are IEEE fp32 (no TF32), as torch's default; the door does not take that path (cuBLAS
is faster in fp32), the interpreter tests the kernels' logic with it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fasttomo.kernels.triton.launch import device_of, launch, sm_count, sum_parts

MAX_FEATURES = 64
HIDDEN = (16, 32, 64)
FWD_BLOCK_N = 128
BWD_BLOCK_N = 32
BWD_WARPS = 4
BWD_PROGRAMS_PER_SM = 8
"""The backward's launch: 32 points a block, 4 warps, 8 programs an SM, the fastest of
``scripts/probe_fused_mlp.py --sweep`` at the camera decoder's shape (benchmarks/README.md)."""


def padded(features: int) -> int:
    """The features a block holds: a power of two, 16 at least (``tl.dot``'s smallest side)."""
    return max(16, triton.next_power_of_2(features))


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
def _block_x(x_ptr, n, N, F, fo, BF16: tl.constexpr):
    """A block's features (BN, FP), zero past N and F, in the products' dtype; their offsets."""
    xoff = n[:, None].to(tl.int64) * F + fo[None, :]
    xm = (n < N)[:, None] & (fo < F)[None, :]
    x = tl.load(x_ptr + xoff, mask=xm, other=0.0)
    if BF16:
        x = x.to(tl.bfloat16)
    else:
        x = x.to(tl.float32)
    return x, xoff, xm


@triton.jit
def mlp_fwd_kernel(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, b3_ptr, out_ptr, N, F,
                   FP: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                   PREC: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    fo = tl.arange(0, FP)
    ho = tl.arange(0, H)
    x, _, _ = _block_x(x_ptr, n, N, F, fo, BF16)
    w1t, w2t = _weights(w1_ptr, w2_ptr, F, fo, ho, BF16)
    z1, h1, z2, h2 = _layers(x, w1t, tl.load(b1_ptr + ho), w2t, tl.load(b2_ptr + ho), BF16, PREC)
    if BF16:
        h2 = h2.to(tl.bfloat16).to(tl.float32)
    out = tl.sum(h2 * tl.load(w3_ptr + ho)[None, :], axis=1) + tl.load(b3_ptr)
    tl.store(out_ptr + n, out, mask=n < N)


@triton.jit
def mlp_bwd_kernel(x_ptr, dout_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, dx_ptr, part_ptr, N, F, NPROG,
                   FP: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                   PREC: tl.constexpr, NEED_DX: tl.constexpr):
    pid = tl.program_id(0)
    fo = tl.arange(0, FP)
    ho = tl.arange(0, H)
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
        x, xoff, xm = _block_x(x_ptr, n, N, F, fo, BF16)
        z1, h1, z2, h2 = _layers(x, w1t, b1, w2t, b2, BF16, PREC)
        dout = tl.load(dout_ptr + n, mask=n < N, other=0.0).to(tl.float32)
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
        if NEED_DX:
            dx = tl.dot(dz1, tl.trans(w1t), input_precision=PREC)
            tl.store(dx_ptr + xoff, dx.to(dx_ptr.dtype.element_ty), mask=xm)
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


def _prec(bf16: bool) -> str:
    """``tl.dot``'s input precision: IEEE for fp32 operands (torch's default, no TF32); bf16
    operands ignore it (the probe's measured launches pass "tf32" there, kept)."""
    return "tf32" if bf16 else "ieee"


def mlp_forward(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                w3: torch.Tensor, b3: torch.Tensor, bf16: bool) -> torch.Tensor:
    """(N,) fp32 raw density of contiguous (N, F) features (bf16 or fp32) with fp32 nn.Linear
    weights (w1 (H, F), b1 (H,), w2 (H, H), b2 (H,), w3 (1, H), b3 (1,))."""
    N, F = x.shape
    H = w1.shape[0]
    out = torch.empty((N,), device=x.device, dtype=torch.float32)
    if N:
        launch(mlp_fwd_kernel, (triton.cdiv(N, FWD_BLOCK_N),), x, w1, b1, w2, b2, w3, b3, out, N, F, FP=padded(F),
               H=H, BLOCK_N=FWD_BLOCK_N, BF16=bf16, PREC=_prec(bf16), num_warps=4)
    return out


def mlp_backward(x: torch.Tensor, dout: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                 b2: torch.Tensor, w3: torch.Tensor, bf16: bool, need_dx: bool = True,
                 programs: int | None = None, block_n: int = BWD_BLOCK_N, warps: int = BWD_WARPS,
                 stages: int | None = None):
    """(dx (N, F) in x's dtype, or (0, F) without ``need_dx``; dW1, db1, dW2, db2, dW3, db3 in fp32
    with nn.Linear's shapes, views of one sum) for the output gradient ``dout`` (N,). ``programs``
    (default ``BWD_PROGRAMS_PER_SM`` an SM), ``block_n``, ``warps`` and ``stages`` (the software
    pipeline's stages of the walk over blocks; None: Triton's default): the launch (the probe's
    sweep)."""
    N, F = x.shape
    H = w1.shape[0]
    FP = padded(F)
    if programs is None:
        programs = BWD_PROGRAMS_PER_SM * sm_count(device_of(x))
    programs = max(1, min(programs, triton.cdiv(N, block_n)))
    dx = torch.empty((N if need_dx else 0, F), device=x.device, dtype=x.dtype)
    part = torch.empty((programs, H * FP + H * H + 3 * H + 1), device=x.device, dtype=torch.float32)
    extra = {} if stages is None else {"num_stages": stages}
    launch(mlp_bwd_kernel, (programs,), x, dout, w1, b1, w2, b2, w3, dx, part, N, F, programs, FP=FP, H=H,
           BLOCK_N=block_n, BF16=bf16, PREC=_prec(bf16), NEED_DX=need_dx, num_warps=warps, **extra)
    s = sum_parts(part, 0)
    o = H * FP
    dw1 = s[:o].reshape(H, FP)[:, :F]
    dw2 = s[o:o + H * H].reshape(H, H)
    o += H * H
    return dx, dw1, s[o:o + H], dw2, s[o + H:o + 2 * H], s[o + 2 * H:o + 3 * H].reshape(1, H), s[o + 3 * H:]
