"""Atom tracing on a volume: candidate peaks, batched sub-voxel Gaussian fits, rejection of
non-atoms, duplicate merging and species classes (the steps of the published AET pipelines,
e.g. Yang et al., Nature 542, 75 (2017), here batched in torch so the GPU does them at once).

1. Peaks. The volume is smoothed with a Gaussian of ``smooth`` voxels (a mild matched filter that
   keeps noise from making maxima; 0 turns it off); every voxel that is the maximum of its 3^3
   neighbourhood (max pooling) and above the threshold is a candidate. The threshold is
   ``threshold`` times the smoothed volume's maximum, or ``threshold_abs`` in the volume's units.
   A screen then drops, before anything is fitted, the candidates whose smoothed peak is below
   ``screen`` x ``min_snr`` times an upper bound of the smoothed noise (:func:`prefit_noise_level`:
   the robust spread of the voxels or of neighbour differences): on a noisy volume a low threshold
   admits tens of noise maxima per atom, whose fits took most of the time (256^3, 10 % noise:
   344k candidates for 10k atoms).
2. Fit. Each candidate's (2 r + 1)^3 neighbourhood (r = ``fit_radius``) of the unsmoothed volume is
   fitted by one isotropic Gaussian plus a constant (Levenberg-Marquardt, all atoms in one batch,
   started from a log-parabola through the peak and its neighbours).
3. Rejection. A candidate is not an atom when its smoothed peak is below ``min_snr`` times the
   noise of the smoothed volume (the noise level is 1.4826 x the median absolute deviation of the
   volume minus the fitted candidates, scaled by the smoothing kernel; estimated twice, the second
   time from the candidates that pass the first test, so that fits of noise maxima do not
   lower it), when its fit failed (non-finite, amplitude <= 0, sigma
   outside ``sigma_range`` voxels, its centre moved more than 1.5 voxels from the voxel its
   neighbourhood was taken around), when its relative fit error
   (RMS residual / amplitude) is above ``max_fit_error``, or when its integrated intensity is below
   ``min_intensity`` times the 90th percentile of the candidates' intensities.
4. Duplicates. Atoms closer than ``min_separation_A`` are merged, the stronger one kept (greedy,
   in order of intensity).
5. Neighbours. ``refine_rounds`` times, every atom's fitted neighbours are rendered and subtracted
   from its neighbourhood and it is fitted again (a joint fit of overlapping atoms, done as block
   coordinate descent), then steps 3 and 4 again.
   Then, ``residual_rounds`` times, the fitted atoms are subtracted from the volume and the peak
   search runs on what is left (an atom on the shoulder of a stronger neighbour makes no maximum
   of its own); new candidates farther than ``min_separation_A`` from every atom join, and step 5
   runs again.
6. Final fit. Every atom is fitted once more with its width held at the median width of all
   atoms, so its amplitude (and integrated intensity) is a linear, low-noise measure of its weight;
   then steps 3 (with the intensity test) and 4 again.
7. Species. With ``classes`` >= 2, k-means on the integrated intensities (deterministic: started
   at the quantiles), species numbered 1 (weakest) .. classes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from fasttomo.data.gauss import TWO_PI_32, fit_gaussians, gaussian_values, log_parabola_offset, patch_index, render
from fasttomo.trace.neighbors import greedy_suppress, pairs_within

log = logging.getLogger("fasttomo")


class TraceError(ValueError):
    """The volume or the settings cannot be traced as given; the message names the fix."""


@dataclasses.dataclass
class TraceParams:
    """The numerical settings of :func:`trace_volume` (see the module doc for each step)."""

    min_separation_A: float = 2.0
    threshold: float = 0.1
    threshold_abs: float | None = None
    smooth: float = 0.5
    fit_radius: int = 2
    fit_iterations: int = 15
    refine_rounds: int = 3
    residual_rounds: int = 1
    sigma_range: tuple = (0.3, 4.0)
    max_fit_error: float = 0.75
    min_intensity: float = 0.15
    min_snr: float = 4.5
    screen: float = 0.75
    classes: int = 1
    max_candidates: int = 2_000_000


@dataclasses.dataclass
class TraceResult:
    """Traced atoms, in voxel coordinates (z, y, x) of the volume (voxel (k, i, j) centred at
    (k, i, j)), plus the voxel size to turn them into Angstrom."""

    zyx: np.ndarray
    amplitude: np.ndarray
    sigma: np.ndarray
    background: np.ndarray
    intensity: np.ndarray
    fit_error: np.ndarray
    species: np.ndarray
    voxel_size_A: float
    stats: dict

    @property
    def n(self) -> int:
        return int(self.zyx.shape[0])

    @property
    def xyz_A(self) -> np.ndarray:
        """(N, 3) x, y, z in Angstrom: x along X (columns), y along Y (rows), z along Z
        (sections), origin at the centre of the first voxel."""
        return self.zyx[:, ::-1] * self.voxel_size_A


def gaussian_smooth(vol: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur (sigma in voxels, edges replicated) of a (Z, Y, X) volume."""
    if sigma <= 0:
        return vol
    r = max(1, int(math.ceil(3.0 * sigma)))
    x = torch.arange(-r, r + 1, dtype=vol.dtype, device=vol.device)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    k = k / k.sum()
    out = vol[None, None]
    for axis in range(3):
        shape = [1, 1, 1, 1, 1]
        shape[2 + axis] = 2 * r + 1
        pad = [0, 0, 0, 0, 0, 0]
        pad[2 * (2 - axis)] = pad[2 * (2 - axis) + 1] = r
        out = F.conv3d(F.pad(out, pad, mode="replicate"), k.view(shape))
    return out[0, 0]


def smooth_noise_factor(sigma: float, dtype=torch.float32) -> float:
    """Standard deviation of white noise of unit std after :func:`gaussian_smooth` (sigma voxels)."""
    if sigma <= 0:
        return 1.0
    r = max(1, int(math.ceil(3.0 * sigma)))
    x = torch.arange(-r, r + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    k = k / k.sum()
    return float((k * k).sum() ** 1.5)


def prefit_noise_level(vol: torch.Tensor, max_samples: int = 4_000_000) -> float:
    """An upper bound of the volume's white-noise level before anything is fitted: the smaller of
    the robust spread (1.4826 x median absolute deviation) of the voxels and of the differences of
    neighbouring voxels along X divided by sqrt(2). Structure (atoms, a reconstruction's
    background) only widens either; noise correlated between neighbours (a reconstruction's)
    narrows the second, which errs toward keeping candidates. A clean volume gives about 0."""
    flat = vol.reshape(-1)
    step = max(1, flat.numel() // max_samples)
    v = flat[::step]
    d = (vol[..., 1:] - vol[..., :-1]).reshape(-1)
    d = d[:: max(1, d.numel() // max_samples)]
    mad = lambda t: float(1.4826 * (t - t.median()).abs().median())  # noqa: E731
    return min(mad(v), mad(d) / math.sqrt(2.0))


def find_peaks(vol: torch.Tensor, threshold: float) -> torch.Tensor:
    """(N, 3) long (z, y, x) of the voxels that are the maximum of their 3^3 neighbourhood and
    above ``threshold``."""
    pooled = F.max_pool3d(vol[None, None], kernel_size=3, stride=1, padding=1)[0, 0]
    return torch.nonzero((vol >= pooled) & (vol > threshold))


def initial_params(vol: torch.Tensor, peaks: torch.Tensor, sigma_range) -> torch.Tensor:
    """(N, 6) fit start (cz, cy, cx, amplitude, sigma, background) from the peak voxel and its six
    neighbours: log-parabola centre and curvature, amplitude above the neighbourhood minimum."""
    shape = vol.shape
    flat_vol = vol.reshape(-1)
    c0 = vol[peaks[:, 0], peaks[:, 1], peaks[:, 2]]
    offs, curv = [], []
    for ax in range(3):
        lo, hi = peaks.clone(), peaks.clone()
        lo[:, ax] = (lo[:, ax] - 1).clamp_min(0)
        hi[:, ax] = (hi[:, ax] + 1).clamp_max(shape[ax] - 1)
        cm = vol[lo[:, 0], lo[:, 1], lo[:, 2]]
        cp = vol[hi[:, 0], hi[:, 1], hi[:, 2]]
        offs.append(log_parabola_offset(cm, c0, cp))
        eps = 1e-12
        den = torch.log(cm.clamp_min(eps)) - 2 * torch.log(c0.clamp_min(eps)) + torch.log(cp.clamp_min(eps))
        curv.append(den)
    den = torch.stack(curv, -1)
    s2 = torch.where(den < -1e-6, -1.0 / den.clamp_max(-1e-6), torch.full_like(den, 1.0))
    sigma = s2.clamp(sigma_range[0] ** 2, sigma_range[1] ** 2).mean(-1).sqrt()
    flat, _, inside = patch_index(peaks.to(vol.dtype), 1, shape)
    patch = torch.where(inside, flat_vol[flat], c0[:, None])
    bg = torch.minimum(patch.min(-1).values, torch.zeros_like(c0))
    off = torch.stack(offs, -1)
    centre = peaks.to(vol.dtype) + off
    amp = (c0 - bg) * torch.exp(0.5 * (off * off).sum(-1) / sigma ** 2)  # the peak voxel is off the centre
    return torch.cat([centre, amp[:, None], sigma[:, None], bg[:, None]], dim=-1)


def _fit(vol_flat: torch.Tensor, shape, params: torch.Tensor, radius: int, iterations: int,
         others: torch.Tensor | None = None, sigma_bounds: tuple = (0.05, 1e3), fix_sigma: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fit every atom on its neighbourhood around its current centre; ``others`` (flat volume of
    the rendered fitted atoms) is subtracted, less the atom's own contribution. Returns (params,
    relative fit error, the rounded centre the neighbourhood was taken around)."""
    base = torch.round(params[:, :3])
    flat, coords, inside = patch_index(base, radius, shape)
    data = vol_flat[flat]
    if others is not None:
        own = gaussian_values(coords, params[:, :3], params[:, 3], params[:, 4])
        data = data - (others[flat] - own)
    w = inside.to(vol_flat.dtype)
    p, sse = fit_gaussians(data, coords, w, params, iterations=iterations, sigma_bounds=sigma_bounds,
                           fix_sigma=fix_sigma)
    n_in = w.sum(-1).clamp_min(1.0)
    err = torch.sqrt(sse / n_in) / p[:, 3].abs().clamp_min(1e-30)
    return p, err, base


def _valid(p: torch.Tensor, err: torch.Tensor, base: torch.Tensor, prm: TraceParams, shape) -> torch.Tensor:
    ok = torch.isfinite(p).all(-1) & torch.isfinite(err)
    ok &= p[:, 3] > 0
    ok &= (p[:, 4] >= prm.sigma_range[0]) & (p[:, 4] <= prm.sigma_range[1])
    ok &= ((p[:, :3] - base).abs() <= 1.5).all(-1)  # a centre that ran off its neighbourhood fits noise
    dims = torch.tensor(shape, dtype=p.dtype, device=p.device)
    ok &= ((p[:, :3] >= -0.5) & (p[:, :3] <= dims - 0.5)).all(-1)  # outside the volume: nothing to fit
    ok &= err <= prm.max_fit_error
    return ok


def intensity_of(p: torch.Tensor) -> torch.Tensor:
    """Integrated intensity amplitude (2 pi)^(3/2) sigma^3 of fitted atoms (N, 6)."""
    return p[:, 3] * TWO_PI_32 * p[:, 4] ** 3


def _reject_weak(inten: torch.Tensor, prm: TraceParams) -> torch.Tensor:
    if inten.numel() == 0 or prm.min_intensity <= 0:
        return torch.ones_like(inten, dtype=torch.bool)
    ref = torch.quantile(inten.double(), 0.9).to(inten.dtype)
    return inten >= prm.min_intensity * ref


def kmeans_1d(x: torch.Tensor, k: int, iterations: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic k-means of values ``x`` (N,) into ``k`` classes, started at the quantiles
    (i + 0.5) / k. Returns (labels 0..k-1 in increasing order of centre, centres ascending)."""
    xd = x.double()
    q = torch.tensor([(i + 0.5) / k for i in range(k)], dtype=torch.float64, device=x.device)
    c = torch.quantile(xd, q)
    lab = torch.zeros_like(x, dtype=torch.long)
    for _ in range(iterations):
        lab_new = torch.argmin((xd[:, None] - c[None]).abs(), dim=1)
        sums = torch.zeros(k, dtype=torch.float64, device=x.device).index_add_(0, lab_new, xd)
        cnt = torch.zeros(k, dtype=torch.float64, device=x.device).index_add_(0, lab_new, torch.ones_like(xd))
        c = torch.where(cnt > 0, sums / cnt.clamp_min(1), c)
        if torch.equal(lab_new, lab):
            break
        lab = lab_new
    order = torch.argsort(c)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(k, device=x.device)
    return rank[lab], c[order]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def trace_volume(volume, voxel_size_A: float, prm: TraceParams | None = None,
                 device: str | torch.device = "cpu") -> TraceResult:
    """Trace the atoms of ``volume`` (Z, Y, X), voxel size in Angstrom (see the module doc)."""
    return _Tracer(volume, voxel_size_A, prm or TraceParams(), torch.device(device)).run()


class _Tracer:
    """One tracing of a volume: the checked volume, its smoothed copy and threshold, the counts of
    what each stage rejected, the seconds each stage took; :meth:`run` goes through the stages
    (candidates, first fit, noise level, refinement, residual rounds, final fit, classes)."""

    def __init__(self, volume, voxel_size_A: float, prm: TraceParams, dev: torch.device):
        self.prm, self.dev = prm, dev
        self.t_start = time.perf_counter()
        self.times: dict[str, float] = {}
        vol = torch.as_tensor(np.asarray(volume) if not isinstance(volume, torch.Tensor) else volume)
        if vol.ndim != 3:
            raise TraceError(f"the volume must be 3-D (Z, Y, X), got shape {tuple(vol.shape)}.")
        if min(vol.shape) < 3:
            raise TraceError(f"the volume (Z, Y, X) = {tuple(vol.shape)} is too small to trace (at least 3 voxels a "
                             "side).")
        vol = vol.to(device=dev, dtype=torch.float32).contiguous()
        if not bool(torch.isfinite(vol).all()):
            raise TraceError("the volume holds NaN or Inf voxels; fix or mask them (e.g. set them to 0) before "
                             "tracing.")
        if not (voxel_size_A > 0 and math.isfinite(voxel_size_A)):
            raise TraceError(f"the voxel size must be a positive number of Angstrom, got {voxel_size_A!r}.")
        self.vol, self.voxel_size_A = vol, voxel_size_A
        self.shape = tuple(vol.shape)
        self.vol_flat = vol.reshape(-1)
        self.min_sep_vox = prm.min_separation_A / voxel_size_A
        self.bounds = (0.5 * prm.sigma_range[0], 1.5 * prm.sigma_range[1])  # room to see a fit leave the range
        self.snr_factor = smooth_noise_factor(float(prm.smooth), vol.dtype)
        self.n = dict(screened=0, fit_failed=0, refit_failed=0, weak=0, merged=0, noise=0, residual=0)
        self.noise = self.sm_noise = 0.0

    def lap(self, name: str, t0: float) -> float:
        _sync(self.dev)
        t = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + (t - t0)
        return t

    def run(self) -> TraceResult:
        t0 = time.perf_counter()
        peaks = self._candidates()
        t0 = self.lap("peaks_s", t0)
        p, err, peaks_ok = self._first_fit(peaks)
        t0 = self.lap("fit_s", t0)
        peak_vals = self.sm[peaks_ok[:, 0], peaks_ok[:, 1], peaks_ok[:, 2]]
        self._noise_level_of(p, peak_vals)
        keep = self.significant(peak_vals)
        p, err = self.clean(p[keep], err[keep])
        t0 = self.lap("reject_merge_s", t0)
        p, err, t0 = self.refine(p, err, int(self.prm.refine_rounds), t0)
        p, err, t0 = self._residual_rounds(p, err, t0)
        p, err = self._final_fit(p, err)
        t0 = self.lap("final_fit_s", t0)
        inten = intensity_of(p)
        species, centres = self._classes(p, inten)
        self.lap("classify_s", t0)
        return self._result(p, err, inten, species, centres)

    def _candidates(self) -> torch.Tensor:
        """Maxima of the smoothed volume above the threshold, screened by a noise bound."""
        prm, vol = self.prm, self.vol
        self.sm = sm = gaussian_smooth(vol, float(prm.smooth))
        self.vmax = float(sm.max())
        self.thr = float(prm.threshold_abs) if prm.threshold_abs is not None else prm.threshold * self.vmax
        if prm.threshold_abs is None and not self.vmax > 0:
            raise TraceError("the volume has no positive voxels, so there is nothing to trace (atoms are bright); "
                             "invert the contrast first or give threshold_abs.")
        peaks = find_peaks(sm, self.thr)
        self.n_cand = int(peaks.shape[0])
        if self.n_cand > prm.max_candidates:
            raise TraceError(f"{self.n_cand} candidate peaks above the threshold {self.thr:.4g} (more than "
                             f"max_candidates={prm.max_candidates}); the volume is probably noise at this threshold: "
                             "raise threshold (a fraction of the smoothed maximum) or smooth.")
        if prm.min_snr > 0 and prm.screen > 0 and self.n_cand:
            # A screen before any fit: on a noisy volume a low threshold admits tens of noise maxima per
            # atom (10 % noise, threshold 0.1: 344k candidates for 10k atoms), and fitting them all
            # took 90 % of the time. The volume's own robust spread bounds its noise level from above
            # (atoms are a minority of the voxels); a candidate below `screen` x the final test's height
            # by that bound cannot pass the final test unless the true noise is below `screen` x it.
            sigma_pre = prefit_noise_level(vol)
            keep = sm[peaks[:, 0], peaks[:, 1], peaks[:, 2]] >= prm.screen * prm.min_snr * sigma_pre * self.snr_factor
            self.n["screened"] = int((~keep).sum())
            peaks = peaks[keep]
        return peaks

    def _first_fit(self, peaks: torch.Tensor):
        """A Gaussian fitted at every candidate (a second start for the failed ones); returns the
        valid fits, their errors and their peaks."""
        prm, vol_flat, shape = self.prm, self.vol_flat, self.shape
        p0 = initial_params(self.vol, peaks, prm.sigma_range)
        p, err, base = _fit(vol_flat, shape, p0, prm.fit_radius, prm.fit_iterations, sigma_bounds=self.bounds)
        ok = _valid(p, err, base, prm, shape)
        if bool(ok.any()) and not bool(ok.all()):
            # a second start for the failed ones: the typical width of the good fits, the peak's amplitude
            retry = p0[~ok].clone()
            s_med = p[ok, 4].median()
            retry[:, 3] = retry[:, 3] * torch.exp(-0.5 * ((retry[:, :3] - torch.round(retry[:, :3])) ** 2).sum(-1)
                                                  / retry[:, 4] ** 2)
            retry[:, 4] = s_med
            q, e, b = _fit(vol_flat, shape, retry, prm.fit_radius, prm.fit_iterations, sigma_bounds=self.bounds)
            idx = torch.nonzero(~ok).flatten()
            p[idx], err[idx], base[idx] = q, e, b
            ok = _valid(p, err, base, prm, shape)
        self.n["fit_failed"] = int((~ok).sum())
        return p[ok], err[ok], peaks[ok]

    def _noise_level_of(self, p: torch.Tensor, peak_vals: torch.Tensor) -> None:
        """The noise level (robust spread of what the fitted candidates leave unexplained) and,
        through the smoothing kernel, that of the smoothed volume: a candidate must stand min_snr
        of it tall. Twice: on a noisy volume a low threshold admits thousands of noise maxima whose
        fits absorb part of the noise (10 % noise, threshold 0.1: 7 % low), so the estimate is
        redone from the residual of the candidates that pass the first one."""
        prm = self.prm
        self.noise = self.noise_level(p)
        if prm.min_snr > 0 and p.shape[0]:
            first = peak_vals >= prm.min_snr * self.noise * self.snr_factor
            if bool(first.any()) and not bool(first.all()):
                self.noise = self.noise_level(p[first])
        self.sm_noise = self.noise * self.snr_factor

    def noise_level(self, p: torch.Tensor) -> float:
        if p.shape[0] == 0:
            return 0.0
        resid = self.vol_flat - self.model_of(p)
        sample = resid[:: max(1, resid.numel() // 4_000_000)]
        return float(1.4826 * (sample - sample.median()).abs().median())

    def model_of(self, p: torch.Tensor) -> torch.Tensor:
        prm = self.prm
        rr = max(prm.fit_radius, int(math.ceil(4.0 * float(p[:, 4].max()))))
        return render(self.shape, p[:, :3], p[:, 3], p[:, 4], radius=min(rr, prm.fit_radius + 6)).reshape(-1)

    def significant(self, peak_vals: torch.Tensor) -> torch.Tensor:
        keep = peak_vals >= self.prm.min_snr * self.sm_noise
        self.n["noise"] += int((~keep).sum())
        return keep

    def clean(self, p: torch.Tensor, err: torch.Tensor, weak: bool = False):
        """The weak test (final stage only: the intensity of a free-width fit is too noisy to
        judge by) and duplicate merging."""
        if weak:
            strong = _reject_weak(intensity_of(p), self.prm)
            self.n["weak"] += int((~strong).sum())
            p, err = p[strong], err[strong]
        keep = greedy_suppress(p[:, :3], p[:, 3], self.min_sep_vox)
        self.n["merged"] += int((~keep).sum())
        return p[keep], err[keep]

    def refine(self, p: torch.Tensor, err: torch.Tensor, rounds: int, t0: float):
        """Refits of every atom against the model of all the others, then cleaning; ``rounds`` times."""
        prm = self.prm
        for _ in range(rounds):
            if p.shape[0] == 0:
                break
            p_new, err_new, base = _fit(self.vol_flat, self.shape, p, prm.fit_radius, max(4, prm.fit_iterations // 2),
                                        self.model_of(p), sigma_bounds=self.bounds)
            ok = _valid(p_new, err_new, base, prm, self.shape)
            self.n["refit_failed"] += int((~ok).sum())
            p, err = p_new[ok], err_new[ok]
            t0 = self.lap("refine_s", t0)
            p, err = self.clean(p, err)
            t0 = self.lap("reject_merge_s", t0)
        return p, err, t0

    def _residual_rounds(self, p: torch.Tensor, err: torch.Tensor, t0: float):
        """Atoms hidden on the shoulder of a stronger neighbour make no maximum of their own: look
        for maxima of what the fitted atoms leave unexplained, farther than min_separation from
        every atom, and refine with them."""
        prm, shape, dev = self.prm, self.shape, self.dev
        for _ in range(int(prm.residual_rounds)):
            if p.shape[0] == 0:
                break
            resid = (self.vol_flat - self.model_of(p)).view(shape)
            sm_resid = gaussian_smooth(resid, float(prm.smooth))
            cand = find_peaks(sm_resid, self.thr)
            cand = cand[self.significant(sm_resid[cand[:, 0], cand[:, 1], cand[:, 2]])]
            if cand.shape[0]:
                near, _, _ = pairs_within(cand.to(p.dtype), p[:, :3], self.min_sep_vox)
                far = torch.ones(cand.shape[0], dtype=torch.bool, device=dev)
                far[near] = False
                cand = cand[far]
            t0 = self.lap("residual_s", t0)
            if cand.shape[0] == 0:
                break
            self.n["residual"] += int(cand.shape[0])
            p = torch.cat([p, initial_params(resid, cand, prm.sigma_range)])
            err = torch.cat([err, torch.zeros(cand.shape[0], dtype=err.dtype, device=dev)])
            p, err, t0 = self.refine(p, err, max(1, int(prm.refine_rounds)), t0)
        return p, err, t0

    def _final_fit(self, p: torch.Tensor, err: torch.Tensor):
        """Final fit with every atom's width held at the median width: the amplitude is then a
        linear, low-noise measure of the atom's weight (a free width makes A sigma^3 noisy), and
        the noise level of the volume (the robust spread of what the atoms leave unexplained)
        rejects atoms whose amplitude it could explain."""
        prm = self.prm
        if p.shape[0]:
            s_med = p[:, 4].median()
            p[:, 4] = s_med
            p, err, base = _fit(self.vol_flat, self.shape, p, prm.fit_radius, max(4, prm.fit_iterations // 2),
                                self.model_of(p), sigma_bounds=self.bounds, fix_sigma=True)
            ok = _valid(p, err, base, prm, self.shape)
            self.n["refit_failed"] += int((~ok).sum())
            p, err = p[ok], err[ok]
            if p.shape[0]:
                p, err = self.clean(p, err, weak=True)
        return p, err

    def _classes(self, p: torch.Tensor, inten: torch.Tensor):
        """(species 1..classes, class centres or None) by k-means on the intensities."""
        prm = self.prm
        if prm.classes < 2:
            return torch.ones(p.shape[0], dtype=torch.long, device=self.dev), None
        if p.shape[0] < prm.classes:
            raise TraceError(f"classes={prm.classes} species asked for but only {p.shape[0]} atoms were traced; lower "
                             "classes or check the threshold.")
        lab, centres = kmeans_1d(inten, prm.classes)
        return lab + 1, centres

    def _result(self, p, err, inten, species, centres) -> TraceResult:
        prm, n, shape = self.prm, self.n, self.shape
        stats = {
            "n_atoms": int(p.shape[0]), "n_candidates": self.n_cand, "threshold": self.thr,
            "threshold_source": "threshold_abs" if prm.threshold_abs is not None else f"{prm.threshold} x smoothed max",
            "smoothed_max": self.vmax, "rejected_fit": n["fit_failed"] + n["refit_failed"], "rejected_weak": n["weak"],
            "merged_duplicates": n["merged"], "residual_candidates": n["residual"], "rejected_noise": n["noise"],
            "screened_before_fit": n["screened"],
            "noise_level": self.noise, "min_separation_voxels": self.min_sep_vox, "device": str(self.dev),
            "seconds": time.perf_counter() - self.t_start, "seconds_by_step": self.times,
        }
        if centres is not None:
            stats["class_centres_intensity"] = centres.cpu().tolist()
            stats["class_counts"] = torch.bincount(species - 1, minlength=prm.classes).cpu().tolist()
        if p.shape[0]:
            stats["sigma_voxels_median"] = float(p[:, 4].median())
            stats["fit_error_median"] = float(err.median())
        order = torch.argsort(p[:, 0] * shape[1] * shape[2] + p[:, 1] * shape[2] + p[:, 2])  # a stable, readable order
        p, err, inten, species = p[order], err[order], inten[order], species[order]
        cpu = lambda t: t.detach().double().cpu().numpy()  # noqa: E731
        return TraceResult(zyx=cpu(p[:, :3]), amplitude=cpu(p[:, 3]), sigma=cpu(p[:, 4]), background=cpu(p[:, 5]),
                           intensity=cpu(inten), fit_error=cpu(err), species=species.cpu().numpy().astype(np.int64),
                           voxel_size_A=float(self.voxel_size_A), stats=stats)
