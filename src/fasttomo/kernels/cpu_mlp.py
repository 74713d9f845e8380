"""Native (C) CPU kernels of ``decoder_mlp``: the hybrid decoder (Linear-ReLU-Linear-ReLU-Linear)
forward and backward, each in one pass over the points.

On a CPU, aten runs the decoder as three GEMMs forward and six backward over (N, hidden) tensors
that live in memory between them, plus the ReLUs, their masks and the bias sums (about 12 ms of the
embedded default's ~30 ms CPU step; docs/kernels.md, "The decoder on the CPU"). Here each worker
thread walks its points two at a time, keeps their hidden rows in registers and writes only what
the backward needs: the output, and the two ReLU'd hidden layers (N, H padded to whole vectors)
when a gradient will be taken. The backward takes blocks of 64 points: dL/dh2, dL/dh1 and dL/dx row by row, then the
weight gradients of the block as two small GEMMs into the worker's own accumulators (summed over
the workers afterwards, in a fixed order: the same bits for the same thread count).

Semantics are the twin's (``reference.decoder_mlp``, ``nn.Linear``'s weight layout (out, in));
the sums run in another order, so values agree to rounding. The hidden width and the input
features are compile-time constants (one library per (dtype, features, hidden), cached like the
interpolation's: ``cpu_native.compile_source``), padded inside to whole vectors with zero weights.
Parity with the twin: tests/kernels/test_cpu_mlp.py.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess

import torch

from fasttomo.kernels import counters as _spy
from fasttomo.kernels import cpu_native, reference

log = logging.getLogger("fasttomo.kernels")

MAX_FEATURES = 2048
MAX_HIDDEN = 512
"""Wider decoders take the twin (the C code keeps a row of each on the stack)."""

_SOURCE = cpu_native.THREADS_C + r"""
#include <stdlib.h>

#ifndef SCALAR
#define SCALAR float
#endif
typedef SCALAR real;
/* F input features, H hidden units (compile-time); padded to whole vectors (zero weights) */
#define VBYTES 32
#define VW ((int)(VBYTES / sizeof(real)))
#define HP ((H + VW - 1) / VW * VW)
#define FP ((F + VW - 1) / VW * VW)
#define HV (HP / VW)
#define FV (FP / VW)
#define NB 64  /* points a backward block */
typedef real vreal __attribute__((vector_size(VBYTES)));
typedef __typeof__((vreal){0} > (vreal){0}) vmask;
static inline vreal vld(const real *p) { vreal v; memcpy(&v, p, sizeof v); return v; }
static inline void vst(real *p, vreal v) { memcpy(p, &v, sizeof v); }
/* torch.relu: a where a is not <= 0 (so NaN is kept), else 0 (one compare and an and-not) */
static inline vreal vrelu(vreal a) { return (vreal)((vmask)a & ~(a <= (vreal){0})); }
/* the ReLU's gradient (threshold_backward): a where h is not <= 0 (NaN passes), else 0 */
static inline vreal vkeep(vreal a, vreal h) { return (vreal)((vmask)a & ~(h <= (vreal){0})); }
/* the lanes of the last hidden vector that are real units (the padded ones are kept at exactly 0, so
   that a non-finite input cannot leak through a zero weight: 0 * inf is NaN) */
static inline vmask vlast_lanes(void) {
  vmask m;
  for (int i = 0; i < VW; i++) m[i] = (HV - 1) * VW + i < H ? -1 : 0;
  return m;
}

typedef struct {
  int64_t n0, n1;                      /* this worker's points */
  const real *x;                       /* (N, F) */
  const real *w1t, *w2t, *w1, *w2;     /* padded: W1^T (FP, HP), W2^T (HP, HP), W1 (HP, FP), W2 (HP, HP) */
  const real *b1, *b2, *w3;            /* (HP) */
  real b3;
  real *out, *h1, *h2;                 /* (N); the ReLU'd hidden layers (N, HP), or NULL: not kept */
  const real *gout;                    /* backward: dL/dout (N) */
  real *gx;                            /* backward: dL/dx (N, F) or NULL */
  real *acc;                           /* backward: this worker's gW1 (HP, FP), gb1, gW2 (HP, HP), gb2, gw3 (HP), gb3 */
} mjob_t;

#define ACC_SIZE (HP * FP + HP + HP * HP + HP + HP + 1)
#define PREP_SIZE (2 * FP * HP + 2 * HP * HP + 3 * HP)

/* acc0 += sum_k a0[k*sa] * b[k*ldb : NV vectors], acc1 likewise with a1: two rows of a small GEMM
   at once, each row of b loaded once for both (NV is a constant where inlined: unrolled) */
static inline __attribute__((always_inline)) void gemm2(vreal *acc0, vreal *acc1, int NV, int K,
    const real *a0, const real *a1, int sa, const real *b, int ldb) {
  for (int k = 0; k < K; k++) {
    const real s0 = a0[k * sa], s1 = a1[k * sa];
    const real *br = b + k * ldb;
#pragma GCC unroll 16
    for (int v = 0; v < NV; v++) { vreal bv = vld(br + v * VW); acc0[v] += s0 * bv; acc1[v] += s1 * bv; }
  }
}

static void *fwd_worker(void *p) {
  mjob_t *a = (mjob_t *)p;
  real hs[2][HP];
  const vmask last = vlast_lanes();
  for (int64_t n = a->n0; n < a->n1; n += 2) {
    const int two = n + 1 < a->n1;  /* a lone last point is computed twice, stored once */
    const real *x0 = a->x + n * F, *x1 = two ? x0 + F : x0;
    vreal c0[HV], c1[HV];
#pragma GCC unroll 16
    for (int v = 0; v < HV; v++) c0[v] = c1[v] = vld(a->b1 + v * VW);
    gemm2(c0, c1, HV, F, x0, x1, 1, a->w1t, HP);
#pragma GCC unroll 16
    for (int v = 0; v < HV; v++) { c0[v] = vrelu(c0[v]); c1[v] = vrelu(c1[v]); }
    c0[HV - 1] = (vreal)((vmask)c0[HV - 1] & last); c1[HV - 1] = (vreal)((vmask)c1[HV - 1] & last);
#pragma GCC unroll 16
    for (int v = 0; v < HV; v++) { vst(hs[0] + v * VW, c0[v]); vst(hs[1] + v * VW, c1[v]); }
    if (a->h1) {
      memcpy(a->h1 + n * HP, hs[0], sizeof hs[0]);
      if (two) memcpy(a->h1 + (n + 1) * HP, hs[1], sizeof hs[1]);
    }
#pragma GCC unroll 16
    for (int v = 0; v < HV; v++) c0[v] = c1[v] = vld(a->b2 + v * VW);
    gemm2(c0, c1, HV, H, hs[0], hs[1], 1, a->w2t, HP);
    vreal o0 = {0}, o1 = {0};
#pragma GCC unroll 16
    for (int v = 0; v < HV; v++) { c0[v] = vrelu(c0[v]); c1[v] = vrelu(c1[v]); }
    c0[HV - 1] = (vreal)((vmask)c0[HV - 1] & last); c1[HV - 1] = (vreal)((vmask)c1[HV - 1] & last);
#pragma GCC unroll 16
    for (int v = 0; v < HV; v++) {
      vreal w3 = vld(a->w3 + v * VW);
      o0 += c0[v] * w3; o1 += c1[v] * w3;
      if (a->h2) {
        vst(a->h2 + n * HP + v * VW, c0[v]);
        if (two) vst(a->h2 + (n + 1) * HP + v * VW, c1[v]);
      }
    }
    real s0 = a->b3, s1 = a->b3;
    for (int i = 0; i < VW; i++) { s0 += o0[i]; s1 += o1[i]; }
    a->out[n] = s0;
    if (two) a->out[n + 1] = s1;
  }
  return NULL;
}

/* rows j, j+1 of acc (row length ldc) += sum over the block's points b of d[b][j] * m[b][:] */
static inline __attribute__((always_inline)) void outer2(real *acc, int ldc, int NV, const real *d, const real *m,
                                                          int nb) {
  for (int j = 0; j < HP; j += 2) {
    vreal a0[NV], a1[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; v++) { a0[v] = vld(acc + j * ldc + v * VW); a1[v] = vld(acc + (j + 1) * ldc + v * VW); }
    gemm2(a0, a1, NV, nb, d + j, d + j + 1, HP, m, ldc);
#pragma GCC unroll 16
    for (int v = 0; v < NV; v++) { vst(acc + j * ldc + v * VW, a0[v]); vst(acc + (j + 1) * ldc + v * VW, a1[v]); }
  }
}

/* dL/dh1 (the block's rows b, b1) = (d2 W2) where h1 > 0; dL/dx = d1 W1 */
static inline void bwd_rows(mjob_t *a, real (*d1)[HP], real (*d2)[HP], const real *h1b, int64_t n0, int b, int b1,
                            vreal *gb1) {
  vreal c0[HV], c1[HV];
#pragma GCC unroll 16
  for (int v = 0; v < HV; v++) c0[v] = c1[v] = (vreal){0};
  gemm2(c0, c1, HV, H, d2[b], d2[b1], 1, a->w2, HP);
#pragma GCC unroll 16
  for (int v = 0; v < HV; v++) {
    c0[v] = vkeep(c0[v], vld(h1b + b * HP + v * VW));
    c1[v] = vkeep(c1[v], vld(h1b + b1 * HP + v * VW));
    vst(d1[b] + v * VW, c0[v]); vst(d1[b1] + v * VW, c1[v]);
    gb1[v] += c0[v];
    if (b1 != b) gb1[v] += c1[v];
  }
  if (!a->gx) return;
  vreal e0[FV], e1[FV];
  real t0[FP], t1[FP];
#pragma GCC unroll 16
  for (int u = 0; u < FV; u++) e0[u] = e1[u] = (vreal){0};
  gemm2(e0, e1, FV, H, d1[b], d1[b1], 1, a->w1, FP);
#pragma GCC unroll 16
  for (int u = 0; u < FV; u++) { vst(t0 + u * VW, e0[u]); vst(t1 + u * VW, e1[u]); }
  memcpy(a->gx + (n0 + b) * F, t0, sizeof(real) * F);
  if (b1 != b) memcpy(a->gx + (n0 + b1) * F, t1, sizeof(real) * F);
}

static void *bwd_worker(void *p) {
  mjob_t *a = (mjob_t *)p;
  real *gW1 = a->acc, *gb1 = gW1 + HP * FP, *gW2 = gb1 + HP, *gb2 = gW2 + HP * HP, *gw3 = gb2 + HP, *gb3 = gw3 + HP;
  vreal vgb1[HV], vgb2[HV], vgw3[HV];
  for (int v = 0; v < HV; v++) vgb1[v] = vgb2[v] = vgw3[v] = (vreal){0};
  double sgb3 = 0;
  /* the block's dL/dh1, dL/dh2 and inputs (zero-padded to FP) */
  real (*d1)[HP] = calloc(NB, sizeof *d1), (*d2)[HP] = calloc(NB, sizeof *d2), (*xb)[FP] = calloc(NB, sizeof *xb);
  if (!d1 || !d2 || !xb) { free(d1); free(d2); free(xb); a->acc = NULL; return NULL; }
  for (int64_t n0 = a->n0; n0 < a->n1; n0 += NB) {
    const int nb = a->n1 - n0 < NB ? (int)(a->n1 - n0) : NB;
    const real *h1b = a->h1 + n0 * HP;
    for (int b = 0; b < nb; b++) {  /* dL/dh2 (where h2 > 0); the output layer's gradients, h2's bias */
      const int64_t n = n0 + b;
      const real g = a->gout[n];
      sgb3 += g;
#pragma GCC unroll 16
      for (int v = 0; v < HV; v++) {
        vreal h = vld(a->h2 + n * HP + v * VW);
        vgw3[v] += g * h;
        vreal d = vkeep(g * vld(a->w3 + v * VW), h);
        vgb2[v] += d;
        vst(d2[b] + v * VW, d);
      }
      memcpy(xb[b], a->x + n * F, sizeof(real) * F);
    }
    for (int b = 0; b < nb; b += 2) bwd_rows(a, d1, d2, h1b, n0, b, b + 1 < nb ? b + 1 : b, vgb1);
    outer2(gW2, HP, HV, &d2[0][0], h1b, nb);
    outer2(gW1, FP, FV, &d1[0][0], &xb[0][0], nb);
  }
  for (int v = 0; v < HV; v++) { vst(gb1 + v * VW, vgb1[v]); vst(gb2 + v * VW, vgb2[v]); vst(gw3 + v * VW, vgw3[v]); }
  *gb3 = (real)sgb3;
  free(d1); free(d2); free(xb);
  return NULL;
}

/* 0, or -1 where a worker could not allocate its block buffers */
static int run(void *(*fn)(void *), mjob_t *base, int64_t N, int nt, real *acc) {
  mjob_t jobs[MAXT];
  nt = clamp_threads(nt);
  split_jobs(jobs, base, sizeof jobs[0], nt, N);
  for (int i = 0; i < nt; i++) if (acc) jobs[i].acc = acc + (int64_t)i * ACC_SIZE;
  run_jobs(fn, jobs, sizeof jobs[0], nt);
  for (int i = 0; i < nt; i++) if (acc && !jobs[i].acc) return -1;
  return 0;
}

/* the padded copies of the weights (nn.Linear's layout: w1 (H, F), w2 (H, H), w3 (H)) in buf */
static void prepare(mjob_t *b, real *buf, const real *w1, const real *b1, const real *w2, const real *b2,
                    const real *w3) {
  memset(buf, 0, sizeof(real) * PREP_SIZE);
  real *w1t = buf, *w1p = w1t + FP * HP, *w2t = w1p + HP * FP, *w2p = w2t + HP * HP, *pb1 = w2p + HP * HP,
       *pb2 = pb1 + HP, *pw3 = pb2 + HP;
  for (int i = 0; i < H; i++) {
    for (int f = 0; f < F; f++) { w1t[f * HP + i] = w1[i * F + f]; w1p[i * FP + f] = w1[i * F + f]; }
    for (int j = 0; j < H; j++) { w2t[j * HP + i] = w2[i * H + j]; w2p[i * HP + j] = w2[i * H + j]; }
    pb1[i] = b1[i]; pb2[i] = b2[i]; pw3[i] = w3[i];
  }
  b->w1t = w1t; b->w1 = w1p; b->w2t = w2t; b->w2 = w2p; b->b1 = pb1; b->b2 = pb2; b->w3 = pw3;
}

int mlp_acc_size(void) { return ACC_SIZE; }
int mlp_hidden_padded(void) { return HP; }
int mlp_features_padded(void) { return FP; }

/* out (N); h1, h2 (N, HP) or NULL (nothing kept for a backward). 0, or -1: out of memory */
int mlp_forward(int64_t N, const real *x, const real *w1, const real *b1, const real *w2, const real *b2,
                const real *w3, real b3, real *out, real *h1, real *h2, int nt) {
  mjob_t b; memset(&b, 0, sizeof b);
  real *buf = malloc(sizeof(real) * PREP_SIZE);
  if (!buf) return -1;
  prepare(&b, buf, w1, b1, w2, b2, w3);
  b.x = x; b.b3 = b3; b.out = out; b.h1 = h1; b.h2 = h2;
  run(fwd_worker, &b, N, nt, NULL);
  free(buf);
  return 0;
}

/* acc: (nt, ACC_SIZE) zeroed by the caller; gx (N, F) or NULL. 0, or -1: out of memory */
int mlp_backward(int64_t N, const real *x, const real *w1, const real *b1, const real *w2, const real *b2,
                 const real *w3, const real *h1, const real *h2, const real *gout, real *gx, real *acc, int nt) {
  mjob_t b; memset(&b, 0, sizeof b);
  real *buf = malloc(sizeof(real) * PREP_SIZE);
  if (!buf) return -1;
  prepare(&b, buf, w1, b1, w2, b2, w3);
  b.x = x; b.h1 = (real *)h1; b.h2 = (real *)h2; b.gout = gout; b.gx = gx;
  int rc = run(bwd_worker, &b, N, nt, acc);
  free(buf);
  return rc;
}
"""

_libs: dict = {}
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def library(dtype: torch.dtype, features: int, hidden: int):
    """The compiled kernels for (dtype, features, hidden), or None where they cannot be built
    (logged once) or the decoder is wider than MAX_FEATURES / MAX_HIDDEN."""
    k = (dtype, features, hidden)
    if k not in _libs:
        lib = None
        if dtype in (torch.float32, torch.float64) and 0 < features <= MAX_FEATURES and 0 < hidden <= MAX_HIDDEN:
            scalar = "double" if dtype == torch.float64 else "float"
            real = ctypes.c_double if dtype == torch.float64 else ctypes.c_float
            try:
                lib = ctypes.CDLL(str(cpu_native.compile_source(
                    f"decoder_mlp_{scalar}_f{features}_h{hidden}", _SOURCE,
                    [f"-DSCALAR={scalar}", f"-DF={features}", f"-DH={hidden}"])))
                lib.mlp_forward.argtypes = [_I64, _P, _P, _P, _P, _P, _P, real, _P, _P, _P, _I]
                lib.mlp_backward.argtypes = [_I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I]
                lib.mlp_forward.restype = lib.mlp_backward.restype = _I
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.info("decoder_mlp: native CPU kernels unavailable (%s); using the twin", e)
                lib = None
        _libs[k] = lib
    return _libs[k]


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def forward(lib, x, w1, b1, w2, b2, w3, b3, keep: bool):
    """(out (N,), h1, h2) with the hidden layers (N, HP) kept only when ``keep``."""
    n = x.shape[0]
    hp = lib.mlp_hidden_padded()
    out = x.new_empty(n)
    h1 = x.new_empty((n, hp)) if keep else None
    h2 = x.new_empty((n, hp)) if keep else None
    if lib.mlp_forward(n, x.data_ptr(), w1.data_ptr(), b1.data_ptr(), w2.data_ptr(), b2.data_ptr(), w3.data_ptr(),
                       float(b3), out.data_ptr(), _ptr(h1), _ptr(h2), torch.get_num_threads()):
        raise MemoryError("decoder_mlp: the native forward could not allocate its buffers")
    return out, h1, h2


def backward(lib, x, weights, h1, h2, gout, need_x: bool):
    """(dL/dx or None, dL/dw1, dL/db1, dL/dw2, dL/db2, dL/dw3 (1, H), dL/db3 (1,))."""
    w1, b1, w2, b2, w3, _ = weights
    n, f = x.shape
    h = w1.shape[0]
    hp, fp = lib.mlp_hidden_padded(), lib.mlp_features_padded()
    nt = max(1, min(torch.get_num_threads(), 64))
    acc = x.new_zeros((nt, lib.mlp_acc_size()))
    gx = x.new_empty((n, f)) if need_x else None
    if lib.mlp_backward(n, x.data_ptr(), w1.data_ptr(), b1.data_ptr(), w2.data_ptr(), b2.data_ptr(), w3.data_ptr(),
                        h1.data_ptr(), h2.data_ptr(), gout.data_ptr(), _ptr(gx), acc.data_ptr(), nt):
        raise MemoryError("decoder_mlp: the native backward could not allocate its buffers")
    a = acc.sum(0)
    sizes = [hp * fp, hp, hp * hp, hp, hp, 1]
    gw1, gb1, gw2, gb2, gw3, gb3 = torch.split(a, sizes)
    return (gx, gw1.view(hp, fp)[:h, :f], gb1[:h], gw2.view(hp, hp)[:h, :h], gb2[:h], gw3[:h].view(1, h),
            gb3.clone())


class DecoderMLPCPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, w3, b3, lib=None):
        out, h1, h2 = forward(lib, x, w1, b1, w2, b2, w3, b3, keep=True)
        ctx.lib = lib
        ctx.save_for_backward(x, w1, b1, w2, b2, w3, b3, h1, h2)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w1, b1, w2, b2, w3, b3, h1, h2 = ctx.saved_tensors
        needs = ctx.needs_input_grad[:7]
        if torch.is_grad_enabled():  # create_graph backward: higher-order autograd through the twin
            _spy.count("decoder_mlp_bwd", "torch")
            ins = (x, w1, b1, w2, b2, w3, b3)
            wrt = [i for i, need in enumerate(needs) if need]
            out = reference.decoder_mlp(*ins)
            got = torch.autograd.grad(out, [ins[i] for i in wrt], grad, create_graph=True)
            res = [None] * 7
            for i, g in zip(wrt, got):
                res[i] = g
            return (*res, None)
        _spy.count("decoder_mlp_bwd", "cpu")
        gout = grad.to(x.dtype).contiguous()
        grads = backward(ctx.lib, x, (w1, b1, w2, b2, w3, b3), h1, h2, gout, bool(needs[0]))
        return (*(g if need else None for g, need in zip(grads, needs)), None)


def unsupported(x, params) -> str | None:
    """Why these tensors are not the kernels' (x (N, F), w1 (H, F), b1 (H,), w2 (H, H), b2 (H,),
    w3 (1, H), b3 (1,), one device and dtype), or None. The C code reads the weights by the widths
    of x and w1, so any other shape must take the twin (which computes or raises as torch does)."""
    if any(t.device != x.device or t.dtype != x.dtype for t in params):
        return "the weights differ from the features in device or dtype"
    if x.dim() != 2 or params[0].dim() != 2:
        return f"features shape {tuple(x.shape)}, weights {tuple(params[0].shape)}: the kernels need (N, F), (H, F)"
    f, h = x.shape[1], params[0].shape[0]
    want = ((h, f), (h,), (h, h), (h,), (1, h), (1,))
    if any(tuple(t.shape) != w for t, w in zip(params, want)):
        return (f"weight shapes {[tuple(t.shape) for t in params]} are not the hybrid decoder's "
                f"{list(want)} for {f} features and {h} hidden units")
    return None


def decoder_mlp(x, w1, b1, w2, b2, w3, b3, native: bool | None = None) -> torch.Tensor:
    """The twin's ``decoder_mlp`` on CPU float32/float64 tensors of one dtype (x (N, F), w1 (H, F),
    b1 (H,), w2 (H, H), b2 (H,), w3 (1, H), b3 (1,)); no autocast. ``native``: None uses the C
    kernels where they can be built and the shapes are these, else the twin; True requires them
    (RuntimeError)."""
    problem = unsupported(x, (w1, b1, w2, b2, w3, b3))
    lib = None if native is False or problem else library(x.dtype, x.shape[1], w1.shape[0])
    if lib is None:
        if native:
            raise RuntimeError(f"decoder_mlp: the native CPU kernels cannot take this call: {problem}" if problem
                               else "decoder_mlp: the native CPU kernels could not be built (see the log)")
        return reference.decoder_mlp(x, w1, b1, w2, b2, w3, b3)
    x, w1, b1, w2, b2, w3, b3 = (t.contiguous() for t in (x, w1, b1, w2, b2, w3, b3))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2, b2, w3, b3)):
        return DecoderMLPCPU.apply(x, w1, b1, w2, b2, w3, b3, lib)
    return forward(lib, x, w1, b1, w2, b2, w3, b3, keep=False)[0]
