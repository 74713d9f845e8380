"""Native (C) CPU kernels of ``tilted_kplanes``: forward and backward in one pass over the points.

The aten path of ``kernels/cpu.py`` samples each plane with ``grid_sampler_2d`` and needs, around
it, a grid copy, products, transposing copies of the features and the output gradient and the
plane-gradient copies (a profile of the embedded default CPU step: ~8 ms forward, ~23 ms
backward). Here one C function per direction walks the points once per (frame, scale) and does all
of it: q = M_t p, the 3 bilinear samples (grid_sample's ``align_corners=True``,
``padding_mode='border'`` semantics, coordinate gradient zero on and past the border), their
product written straight into the (N, L*T*C) output; the backward recomputes the samples (nothing
is saved but the inputs), scatters the plane gradient into one buffer per worker thread (summed at
the end, in a fixed order), and contracts the coordinate gradient into dL/dpoints and dL/dmatrices
(the latter summed in float64 per thread).

The source below is compiled on first use with the system C compiler (``cc``, ``-O3
-march=native``, reassociation allowed so channel sums vectorize), one library per (dtype,
channels), cached in ``$XDG_CACHE_HOME/fasttomo`` (default ``~/.cache/fasttomo``) and loaded with
ctypes (the GIL is released during a call). Worker threads: ``torch.get_num_threads()`` pthreads.
Where no compiler works, :func:`library` returns None and ``kernels/cpu.py`` keeps its aten path
(logged once). Parity with the twin: tests/kernels/test_cpu_path.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from fasttomo.kernels.layout import PlaneLayout

log = logging.getLogger("fasttomo.kernels")

MAX_CHANNELS = 256
"""The C code keeps one point's samples on the stack: more channels take the aten path."""

_CFLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
           "-shared", "-fPIC"]

THREADS_C = r"""
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#define MAXT 64
static int clamp_threads(int nt) { return nt > MAXT ? MAXT : nt < 1 ? 1 : nt; }
/* jobs[i] = *base with worker i's share [n0, n1) of N points: a job struct's first two fields */
static void split_jobs(void *jobs, const void *base, size_t size, int nt, int64_t N) {
  for (int i = 0; i < nt; i++) {
    int64_t *j = (int64_t *)((char *)jobs + i * size);
    memcpy(j, base, size);
    j[0] = N * i / nt; j[1] = N * (i + 1) / nt;
  }
}
/* fn on nt jobs (an array of nt job structs of ``size`` bytes): job 0 on this thread, the others
   on new ones, all joined before returning; a job whose thread could not be created (no memory
   for its stack, a process limit) runs on this thread afterwards: the same jobs, the same result */
static void run_jobs(void *(*fn)(void *), void *jobs, size_t size, int nt) {
  pthread_t th[MAXT];
  int started[MAXT] = {0};
  for (int i = 1; i < nt; i++) started[i] = pthread_create(&th[i], NULL, fn, (char *)jobs + i * size) == 0;
  fn(jobs);
  for (int i = 1; i < nt; i++) if (!started[i]) fn((char *)jobs + i * size);
  for (int i = 1; i < nt; i++) if (started[i]) pthread_join(th[i], NULL);
}
"""
"""The worker-thread helpers both native sources start with (job structs begin with the int64
point range n0, n1)."""

_SOURCE = THREADS_C + r"""
#include <math.h>

#ifndef SCALAR
#define SCALAR float
#endif
typedef SCALAR real;
#ifdef CH
#define NC CH
#else
#define NC (a->C)
#endif
#define MAXC 256

typedef struct {
  int64_t n0, n1;          /* this worker's points */
  int T, C, L;
  const int32_t *res;      /* (L, 3): rx, ry, rz */
  const int64_t *off;      /* (L, 3): plane offsets of the kinds */
  const real *points, *mats, *planes;
  real *out;               /* forward: (N, L*T*C) */
  const real *grad;        /* backward: (N, L*T*C) */
  real *gplanes;           /* backward: this worker's plane-gradient buffer (zeroed here) or NULL */
  int64_t numel;           /* backward: the plane buffer's elements */
  real *gpoints;           /* backward: (N, 3) or NULL */
  double *gmats;           /* backward: this worker's (T, 9) partial sums or NULL */
  int need_q;              /* backward: coordinate gradients wanted */
  real *dq;                /* backward: (N, 3) scratch when need_q */
} job_t;

static const int AX[3][2] = {{0, 1}, {0, 2}, {1, 2}};

/* the corner offsets (in texels*C) and weights of one bilinear sample, grid_sample's
   align_corners=True, padding_mode='border' (coordinate gradient 0 on or past the border) */
typedef struct { int64_t o00, o01, o10, o11; real fx, fy, gmx, gmy; } tap_t;

static inline real unnorm_clip(real u, int size, real *gm) {
  real sf = (real)(size - 1) / 2;
  real x = (u + 1) * sf;
  real mx = (real)(size - 1);
  if (!(x > 0)) { *gm = 0; return 0; }
  if (x >= mx) { *gm = 0; return mx; }
  *gm = sf;
  return x;
}

static inline void tap(real u, real v, int W, int H, int C, tap_t *t) {
  real x = unnorm_clip(u, W, &t->gmx), y = unnorm_clip(v, H, &t->gmy);
  real xf = floor(x), yf = floor(y);
  int x0 = (int)xf, y0 = (int)yf;
  int x1 = x0 + 1 < W ? x0 + 1 : x0, y1 = y0 + 1 < H ? y0 + 1 : y0; /* weight 0 there */
  t->fx = x - xf; t->fy = y - yf;
  t->o00 = ((int64_t)y0 * W + x0) * C; t->o01 = ((int64_t)y0 * W + x1) * C;
  t->o10 = ((int64_t)y1 * W + x0) * C; t->o11 = ((int64_t)y1 * W + x1) * C;
}


/* loops: frame t, then scale l, then this worker's points, so that the 3 planes of one (t, l) and
   their gradient (the working set) stay in the core's cache while the points stream through */
static void *fwd_worker(void *p) {
  job_t *a = (job_t *)p;
  const int T = a->T, L = a->L, C = NC;
  real s[3][MAXC];
  for (int t = 0; t < T; t++) {
    const real *m = a->mats + 9 * t;
    for (int l = 0; l < L; l++) {
      const int32_t *r = a->res + 3 * l;
      for (int64_t n = a->n0; n < a->n1; n++) {
        const real *pt = a->points + 3 * n;
        real q[3];
        for (int i = 0; i < 3; i++) q[i] = m[3 * i] * pt[0] + m[3 * i + 1] * pt[1] + m[3 * i + 2] * pt[2];
        for (int k = 0; k < 3; k++) {
          int W = r[AX[k][0]], H = r[AX[k][1]];
          tap_t tp; tap(q[AX[k][0]], q[AX[k][1]], W, H, C, &tp);
          const real *P = a->planes + a->off[3 * l + k] + (int64_t)t * H * W * C;
          real e = 1 - tp.fx, w = tp.fx, sn = 1 - tp.fy, nn = tp.fy;
          real nw = sn * e, ne = sn * w, sw = nn * e, se = nn * w;
          const real *a00 = P + tp.o00, *a01 = P + tp.o01, *a10 = P + tp.o10, *a11 = P + tp.o11;
          for (int c = 0; c < C; c++) s[k][c] = a00[c] * nw + a01[c] * ne + a10[c] * sw + a11[c] * se;
        }
        real *o = a->out + ((n * L + l) * T + t) * C;
        for (int c = 0; c < C; c++) o[c] = s[0][c] * s[1][c] * s[2][c];
      }
    }
  }
  return NULL;
}

/* The backward's channel loops, VW channels at a time where C allows, the rest one by one (GCC /
   Clang vector extensions; memcpy loads and stores, no alignment assumed). Written as plain
   loops, gcc -O3 kept them scalar (it held gs in scalar registers): docs/kernels.md. */
#define VBYTES 32
#define VW ((int)(VBYTES / sizeof(real)))
typedef real vreal __attribute__((vector_size(VBYTES)));
static inline vreal vld(const real *p) { vreal v; memcpy(&v, p, sizeof v); return v; }
static inline void vst(real *p, vreal v) { memcpy(p, &v, sizeof v); }
/* the plane gradient of one bilinear tap: b.. += w.. * gs (the corners may coincide on a border,
   where the coinciding corner's weight is 0: each store lands before the next load) */
static inline void scatter4(real *b00, real *b01, real *b10, real *b11, real nw, real ne, real sw, real se,
                            const real *gs, int C) {
  int c = 0;
  for (; c + VW <= C; c += VW) {
    vreal g = vld(gs + c);
    vst(b00 + c, vld(b00 + c) + nw * g);
    vst(b01 + c, vld(b01 + c) + ne * g);
    vst(b10 + c, vld(b10 + c) + sw * g);
    vst(b11 + c, vld(b11 + c) + se * g);
  }
  for (; c < C; c++) {
    b00[c] += nw * gs[c]; b01[c] += ne * gs[c]; b10[c] += sw * gs[c]; b11[c] += se * gs[c];
  }
}

static inline void mul3(real *out, const real *x, const real *y, const real *z, int C) {
  int c = 0;
  for (; c + VW <= C; c += VW) vst(out + c, (vld(x + c) * vld(y + c)) * vld(z + c));
  for (; c < C; c++) out[c] = (x[c] * y[c]) * z[c];
}
/* the coordinate gradient of one tap against gs: (sum over channels of d sample / dx * gs, .. / dy) */
static inline void tap_grad(const real *a00, const real *a01, const real *a10, const real *a11, real sn, real nn,
                            real e, real w, const real *gs, int C, real *gx, real *gy) {
  vreal vx = {0}, vy = {0};
  int c = 0;
  for (; c + VW <= C; c += VW) {
    vreal p00 = vld(a00 + c), p01 = vld(a01 + c), p10 = vld(a10 + c), p11 = vld(a11 + c), g = vld(gs + c);
    vx += ((p01 - p00) * sn + (p11 - p10) * nn) * g;
    vy += ((p10 - p00) * e + (p11 - p01) * w) * g;
  }
  real sx = 0, sy = 0;
  for (int i = 0; i < VW; i++) { sx += vx[i]; sy += vy[i]; }
  for (; c < C; c++) {
    sx += ((a01[c] - a00[c]) * sn + (a11[c] - a10[c]) * nn) * gs[c];
    sy += ((a10[c] - a00[c]) * e + (a11[c] - a01[c]) * w) * gs[c];
  }
  *gx = sx; *gy = sy;
}

static void *bwd_worker(void *p) {
  job_t *a = (job_t *)p;
  if (a->gplanes) memset(a->gplanes, 0, sizeof(real) * a->numel);  /* each worker its own, in parallel */
  const int T = a->T, L = a->L, C = NC;
  real s[3][MAXC], gs[MAXC];
  real *dq = a->dq;  /* (N, 3) scratch: coordinate gradient of frame t summed over scales */
  for (int t = 0; t < T; t++) {
    const real *m = a->mats + 9 * t;
    for (int l = 0; l < L; l++) {
      const int32_t *r = a->res + 3 * l;
      for (int64_t n = a->n0; n < a->n1; n++) {
        const real *pt = a->points + 3 * n;
        real q[3], d[3] = {0, 0, 0};
        for (int i = 0; i < 3; i++) q[i] = m[3 * i] * pt[0] + m[3 * i + 1] * pt[1] + m[3 * i + 2] * pt[2];
        tap_t tp[3];
        const real *P[3];
        for (int k = 0; k < 3; k++) {
          int W = r[AX[k][0]], H = r[AX[k][1]];
          tap(q[AX[k][0]], q[AX[k][1]], W, H, C, &tp[k]);
          P[k] = a->planes + a->off[3 * l + k] + (int64_t)t * H * W * C;
          real e = 1 - tp[k].fx, w = tp[k].fx, sn = 1 - tp[k].fy, nn = tp[k].fy;
          real nw = sn * e, ne = sn * w, sw = nn * e, se = nn * w;
          const real *a00 = P[k] + tp[k].o00, *a01 = P[k] + tp[k].o01, *a10 = P[k] + tp[k].o10, *a11 = P[k] + tp[k].o11;
          for (int c = 0; c < C; c++) s[k][c] = a00[c] * nw + a01[c] * ne + a10[c] * sw + a11[c] * se;
        }
        const real *g = a->grad + ((n * L + l) * T + t) * C;
        for (int k = 0; k < 3; k++) {
          const real *o1 = s[k == 0 ? 1 : 0], *o2 = s[k == 2 ? 1 : 2];
          mul3(gs, o1, o2, g, C);
          real e = 1 - tp[k].fx, w = tp[k].fx, sn = 1 - tp[k].fy, nn = tp[k].fy;
          if (a->gplanes) {
            real nw = sn * e, ne = sn * w, sw = nn * e, se = nn * w;
            real *G = a->gplanes + a->off[3 * l + k] + (int64_t)t * r[AX[k][0]] * r[AX[k][1]] * C;
            real *b00 = G + tp[k].o00, *b01 = G + tp[k].o01, *b10 = G + tp[k].o10, *b11 = G + tp[k].o11;
            scatter4(b00, b01, b10, b11, nw, ne, sw, se, gs, C);
          }
          if (a->need_q && (tp[k].gmx != 0 || tp[k].gmy != 0)) {
            const real *a00 = P[k] + tp[k].o00, *a01 = P[k] + tp[k].o01, *a10 = P[k] + tp[k].o10, *a11 = P[k] + tp[k].o11;
            real gx, gy;
            tap_grad(a00, a01, a10, a11, sn, nn, e, w, gs, C, &gx, &gy);
            d[AX[k][0]] += gx * tp[k].gmx;
            d[AX[k][1]] += gy * tp[k].gmy;
          }
        }
        if (a->need_q) {
          real *dn = dq + 3 * n;
          if (l == 0) { dn[0] = d[0]; dn[1] = d[1]; dn[2] = d[2]; }
          else { dn[0] += d[0]; dn[1] += d[1]; dn[2] += d[2]; }
        }
      }
    }
    if (!a->need_q) continue;
    /* contract frame t's coordinate gradient: dL/dp += M_t^T dq, dL/dM_t += dq p^T */
    double gm[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t n = a->n0; n < a->n1; n++) {
      const real *pt = a->points + 3 * n, *dn = dq + 3 * n;
      if (a->gpoints) {
        real *gp = a->gpoints + 3 * n;
        for (int j = 0; j < 3; j++) {
          real v = m[j] * dn[0] + m[3 + j] * dn[1] + m[6 + j] * dn[2];
          gp[j] = t == 0 ? v : gp[j] + v;
        }
      }
      for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) gm[3 * i + j] += (double)dn[i] * (double)pt[j];
    }
    if (a->gmats) for (int i = 0; i < 9; i++) a->gmats[9 * t + i] = gm[i];
  }
  return NULL;
}

typedef struct { real *dst; real *const *src; int nsrc; int64_t i0, i1; } red_t;
static void *red_worker(void *p) {
  red_t *a = (red_t *)p;
  for (int s = 0; s < a->nsrc; s++) {
    const real *x = a->src[s];
    for (int64_t i = a->i0; i < a->i1; i++) a->dst[i] += x[i];
  }
  return NULL;
}

static void run(void *(*fn)(void *), job_t *base, int64_t N, int nthreads, real **gbufs, double *gmats) {
  job_t jobs[MAXT];
  nthreads = clamp_threads(nthreads);
  split_jobs(jobs, base, sizeof jobs[0], nthreads, N);
  for (int i = 0; i < nthreads; i++) {
    if (gbufs) jobs[i].gplanes = gbufs[i];
    if (gmats) jobs[i].gmats = gmats + (int64_t)i * base->T * 9;
  }
  run_jobs(fn, jobs, sizeof jobs[0], nthreads);
}

void tk_forward(int64_t N, int T, int C, int L, const int32_t *res, const int64_t *off,
                const real *points, const real *mats, const real *planes, real *out, int nthreads) {
  job_t b; memset(&b, 0, sizeof b);
  b.T = T; b.C = C; b.L = L; b.res = res; b.off = off; b.points = points; b.mats = mats; b.planes = planes; b.out = out;
  run(fwd_worker, &b, N, nthreads, NULL, NULL);
}

/* gplanes: nthreads buffers of numel (each zeroed by its worker), summed into the first;
   gmats: (nthreads, T, 9) doubles zeroed by the caller */
void tk_backward(int64_t N, int T, int C, int L, const int32_t *res, const int64_t *off,
                 const real *points, const real *mats, const real *planes, const real *grad,
                 real **gplanes, int64_t numel, real *gpoints, double *gmats, real *dq, int need_q, int nthreads) {
  job_t b; memset(&b, 0, sizeof b);
  b.T = T; b.C = C; b.L = L; b.res = res; b.off = off; b.points = points; b.mats = mats; b.planes = planes;
  b.grad = grad; b.gpoints = gpoints; b.need_q = need_q; b.dq = dq; b.numel = numel;
  nthreads = clamp_threads(nthreads);
  run(bwd_worker, &b, N, nthreads, gplanes, gmats);
  if (gplanes && nthreads > 1) {
    red_t r[MAXT];
    for (int i = 0; i < nthreads; i++) {
      r[i].dst = gplanes[0]; r[i].src = gplanes + 1; r[i].nsrc = nthreads - 1;
      r[i].i0 = numel * i / nthreads; r[i].i1 = numel * (i + 1) / nthreads;
    }
    run_jobs(red_worker, r, sizeof r[0], nthreads);
  }
}

/* plane TV of the runs (nruns x {offset, planes, H, W, C}) of x: norm x the sum over runs of the
   mean squared neighbour difference along H and along W (sums in double); with g, its gradient
   (zeroed here first) in the same pass */
double tk_plane_tv(int nruns, const int64_t *runs, const real *x, real *g, double norm) {
  double total = 0;
  for (int r = 0; r < nruns; r++) {
    const int64_t off = runs[5 * r], n = runs[5 * r + 1], h = runs[5 * r + 2], w = runs[5 * r + 3],
                  c = runs[5 * r + 4], wc = w * c;
    const double ah = norm / ((double)(h - 1) * wc), aw = norm / ((double)h * (w - 1) * c);
    const real gh = (real)(2 * ah), gw = (real)(2 * aw);
    double sh = 0, sw = 0;
    if (g) memset(g + off, 0, sizeof(real) * n * h * wc);
    for (int64_t p = 0; p < n; p++)
      for (int64_t i = 0; i < h; i++) {
        const real *row = x + off + (p * h + i) * wc;
        real *grow = g ? g + off + (p * h + i) * wc : NULL;
        if (i + 1 < h) {
          for (int64_t k = 0; k < wc; k++) {
            real d = row[wc + k] - row[k];
            sh += (double)d * d;
            if (grow) { grow[wc + k] += gh * d; grow[k] -= gh * d; }
          }
        }
        for (int64_t k = 0; k + c < wc; k++) {
          real d = row[c + k] - row[k];
          sw += (double)d * d;
          if (grow) { grow[c + k] += gw * d; grow[k] -= gw * d; }
        }
      }
    total += ah * sh + aw * sw;
  }
  return total;
}
"""

_libs: dict = {}
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fasttomo" / "cpu_kernels"


_CPU_KEYS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
"""The lines of /proc/cpuinfo that name a CPU model and its instruction sets: x86's model name and
flags, ARM's Features and part numbers (an SVE build must not load on a CPU without SVE)."""


def _cpu_tag(cpuinfo: str = "/proc/cpuinfo") -> str:
    """-march=native: a library is only valid on the CPU model it was built for (the first line of
    each of :data:`_CPU_KEYS`, in that order)."""
    first: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in _CPU_KEYS:
                    first.setdefault(key, line)
    except OSError:
        pass
    return platform.machine() + "".join(first[k] for k in _CPU_KEYS if k in first)


def compile_source(stem: str, source: str, defs: list[str]) -> Path:
    """The shared library of C ``source`` built with ``defs`` (``-D`` flags) for this CPU: from the
    cache when there, else compiled and put there atomically (``RuntimeError`` without a working
    compiler)."""
    key = hashlib.sha256("\0".join([source, *_CFLAGS, *defs, _cpu_tag()]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        c_file, so_tmp = Path(tmp) / "k.c", Path(tmp) / "k.so"
        c_file.write_text(source)
        proc = subprocess.run([cc, *_CFLAGS, *defs, "-o", str(so_tmp), str(c_file), "-lpthread", "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(so_tmp, out)  # atomic: a concurrent process sees the whole library or none
    return out


def _compile(dtype: torch.dtype, channels: int) -> Path:
    scalar = "double" if dtype == torch.float64 else "float"
    return compile_source(f"tilted_kplanes_{scalar}_c{channels}", _SOURCE, [f"-DSCALAR={scalar}", f"-DCH={channels}"])


def library(dtype: torch.dtype, channels: int):
    """The compiled kernels for (dtype, channels), or None where they cannot be built (logged once)."""
    k = (dtype, channels)
    if k not in _libs:
        lib = None
        if dtype in (torch.float32, torch.float64) and channels <= MAX_CHANNELS:
            try:
                lib = ctypes.CDLL(str(_compile(dtype, channels)))
                lib.tk_forward.argtypes = [_I64, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I]
                lib.tk_forward.restype = None
                lib.tk_backward.argtypes = [_I64, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _P,
                                            _I, _I]
                lib.tk_backward.restype = None
                lib.tk_plane_tv.argtypes = [_I, _P, _P, _P, ctypes.c_double]
                lib.tk_plane_tv.restype = ctypes.c_double
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.info("tilted_kplanes: native CPU kernels unavailable (%s); using the aten path", e)
                lib = None
        _libs[k] = lib
    return _libs[k]


def _meta(layout: PlaneLayout):
    res = torch.tensor(layout.flat_resolutions, dtype=torch.int32)
    off = torch.tensor([o for row in layout.offsets for o in row], dtype=torch.int64)
    return res, off


def forward(lib, points, matrices, plane_data, layout: PlaneLayout) -> torch.Tensor:
    """(N, L*T*C) features; inputs contiguous, one dtype (the caller checks)."""
    res, off = _meta(layout)
    n = points.shape[0]
    out = points.new_empty((n, layout.n_features))
    lib.tk_forward(n, layout.n_rot, layout.channels, layout.n_scales, res.data_ptr(), off.data_ptr(),
                   points.data_ptr(), matrices.data_ptr(), plane_data.data_ptr(), out.data_ptr(),
                   torch.get_num_threads())
    return out


PRIVATE_GRAD_BYTES = 2 << 30
"""The backward's worker threads each scatter into a plane-gradient buffer of their own (the first
is the gradient it returns): the others together stay under this many bytes, so that a host of
many cores does not hold a copy of large planes per core; past it the backward runs on fewer
threads."""


def backward_threads(plane_bytes: int) -> int:
    """The worker threads of the backward for planes of ``plane_bytes``: torch's thread count (at
    most 64), fewer where their extra gradient buffers would pass :data:`PRIVATE_GRAD_BYTES`."""
    return max(1, min(torch.get_num_threads(), 64, 1 + PRIVATE_GRAD_BYTES // max(1, plane_bytes)))


def backward(lib, points, matrices, plane_data, layout: PlaneLayout, grad, need_p: bool, need_m: bool,
             need_x: bool):
    """(dL/dpoints, dL/dmatrices, dL/dplane_data), None where not needed."""
    res, off = _meta(layout)
    n = points.shape[0]
    nt = backward_threads(plane_data.numel() * plane_data.element_size() if need_x else 0)
    grad = grad.to(points.dtype).contiguous()
    gbuf = plane_data.new_empty((nt, plane_data.numel())) if need_x else None  # zeroed by the C workers
    ptrs = (ctypes.c_void_p * nt)(*[gbuf[i].data_ptr() for i in range(nt)]) if need_x else None
    need_q = bool(need_p or need_m)
    gp = points.new_empty(points.shape) if need_p else None
    dq = points.new_empty(points.shape) if need_q else None
    gm = torch.zeros((nt, layout.n_rot, 9), dtype=torch.float64) if need_q else None
    lib.tk_backward(n, layout.n_rot, layout.channels, layout.n_scales, res.data_ptr(), off.data_ptr(),
                    points.data_ptr(), matrices.data_ptr(), plane_data.data_ptr(), grad.data_ptr(), ptrs,
                    plane_data.numel(), gp.data_ptr() if need_p else None,
                    gm.data_ptr() if need_q else None, dq.data_ptr() if need_q else None, int(need_q), nt)
    gmat = gm.sum(0).view(layout.n_rot, 3, 3).to(matrices.dtype) if need_m else None
    return gp, gmat, (gbuf[0] if need_x else None)


def plane_tv(lib, plane_data, layout: PlaneLayout, with_grad: bool):
    """(plane TV as a 0-d tensor of plane_data's dtype, its gradient or None) of a contiguous buffer,
    in one pass over it: the twin's ``plane_tv`` (sums in float64)."""
    runs = [(layout.offsets[l][k0], (k1 - k0) * layout.n_rot, h, w, layout.channels)
            for l in range(layout.n_scales) for k0, k1, h, w in layout.kind_runs(l)]
    meta = torch.tensor(runs, dtype=torch.int64)
    g = torch.empty_like(plane_data) if with_grad else None
    value = lib.tk_plane_tv(len(runs), meta.data_ptr(), plane_data.data_ptr(), g.data_ptr() if with_grad else None,
                            1.0 / (3 * layout.n_scales * layout.n_rot))
    return torch.tensor(value, dtype=plane_data.dtype), g
