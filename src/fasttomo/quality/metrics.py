"""Quality metrics: volume against volume (Pearson, FSC, missing-wedge sector FSC, PSNR) and
measured projections against predicted ones (per-view correlation and residual, for data without
ground truth).

Conventions (README "Geometry conventions"): volumes are (Z, Y, X) arrays with isotropic voxels of
``voxel_size_A`` Angstrom; the tilt axis is Y; at tilt theta a point (x, y, z) projects to
u = x cos(theta) + z sin(theta), v = y.

Fourier shell correlation. Both volumes are Fourier transformed (real FFT, float32). A Fourier
voxel has the physical frequency k = (kx, ky, kz) in 1/A with k_i = m_i / (N_i * voxel_size_A),
so boxes of different sizes along the three axes are handled correctly: a shell holds the voxels
whose |k| lies within half a shell width of its centre, whatever their axis. The shell width is
``shell_width`` Fourier voxels of the LARGEST axis, 1 / (max(N) * voxel_size_A); shells run from
the first non-zero one up to Nyquist, 1 / (2 voxel_size_A) (the corners beyond Nyquist are left
out; the zero-frequency shell, the mean, is left out). Per shell

    FSC = sum Re(A B*) / sqrt(sum |A|^2 * sum |B|^2)

over the full (Hermitian) Fourier grid: the real FFT keeps half the grid, and every voxel whose
conjugate partner is not stored is counted twice, so sums and voxel counts equal those of the full
grid. For two independent noise volumes each shell's FSC is about normal with mean 0 and standard
deviation 1 / sqrt(n_voxels) (n_voxels as reported, full grid).

Thresholds: 0.143 is the usual criterion between two independent half-data reconstructions;
compared against a noise-free ground truth, the equivalent criterion is 0.5
(sqrt(2 * 0.143 / 1.143) = 0.5, Rosenthal & Henderson, J. Mol. Biol. 333, 2003). Both are
reported; a crossing is the first shell where the curve falls below the threshold, linearly
interpolated from the shell before it.

Missing wedge. A projection at tilt theta about Y measures the central Fourier plane spanned by ky
and the direction (cos theta, sin theta) in (kx, kz) (projection-slice theorem with
u = x cos(theta) + z sin(theta)). For a tilt range [tilt_min, tilt_max] a Fourier voxel is
"measured" when the angle of its (kx, kz) component, atan2(kz, kx) taken modulo 180 degrees, lies
in the range; "wedge" (missing) otherwise. Voxels on the ky axis (kx = kz = 0) lie in every
measured plane and count as measured.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Sequence

import numpy as np

FSC_THRESHOLDS = (0.5, 0.143)
"""The two FSC criteria reported everywhere (keys fsc05_*, fsc0143_*)."""


# --------------------------------------------------------------------------------------- real space
def pearson(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Pearson correlation of two arrays (optionally over ``mask`` only), in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"pearson: shapes differ, {a.shape} vs {b.shape}")
    if mask is not None:
        a, b = a[mask], b[mask]
    a = a.ravel() - a.mean()
    b = b.ravel() - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")


FOREGROUND_REL = 0.05
"""The specimen (foreground) of a truth: its voxels above this fraction of its maximum."""


def foreground_mask(truth: np.ndarray, rel_threshold: float = FOREGROUND_REL) -> np.ndarray:
    """Voxels where the ground truth exceeds ``rel_threshold`` of its maximum (the specimen)."""
    return truth > rel_threshold * float(np.max(truth))


def volume_metrics(recon: np.ndarray, truth: np.ndarray) -> dict:
    """Global and foreground Pearson correlation against a known ground truth."""
    fg = foreground_mask(truth)
    return {
        "pearson_global": pearson(recon, truth),
        "pearson_foreground": pearson(recon, truth, fg),
        "foreground_fraction": float(fg.mean()),
    }


def host_tensor(array: np.ndarray):
    """``torch.from_numpy(array)`` without torch's warning about read-only arrays: the volumes
    scored here are often read-only maps of their files, and their tensors are only read (copied
    to the scoring device or cast)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def streamed_volume_metrics(recon: np.ndarray, truth: np.ndarray, planes: int | None = None,
                            device: str | None = None) -> dict:
    """:func:`volume_metrics` plus ``mse`` (and the truth's ``truth_min`` / ``truth_max``) of volumes
    too large for whole-volume temporaries (memory maps welcome): float64 moment sums over slabs of
    ``planes`` Z planes (None: about 2^26 voxels a slab), each volume shifted by its first slab's
    mean against cancellation, in torch on ``device`` (None: :func:`scoring_device`, else the CPU's
    threads). Equal to the whole-volume values up to float64 rounding (the summation order
    differs)."""
    import torch

    if recon.shape != truth.shape:
        raise ValueError(f"streamed_volume_metrics: shapes differ, {recon.shape} vs {truth.shape}")
    dev = torch.device(device or scoring_device() or "cpu")
    plane = int(np.prod(recon.shape[1:]))
    planes = max(1, (1 << 26) // max(plane, 1)) if planes is None else planes

    from fasttomo.data.io.mrc import drop_mapped_pages

    def slab(v, z0: int) -> torch.Tensor:
        if isinstance(v, torch.Tensor):  # already on the scoring device (score_against_truth)
            return v[z0:z0 + planes].to(dev, torch.float64)
        t = host_tensor(np.ascontiguousarray(v[z0:z0 + planes])).to(dev).to(torch.float64)  # cast there
        drop_mapped_pages(v[z0:z0 + planes])  # a memory map's pages read leave this process
        return t

    lo, top = math.inf, -math.inf
    for z0 in range(0, truth.shape[0], planes):
        b = slab(truth, z0)
        lo, top = min(lo, float(b.min())), max(top, float(b.max()))
    s0 = (float(slab(recon, 0).mean()), float(slab(truth, 0).mean()))
    sums = {"all": torch.zeros(6, dtype=torch.float64, device=dev), "fg": torch.zeros(6, dtype=torch.float64, device=dev)}
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for z0 in range(0, recon.shape[0], planes):
        a, b = slab(recon, z0) - s0[0], slab(truth, z0)
        fg = b > FOREGROUND_REL * top
        b -= s0[1]
        sq += ((a - b + (s0[0] - s0[1])) ** 2).sum()
        af, bf = torch.where(fg, a, 0.0), torch.where(fg, b, 0.0)
        sums["all"] += torch.stack([torch.tensor(float(a.numel()), dtype=torch.float64, device=dev), a.sum(), b.sum(),
                                    (a * a).sum(), (b * b).sum(), (a * b).sum()])
        sums["fg"] += torch.stack([fg.sum().to(torch.float64), af.sum(), bf.sum(), (af * af).sum(), (bf * bf).sum(),
                                   (af * bf).sum()])

    def _r(moments) -> float:
        n, sa, sb, saa, sbb, sab = moments.tolist()
        cov, va, vb = sab - sa * sb / max(n, 1), saa - sa * sa / max(n, 1), sbb - sb * sb / max(n, 1)
        return float(cov / math.sqrt(va * vb)) if n > 0 and va > 0 and vb > 0 else float("nan")

    n = float(math.prod(recon.shape))
    return {"pearson_global": _r(sums["all"]), "pearson_foreground": _r(sums["fg"]),
            "foreground_fraction": float(sums["fg"][0]) / n, "mse": float(sq) / n, "truth_min": lo, "truth_max": top}


def mse(a: np.ndarray, b: np.ndarray) -> float:
    """Mean squared difference of two arrays of the same shape (float64)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"mse: shapes differ, {a.shape} vs {b.shape}")
    return float(np.mean((a - b) ** 2))


def psnr(recon: np.ndarray, truth: np.ndarray, data_range: float) -> float:
    """Peak signal-to-noise ratio in dB: 10 log10(data_range^2 / MSE); +inf for identical arrays.

    ``data_range`` (the span of values a "peak" means, e.g. truth max - min) has no default on
    purpose: PSNR means nothing without it, and a guessed one makes numbers incomparable.
    """
    data_range = float(data_range)
    if not math.isfinite(data_range) or data_range <= 0:
        raise ValueError(f"psnr: data_range must be a positive finite number, got {data_range!r}.")
    err = mse(recon, truth)
    return float("inf") if err == 0 else 10.0 * math.log10(data_range * data_range / err)


# --------------------------------------------------------------------------------------- FSC
@dataclasses.dataclass(frozen=True)
class Crossing:
    """Where an FSC curve first falls below ``threshold``."""

    threshold: float
    freq_inv_A: float | None
    """Interpolated frequency in 1/A; None unless ``status == "crossed"``."""
    resolution_A: float | None
    """1 / freq_inv_A in Angstrom; None unless crossed."""
    status: str
    """``crossed``; ``never`` (at or above the threshold up to Nyquist); ``below_at_start`` (already
    below at the first shell with data: worse than the box's lowest frequency); ``no_data``."""


def crossing(freq: Sequence[float], values: Sequence[float], threshold: float) -> Crossing:
    """First crossing of ``values`` below ``threshold``, linearly interpolated in frequency.

    Shells with NaN values (no Fourier voxels or no power) are skipped. If shell i is the first
    below the threshold and shell j the valid one before it, the crossing is
    f_j + (v_j - t) / (v_j - v_i) * (f_i - f_j).
    """
    f = np.asarray(freq, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v) & np.isfinite(f)
    f, v = f[ok], v[ok]
    t = float(threshold)
    if f.size == 0:
        return Crossing(t, None, None, "no_data")
    below = np.flatnonzero(v < t)
    if below.size == 0:
        return Crossing(t, None, None, "never")
    i = int(below[0])
    if i == 0:
        return Crossing(t, None, None, "below_at_start")
    f0, f1, v0, v1 = f[i - 1], f[i], v[i - 1], v[i]
    fc = float(f0 + (v0 - t) / (v0 - v1) * (f1 - f0))
    return Crossing(t, fc, (1.0 / fc) if fc > 0 else None, "crossed")


@dataclasses.dataclass(frozen=True)
class FSCCurve:
    """One Fourier shell correlation curve (shell 1 up to Nyquist)."""

    freq_inv_A: np.ndarray
    """(S,) shell centres in 1/A (shell s at s * shell width)."""
    fsc: np.ndarray
    """(S,) FSC per shell; NaN where the shell (in this region) holds no voxel or no power."""
    n_voxels: np.ndarray
    """(S,) int: Fourier voxels of the full grid in each shell (of this region)."""
    power_a: np.ndarray
    """(S,) sum of |A|^2 per shell (full grid), the first volume's spectral power."""
    power_b: np.ndarray
    """(S,) sum of |B|^2 per shell."""
    voxel_size_A: float
    region: str = "all"
    """``all``, ``measured`` or ``wedge``."""

    @property
    def nyquist_inv_A(self) -> float:
        return 0.5 / self.voxel_size_A

    def crossing(self, threshold: float) -> Crossing:
        return crossing(self.freq_inv_A, self.fsc, threshold)

    @property
    def mean_to_nyquist(self) -> float | None:
        """The mean FSC over the shells from the first one up to Nyquist (each shell counts once;
        shells without data are skipped): one number for the whole curve, which, unlike a
        crossing, still moves when a curve changes beyond its crossing. None without any data."""
        v = self.fsc[np.isfinite(self.fsc)]
        return float(v.mean()) if v.size else None

    def summary(self, curves: bool = True) -> dict:
        """JSON-ready dict: ``fsc05_A``, ``fsc05_inv_A``, ``fsc05_status``, the same for 0.143
        (``fsc0143_*``), ``fsc_mean`` (:attr:`mean_to_nyquist`), ``nyquist_A``, ``region``,
        ``voxel_size_A`` and (``curves``) the lists ``freq_inv_A``, ``fsc`` (NaN as null) and
        ``n_voxels``."""
        out: dict = {"region": self.region, "voxel_size_A": self.voxel_size_A, "nyquist_A": 2.0 * self.voxel_size_A,
                     "fsc_mean": self.mean_to_nyquist}
        for t in FSC_THRESHOLDS:
            key = "fsc" + f"{t:g}".replace(".", "")
            c = self.crossing(t)
            out[f"{key}_A"] = c.resolution_A
            out[f"{key}_inv_A"] = c.freq_inv_A
            out[f"{key}_status"] = c.status
        if curves:
            out["freq_inv_A"] = [float(x) for x in self.freq_inv_A]
            out["fsc"] = [None if not np.isfinite(x) else float(x) for x in self.fsc]
            out["n_voxels"] = [int(x) for x in self.n_voxels]
        return out


def _check_tilt_range(tilt_range_deg) -> tuple[float, float]:
    try:
        lo, hi = (float(t) for t in tilt_range_deg)
    except (TypeError, ValueError):
        raise ValueError(f"tilt range must be two numbers [min, max] in degrees, got {tilt_range_deg!r}.") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi and hi - lo <= 180.0):
        raise ValueError(f"tilt range must be [min, max] degrees with min < max and max - min <= 180, got "
                         f"{tilt_range_deg!r}.")
    return lo, hi


def measured_region(shape_zyx: Sequence[int], tilt_range_deg: Sequence[float]) -> np.ndarray:
    """Boolean (Z, X // 2 + 1) map over the real-FFT half grid of (kz, kx): True where a tilt
    series about Y over ``tilt_range_deg`` = [min, max] degrees measured the Fourier voxel (the same
    for every ky). Index [i, j] is kz = fftfreq(Z)[i], kx = rfftfreq(X)[j] (numpy order).

    The angle of (kx, kz) uses physical frequencies, kx = j / X and kz = i / Z per voxel (the voxel
    size cancels), so non-cubic boxes get the true angle.
    """
    z, _, x = (int(s) for s in shape_zyx)
    lo, hi = _check_tilt_range(tilt_range_deg)
    kz = np.fft.fftfreq(z)[:, None]
    kx = np.fft.rfftfreq(x)[None, :]
    phi = np.degrees(np.arctan2(kz, kx))                 # in [-90, 90] since kx >= 0
    measured = np.mod(phi - lo, 180.0) <= (hi - lo) + 1e-9
    measured[0, 0] = True                                # the ky axis lies in every measured plane
    return measured


def _hermitian_weights(x: int) -> np.ndarray:
    """Weight of each real-FFT column: 2 where the conjugate column is not stored, else 1."""
    w = np.full(x // 2 + 1, 2.0)
    w[0] = 1.0
    if x % 2 == 0:
        w[-1] = 1.0
    return w


def _check_shapes(a, b, mask, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The pair as arrays and the mask as float32, after the checks of shape and of the mask."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"{what}: volumes must be 3-D (Z, Y, X), got shapes {a.shape} and {b.shape}.")
    if a.shape != b.shape:
        raise ValueError(f"{what}: volume shapes differ, (Z, Y, X) = {a.shape} vs {b.shape}; they must match "
                         "voxel for voxel.")
    m = None
    if mask is not None:
        m = np.asarray(mask, dtype=np.float32)
        if m.shape != a.shape:
            raise ValueError(f"{what}: mask shape {m.shape} differs from the volumes' {a.shape}.")
        if not np.all(np.isfinite(m)) or m.min() < 0 or not m.max() > 0:
            raise ValueError(f"{what}: the mask must be finite, >= 0 and not all zero (a soft mask in [0, 1]).")
    return a, b, m


def _check_pair(a, b, mask, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The pair prepared for the transform in numpy: checked, each (mask-weighted) mean removed in
    float64, float32, times the mask."""
    a, b, m = _check_shapes(a, b, mask, what)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError(f"{what}: the volumes hold NaN or Inf values; FSC needs finite volumes.")
    out = []
    for v in (a, b):
        # remove the (mask-weighted) mean first: the float32 transform then keeps its precision for
        # weak detail on a large offset, and a mask does not add its own shape (mean x mask) to both
        mean = float(np.mean(v, dtype=np.float64)) if m is None else float(
            np.sum(v * m, dtype=np.float64) / np.sum(m, dtype=np.float64))
        c = np.empty(v.shape, dtype=np.float32)
        step = max(1, (1 << 24) // max(1, v[0].size))  # Z planes at a time: no whole float64 copy
        for z0 in range(0, v.shape[0], step):
            c[z0:z0 + step] = v[z0:z0 + step].astype(np.float64) - mean
        out.append(c if m is None else c * m)
    return out[0], out[1]


def _check_scalars(voxel_size_A, shell_width, what: str) -> tuple[float, float]:
    vx = float(voxel_size_A)
    if not math.isfinite(vx) or vx <= 0:
        raise ValueError(f"{what}: voxel_size_A must be a positive number of Angstrom, got {voxel_size_A!r}.")
    sw = float(shell_width)
    if not math.isfinite(sw) or sw <= 0:
        raise ValueError(f"{what}: shell_width must be > 0 Fourier voxels, got {shell_width!r}.")
    return vx, sw


def _fsc_curves(a, b, voxel_size_A: float, mask, shell_width: float, tilt_range_deg, what: str
                ) -> dict[str, FSCCurve]:
    vx, sw = _check_scalars(voxel_size_A, shell_width, what)
    device = scoring_device()
    sums = None
    if device is not None:  # checked, centred and transformed on the device: no float64 pass on the host
        a, b, m = _check_shapes(a, b, mask, what)
        sums = _crop_sums_torch(a, b, m, vx, sw, tilt_range_deg, device, what)
    if sums is None:
        a, b = _check_pair(a, b, mask, what)
        sums = _shell_sums(a, b, vx, sw, tilt_range_deg, device=None)
    return _curves(sums, a.shape, vx, sw)


def scoring_device() -> str | None:
    """Where the FSC's transforms and shell sums run: "cuda" when this process has imported torch
    and has a GPU, else None (numpy; its FFT of a 1024^2 x 256 volume took 45.8 s of a 96 s run on
    an H200 machine). The curves agree to float32 rounding (tests/quality)."""
    torch = sys.modules.get("torch")
    return "cuda" if torch is not None and torch.cuda.is_available() else None


def _shell_sums(a: np.ndarray, b: np.ndarray, vx: float, sw: float, tilt_range_deg,
                device: str | None = "auto") -> dict[str, np.ndarray]:
    """Per region, (4, n_shells) sums over the full Fourier grid of two prepared (mean-removed)
    volumes: Re(A B*), |A|^2, |B|^2 and the voxel count per shell; in numpy, or with torch on
    ``device`` ("auto": :func:`scoring_device`)."""
    device = scoring_device() if device == "auto" else device
    if device is not None:
        import torch

        try:
            return _shell_sums_torch(a, b, vx, sw, tilt_range_deg, device)
        except torch.cuda.OutOfMemoryError:  # a GPU too full for the transforms: numpy, as on a CPU
            torch.cuda.empty_cache()
    z, y, x = a.shape
    measured = None if tilt_range_deg is None else measured_region(a.shape, tilt_range_deg)
    fa = np.fft.rfftn(a)
    fb = np.fft.rfftn(b)
    width = sw / (max(z, y, x) * vx)                      # shell width in 1/A
    n_shells = int(math.floor(0.5 / vx / width + 1e-9)) + 1   # shells 0 .. Nyquist
    kz = np.fft.fftfreq(z, d=vx)
    kyx2 = np.fft.fftfreq(y, d=vx)[:, None] ** 2 + np.fft.rfftfreq(x, d=vx)[None, :] ** 2
    wx = _hermitian_weights(x)
    regions = ["all"] if measured is None else ["all", "measured", "wedge"]
    sums = {r: np.zeros((4, n_shells)) for r in regions}  # num, |A|^2, |B|^2, count
    rows = max(1, (1 << 22) // max(1, y * (x // 2 + 1)))  # kz rows per chunk: ~4 M Fourier voxels
    for z0 in range(0, z, rows):
        z1 = min(z, z0 + rows)
        ca, cb = fa[z0:z1], fb[z0:z1]
        shell = np.rint(np.sqrt(kz[z0:z1, None, None] ** 2 + kyx2[None]) / width).astype(np.int64)
        keep = shell < n_shells
        w = np.broadcast_to(wx, ca.shape)
        parts = (
            (ca.real.astype(np.float64) * cb.real + ca.imag.astype(np.float64) * cb.imag) * w,
            (ca.real.astype(np.float64) ** 2 + ca.imag.astype(np.float64) ** 2) * w,
            (cb.real.astype(np.float64) ** 2 + cb.imag.astype(np.float64) ** 2) * w,
            w,
        )
        for r in regions:
            sel = keep
            if r != "all":
                inside = np.broadcast_to(measured[z0:z1, None, :], ca.shape)
                sel = keep & (inside if r == "measured" else ~inside)
            idx = shell[sel]
            for k, p in enumerate(parts):
                sums[r][k] += np.bincount(idx, weights=p[sel], minlength=n_shells)
    return sums


def _curves(sums: dict[str, np.ndarray], shape_zyx, vx: float, sw: float) -> dict[str, FSCCurve]:
    """FSC curves (shell 1 up to Nyquist) from :func:`_shell_sums` of a box of ``shape_zyx``."""
    width = sw / (max(shape_zyx) * vx)
    out = {}
    for r, s in sums.items():
        num, pa, pb, cnt = s[:, 1:]
        freq = np.arange(1, s.shape[1]) * width
        den = np.sqrt(pa * pb)
        with np.errstate(invalid="ignore", divide="ignore"):
            curve = np.where((den > 0) & (cnt > 0), num / np.where(den > 0, den, 1.0), np.nan)
        out[r] = FSCCurve(freq_inv_A=freq, fsc=curve, n_voxels=np.rint(cnt).astype(np.int64), power_a=pa,
                          power_b=pb, voxel_size_A=vx, region=r)
    return out


def fsc(a: np.ndarray, b: np.ndarray, voxel_size_A: float, mask: np.ndarray | None = None,
        shell_width: float = 1.0) -> FSCCurve:
    """Fourier shell correlation of two (Z, Y, X) volumes (see the module docstring).

    ``mask`` is an optional soft real-space mask (same shape, values in [0, 1]) applied to both
    volumes before the transform. Each volume's mean is removed first (the mask-weighted mean with
    a mask). Without a mask this changes only the zero-frequency term, which is not reported; with
    one it keeps mean x mask, the mask's own shape, out of the low shells of both volumes.
    ``shell_width`` is in Fourier voxels of the largest axis.
    """
    return _fsc_curves(a, b, voxel_size_A, mask, shell_width, None, "fsc")["all"]


def sector_fsc(a: np.ndarray, b: np.ndarray, voxel_size_A: float, tilt_range_deg: Sequence[float],
               mask: np.ndarray | None = None, shell_width: float = 1.0) -> dict[str, FSCCurve]:
    """FSC over all of Fourier space and restricted to the measured region and to the missing
    wedge of a tilt series about Y over ``tilt_range_deg`` = [min, max] degrees (same shells).

    Returns ``{"all": FSCCurve, "measured": FSCCurve, "wedge": FSCCurve}``; a shell with no voxel
    of a region has NaN there.
    """
    return _fsc_curves(a, b, voxel_size_A, mask, shell_width, tilt_range_deg, "sector_fsc")


CHUNK_FSC_CROP = 256
"""Side of the cubic crops of :func:`chunked_fsc` (voxels)."""
CHUNK_FSC_MAX_CROPS = 64
"""At most this many crops per volume in :func:`chunked_fsc`."""


def crop_starts(n: int, crop: int, max_positions: int) -> list[int]:
    """Start indices of crops of ``crop`` voxels along an axis of ``n``: evenly spread from 0 to
    n - crop, at most half a crop apart (overlapping by half or more) or, when that needs more
    than ``max_positions``, that many positions evenly spread (a sample of the axis; one: the
    central crop)."""
    if crop >= n:
        return [0]
    count = min(max_positions, math.ceil((n - crop) / (crop / 2)) + 1)
    if count <= 1:
        return [(n - crop) // 2]  # the central crop
    return sorted({int(round(i * (n - crop) / (count - 1))) for i in range(count)})


def _crop_taper(shape_zyx, box) -> np.ndarray | None:
    """A separable raised-cosine edge taper (1/8 of the crop at each end) along each axis the
    crop cuts (shorter than the volume), so the cut's edges add no false high-frequency power;
    None when the crop is the whole volume."""
    if tuple(box) == tuple(shape_zyx):
        return None
    axes = []
    for n, c in zip(shape_zyx, box):
        w = np.ones(c, dtype=np.float32)
        m = max(1, c // 8)
        if c < n:
            ramp = (0.5 - 0.5 * np.cos(np.pi * (np.arange(m) + 0.5) / m)).astype(np.float32)
            w[:m], w[-m:] = ramp, ramp[::-1]
        axes.append(w)
    return axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :]


def chunked_fsc(a: np.ndarray, b: np.ndarray, voxel_size_A: float, tilt_range_deg: Sequence[float] | None = None,
                crop: int = CHUNK_FSC_CROP, max_crops: int = CHUNK_FSC_MAX_CROPS) -> dict[str, FSCCurve]:
    """FSC of two (Z, Y, X) volumes too large for one transform, from cubic crops of side
    ``crop`` (each side at most the volume's): the per-shell sums Re(A B*), |A|^2, |B|^2 and the
    voxel counts of every crop (each with its own weighted mean removed and its cut edges tapered,
    :func:`_crop_taper`) are added up before the ratio is taken, on the crop's shell grid. Returns the curves by region like
    :func:`sector_fsc` (``{"all": ...}`` without ``tilt_range_deg``).

    Why crops summed, not the central crop alone: the FSC of a tomogram varies across it (the
    specimen is not centred, the edges hold less), and summing the spectra of crops spread over
    the whole volume estimates the same shell correlation as the whole-volume FSC (a Welch-style
    average: each shell's cross and auto powers, accumulated) with a bounded transform size and
    memory, whatever the volume's size. The price is frequency resolution: shells are
    1 / (crop x voxel size) wide instead of 1 / (largest side x voxel size), so a crossing moves
    by at most about one crop shell. The crops overlap by half while at most ``max_crops`` fit
    (:func:`crop_starts`); above that they are an even sample of the volume. A crop that covers
    the whole volume gives exactly :func:`fsc` / :func:`sector_fsc`. Volumes may be memory maps:
    only one crop of each is read at a time."""
    vx, sw = _check_scalars(voxel_size_A, 1.0, "chunked_fsc")
    if a.ndim != 3 or a.shape != b.shape:
        raise ValueError(f"chunked_fsc: volumes must be 3-D and of one shape, got {a.shape} and {b.shape}.")
    box = tuple(min(int(crop), n) for n in a.shape)
    starts = [crop_starts(n, c, max(1, int(max_crops))) for n, c in zip(a.shape, box)]
    while math.prod(len(s) for s in starts) > max_crops:  # thin the longest list of positions
        i = max(range(3), key=lambda k: len(starts[k]))
        starts[i] = crop_starts(a.shape[i], box[i], len(starts[i]) - 1)
    from fasttomo.data.io.mrc import drop_mapped_pages

    taper = _crop_taper(a.shape, box)
    device = scoring_device()
    total: dict[str, np.ndarray] | None = None
    for z0 in starts[0]:
        for y0 in starts[1]:
            for x0 in starts[2]:
                cut = (slice(z0, z0 + box[0]), slice(y0, y0 + box[1]), slice(x0, x0 + box[2]))
                sums = None
                if device is not None:
                    sums = _crop_sums_torch(a[cut], b[cut], taper, vx, sw, tilt_range_deg, device, "chunked_fsc")
                if sums is None:
                    ca, cb = _check_pair(host_array(a[cut]), host_array(b[cut]), taper, "chunked_fsc")
                    sums = _shell_sums(ca, cb, vx, sw, tilt_range_deg, device=None)
                for v in (a, b):
                    if isinstance(v, np.ndarray):
                        drop_mapped_pages(v[cut])
                total = sums if total is None else {r: total[r] + sums[r] for r in total}
    return _curves(total, box, vx, sw)


def host_array(v) -> np.ndarray:
    """``v`` as a numpy array (a torch tensor copied to the host)."""
    return v.detach().cpu().numpy() if type(v).__module__.split(".")[0] == "torch" else v


def _crop_sums_torch(a: np.ndarray, b: np.ndarray, taper: np.ndarray | None, vx: float, sw: float,
                     tilt_range_deg, device: str, what: str) -> dict[str, np.ndarray] | None:
    """:func:`_check_pair` and :func:`_shell_sums` of a pair (a crop, or whole volumes) with torch on
    ``device``: each volume is copied to the device as it is stored and checked, its mean removed
    (in float64, a slab at a time) and the taper or mask applied there (the same float64 mean and
    float32 results as numpy's); None when the device is too full."""
    import torch

    try:
        t = taper if taper is None else torch.from_numpy(taper).to(device)
        out = []
        for v in (a, b):
            g = (v.to(device, torch.float32, copy=True) if isinstance(v, torch.Tensor) else  # centred in place
                 host_tensor(np.ascontiguousarray(v, dtype=np.float32)).to(device, copy=True))
            if not bool(torch.isfinite(g).all()):
                raise ValueError(f"{what}: the volumes hold NaN or Inf values; FSC needs finite volumes.")
            mean = g.mean(dtype=torch.float64) if t is None else (g * t).sum(dtype=torch.float64) / t.sum(
                dtype=torch.float64)
            step = max(1, (1 << 24) // max(1, g[0].numel()))  # Z planes at a time: no whole float64 copy
            for z0 in range(0, g.shape[0], step):
                g[z0:z0 + step] = g[z0:z0 + step].to(torch.float64) - mean
            out.append(g if t is None else g.mul_(t))
        return _shell_sums_torch(out[0], out[1], vx, sw, tilt_range_deg, device)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _shell_sums_torch(a: np.ndarray, b: np.ndarray, vx: float, sw: float, tilt_range_deg,
                      device: str) -> dict[str, np.ndarray]:
    """:func:`_shell_sums` with torch on ``device``: the same float32 transforms, shells, weights
    and regions, the sums in float64 (on the device, as numpy's on the host). ``a`` and ``b`` may
    be numpy arrays or float32 tensors (already on ``device``)."""
    import torch

    z, y, x = a.shape

    def _on_device(v):
        return v if isinstance(v, torch.Tensor) else host_tensor(np.ascontiguousarray(v, dtype=np.float32))

    fa = torch.fft.rfftn(_on_device(a).to(device))
    fb = torch.fft.rfftn(_on_device(b).to(device))
    width = sw / (max(z, y, x) * vx)
    n_shells = int(math.floor(0.5 / vx / width + 1e-9)) + 1
    f64 = dict(dtype=torch.float64, device=device)
    kz = torch.from_numpy(np.fft.fftfreq(z, d=vx)).to(**f64)
    kyx2 = torch.from_numpy(np.fft.fftfreq(y, d=vx)[:, None] ** 2 + np.fft.rfftfreq(x, d=vx)[None, :] ** 2).to(**f64)
    wx = torch.from_numpy(_hermitian_weights(x)).to(**f64)
    measured = None
    regions = ["all"]
    if tilt_range_deg is not None:
        measured = torch.from_numpy(measured_region(a.shape, tilt_range_deg)).to(device)
        regions = ["all", "measured", "wedge"]
    sums = {r: torch.zeros((4, n_shells), **f64) for r in regions}
    rows = max(1, (1 << 24) // max(1, y * (x // 2 + 1)))
    for z0 in range(0, z, rows):
        z1 = min(z, z0 + rows)
        ca, cb = fa[z0:z1], fb[z0:z1]
        shell = torch.round(torch.sqrt(kz[z0:z1, None, None] ** 2 + kyx2[None]) / width).to(torch.int64)
        keep = shell < n_shells
        w = wx.expand(ca.shape)
        ar, ai, br, bi = (t.to(torch.float64) for t in (ca.real, ca.imag, cb.real, cb.imag))
        parts = ((ar * br + ai * bi) * w, (ar * ar + ai * ai) * w, (br * br + bi * bi) * w, w)
        for r in regions:
            sel = keep
            if r != "all":
                inside = measured[z0:z1, None, :].expand(ca.shape)
                sel = keep & (inside if r == "measured" else ~inside)
            idx = shell[sel]
            for k, p in enumerate(parts):
                sums[r][k] += torch.bincount(idx, weights=p[sel], minlength=n_shells)[:n_shells]
    return {r: v.cpu().numpy() for r, v in sums.items()}


# --------------------------------------------------------------------------------------- projections
@dataclasses.dataclass(frozen=True)
class ProjectionMetrics:
    """Per-view agreement of a measured stack with a predicted (forward-projected) one."""

    pearson: np.ndarray
    """(n,) correlation of each measured view with the model's prediction of it (scale * predicted
    + offset, so a negative global scale -- inverted contrast -- keeps it positive; with
    ``fit="per_view"`` it is |r|); NaN for a view without valid or non-constant pixels."""
    rms: np.ndarray
    """(n,) RMS of measured - (scale * predicted + offset) over the view's valid pixels, in the
    measured stack's units."""
    rel_rms: np.ndarray
    """(n,) rms divided by the standard deviation of the measured view (1.0 = no better than the
    view's mean; NaN for a constant view)."""
    n_pixels: np.ndarray
    """(n,) int: valid pixels per view."""
    scale: np.ndarray
    """(n,) scale applied to the prediction (1 for fit="none"; the same for every view for "global")."""
    offset: np.ndarray
    """(n,) offset added to the prediction."""
    fit: str

    def summary(self, views: Sequence[int] | None = None) -> dict:
        """Means, worst values and worst views (0-based indices into the full stack), optionally
        over ``views`` (0-based) only: keys ``n_views``, ``pearson_mean``, ``pearson_min``,
        ``pearson_worst_index``, ``rms_mean``, ``rms_max``, ``rms_worst_index``, ``rel_rms_mean``,
        ``rel_rms_max``."""
        idx = np.arange(self.pearson.size) if views is None else np.asarray(list(views), dtype=np.int64)
        out: dict = {"n_views": int(idx.size)}
        for name, worst, fn in (("pearson", "min", np.nanargmin), ("rms", "max", np.nanargmax),
                                ("rel_rms", "max", np.nanargmax)):
            vals = getattr(self, name)[idx]
            good = np.isfinite(vals)
            out[f"{name}_mean"] = float(vals[good].mean()) if good.any() else None
            out[f"{name}_{worst}"] = float(vals[fn(vals)]) if good.any() else None
            if name != "rel_rms":
                out[f"{name}_worst_index"] = int(idx[fn(vals)]) if good.any() else None
        return out

    def to_json(self) -> dict:
        """The per-view arrays as JSON lists (NaN as null) plus ``fit``."""
        def lst(a):
            return [None if not np.isfinite(v) else float(v) for v in a]

        return {"fit": self.fit, "pearson": lst(self.pearson), "rms": lst(self.rms), "rel_rms": lst(self.rel_rms),
                "n_pixels": [int(v) for v in self.n_pixels], "scale": lst(self.scale), "offset": lst(self.offset)}


def _affine_fit(p: np.ndarray, m: np.ndarray) -> tuple[float, float]:
    """Least-squares (scale, offset) with m ~ scale * p + offset (offset only if p is constant)."""
    if p.size == 0:
        return 1.0, 0.0
    pc = p - p.mean()
    var = float((pc * pc).sum())
    if var == 0:
        return 0.0, float(m.mean())
    s = float((pc * (m - m.mean())).sum() / var)
    return s, float(m.mean() - s * p.mean())


def projection_metrics(measured: np.ndarray, predicted: np.ndarray, valid: np.ndarray | None = None,
                       fit: str = "none") -> ProjectionMetrics:
    """Per-view correlation and residual of ``measured`` (n, H, W) against ``predicted`` (n, H, W).

    ``valid`` (n, H, W) bool marks the pixels to use (None: all; non-finite measured pixels are
    always left out). ``fit`` is the intensity model applied to the prediction before the residual
    (measured ~ scale * line integral + background): ``none`` (scale 1, offset 0); ``global`` (one
    least-squares scale and offset over all valid pixels of all views: what a global
    normalization does, per-view differences stay visible); ``per_view`` (one per view: hides
    per-view intensity errors).
    """
    m = np.asarray(measured, dtype=np.float64)
    p = np.asarray(predicted, dtype=np.float64)
    if m.ndim != 3 or m.shape != p.shape:
        raise ValueError(f"projection_metrics: measured and predicted must be (n, H, W) stacks of the same shape, got "
                         f"{m.shape} and {p.shape}.")
    if fit not in ("none", "global", "per_view"):
        raise ValueError(f"projection_metrics: fit must be none, global or per_view, got {fit!r}.")
    ok = np.isfinite(m) & np.isfinite(p)
    if valid is not None:
        v = np.asarray(valid, dtype=bool)
        if v.shape != m.shape:
            raise ValueError(f"projection_metrics: valid mask shape {v.shape} differs from the stacks' {m.shape}.")
        ok &= v
    n = m.shape[0]
    scale, offset = np.ones(n), np.zeros(n)
    if fit == "global":
        s, o = _affine_fit(p[ok], m[ok])
        scale[:], offset[:] = s, o
    stats = np.full((3, n), np.nan)
    counts = np.zeros(n, dtype=np.int64)
    for i in range(n):
        mi, pi = m[i][ok[i]], p[i][ok[i]]
        counts[i] = mi.size
        if fit == "per_view":
            scale[i], offset[i] = _affine_fit(pi, mi)
        if mi.size == 0:
            continue
        model = scale[i] * pi + offset[i]
        rms = math.sqrt(float(np.mean((mi - model) ** 2)))
        sd = float(mi.std())
        stats[0, i] = pearson(mi, model)
        stats[1, i] = rms
        stats[2, i] = rms / sd if sd > 0 else np.nan
    return ProjectionMetrics(pearson=stats[0], rms=stats[1], rel_rms=stats[2], n_pixels=counts, scale=scale,
                             offset=offset, fit=fit)
