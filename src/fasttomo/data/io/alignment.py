"""Alignments of a raw tilt stack from IMOD (.xf, .tlt, .xtilt) and AreTomo (.aln) as fasttomo
poses, and fasttomo's poses written back in those formats.

fasttomo's pose model (:mod:`fasttomo.geometry.poses`): view n shows the volume point p at the
detector position r = Rz(z3) Ry(theta) Rz(z1) p + (su, sv), with r = (u, v) measured from the
image centre (u = column - (W-1)/2, v = row - (H-1)/2). IMOD's .xf maps the raw image onto the
aligned one about the image centre, q = A r + d, and the aligned image is the ideal projection
(tilt axis along Y): q = P Ry(theta) p. IMOD's centre nx/2 in its pixel coordinates (a pixel's
centre at index + 0.5) is fasttomo's (W-1)/2, and both count y along the rows in file order, so

    Rz(z3) = A^-1 (a rotation),   (su, sv) = -A^-1 d,   z1 = 0.

A linear part that is not a rotation (a magnification, a stretch or a mirror) has no place in
this model: a file whose A has a singular value off 1 by more than :data:`MAG_TOLERANCE` (0.5 %,
about 10 pixels at the edge of a 4k image) is refused; below it, A is replaced by its nearest
rotation (the shifts keep A's exact inverse, so the image centre maps exactly). AreTomo's .aln is
read through its equivalent .xf (:mod:`fasttomo.data.io.aretomo`). IMOD's X-axis tilt (.xtilt)
tilts the whole specimen: one value for every view only turns the volume about X (the volume
comes out as IMOD's, un-tilted about X: level it with IMOD's rotatevol if needed); values that
differ between views are refused.

Binning: the files are in pixels of the raw stack; with ``data.binning = b`` the volume is the
one of the aligned stack binned the same way (its centre at the binned image's centre), and a raw
shift s becomes (s + (I - Rz(z3)) c) / b in binned pixels, where c = ((W - b floor(W/b)) / 2,
(H - b floor(H/b)) / 2) is the offset of the binned image's centre (the binning drops trailing
rows and columns): a raw position r is b r_b - c. ``data.crop`` and ``data.tilt_axis_angle`` change the
image frame and are refused with these files (the alignment already holds the tilt-axis
rotation).

The per-section values are kept in ``TiltSeries.metadata['file_alignment']`` (file order, raw
pixels); :func:`view_poses` picks those of a series' views (``metadata['view_numbers']``, which
follows exclusion, sorting and held-out views) in prepared pixels.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from fasttomo.data.io.common import DataFileError

log = logging.getLogger("fasttomo.data")

MAG_TOLERANCE = 0.005
"""Largest |singular value - 1| of an alignment's linear part taken as a rotation."""
XTILT_TOLERANCE_DEG = 0.01
"""Largest spread of the .xtilt values (degrees) taken as one X-axis tilt of the whole specimen."""


def rot2(a_deg: np.ndarray) -> np.ndarray:
    """(..., 2, 2) rotations [[cos, -sin], [sin, cos]] by ``a_deg`` degrees (x along the columns,
    y along the rows: the upper-left block of :func:`fasttomo.geometry.so3.rot_z`)."""
    a = np.deg2rad(np.asarray(a_deg, dtype=np.float64))
    c, s = np.cos(a), np.sin(a)
    return np.stack((np.stack((c, -s), -1), np.stack((s, c), -1)), -2)


def xf_to_poses(xf: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(z3_deg (n,), shifts (n, 2) raw pixels) of (n, 6) IMOD transforms; refuses a linear part
    that is not a rotation within :data:`MAG_TOLERANCE`."""
    xf = np.asarray(xf, dtype=np.float64).reshape(-1, 6)
    a = xf[:, :4].reshape(-1, 2, 2)
    sv = np.linalg.svd(a, compute_uv=False)
    det = np.linalg.det(a)
    bad = np.flatnonzero((np.abs(sv - 1.0).max(axis=1) > MAG_TOLERANCE) | (det <= 0))
    if bad.size:
        i = int(bad[0])
        kind = "a mirror" if det[i] <= 0 else f"a magnification or stretch of {sv[i].min():.4f}..{sv[i].max():.4f}"
        raise DataFileError(f"{where}: the transform of section {i + 1} (and {bad.size - 1} more) is {kind}, not a "
                            f"rotation (tolerance {MAG_TOLERANCE:.1%}); fasttomo's poses hold a rotation and a shift "
                            "per view. Align without magnification or distortion (tiltalign MagOption 0), or give the "
                            "aligned stack (.ali) with its .tlt instead.")
    phi = np.rad2deg(np.arctan2(a[:, 1, 0] - a[:, 0, 1], a[:, 0, 0] + a[:, 1, 1]))
    shifts = -np.linalg.solve(a, xf[:, 4:, None])[..., 0]
    return -phi, shifts


def poses_to_xf(z3_deg: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """(n, 6) IMOD transforms of rotations ``z3_deg`` and raw-pixel ``shifts`` (n, 2): A = R(-z3),
    d = -A s (the inverse of :func:`xf_to_poses`)."""
    a = rot2(-np.asarray(z3_deg, dtype=np.float64))
    d = -(a @ np.asarray(shifts, dtype=np.float64).reshape(-1, 2, 1))[..., 0]
    return np.concatenate((a.reshape(-1, 4), d), axis=1)


def aln_to_xf(rot_deg: np.ndarray, gmag: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """(n, 6) IMOD transforms equivalent to .aln rows: A = GMAG R(ROT), d = -A (TX, TY)."""
    a = rot2(rot_deg) * np.asarray(gmag, dtype=np.float64)[:, None, None]
    d = -(a @ np.asarray(shifts, dtype=np.float64).reshape(-1, 2, 1))[..., 0]
    return np.concatenate((a.reshape(-1, 4), d), axis=1)


def bin_offset(width: int, height: int, binning: int) -> np.ndarray:
    """c of the module docstring: (2,) raw pixels from the binned image's centre to the raw one's."""
    b = int(binning)
    return np.array([(width - b * (width // b)) / 2.0, (height - b * (height // b)) / 2.0])


def _centre_term(z3_deg: np.ndarray, width: int, height: int, binning: int) -> np.ndarray:
    """(n, 2) raw pixels (I - Rz(z3)) c of the binning (module docstring); zero without binning."""
    c = bin_offset(width, height, binning)
    return c - (rot2(z3_deg) @ c[:, None])[..., 0]


def _check_count(k: int, n: int, path: str, what: str) -> None:
    if k != n:
        raise DataFileError(f"{path}: {k} {what}, but the stack has {n} sections; give the alignment file made for "
                            "this stack (it must list every section; drop views with data.exclude_views).")


def _check_shifts(shifts: np.ndarray, width: int, height: int, path: str) -> None:
    worst = float(np.nanmax(np.abs(shifts))) if np.isfinite(shifts).any() else 0.0
    if worst > max(width, height):
        raise DataFileError(f"{path}: shifts of up to {worst:.0f} pixels for a {width} x {height} stack; the file "
                            "belongs to a stack of another size (binned differently?). Give the alignment of this "
                            "stack, in its pixels.")


def _read_xtilt(path: str, n: int) -> float:
    from fasttomo.data.io.imod import read_tilt_file

    values = np.asarray([v for row in read_tilt_file(path, "data.xtilt") for v in row], dtype=np.float64)
    _check_count(values.size, n, path, "X-axis tilts")
    if np.ptp(values) > XTILT_TOLERANCE_DEG:
        raise DataFileError(f"{path}: the X-axis tilt differs between views ({values.min():.3f}..{values.max():.3f} "
                            f"degrees, tolerance {XTILT_TOLERANCE_DEG} degrees); fasttomo's poses hold one X-axis "
                            "tilt at most. Align with one X-axis tilt for the series (tiltalign XTiltOption 0).")
    return float(values.mean())


def _read_aln(path: str, n: int, width: int, height: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(xf (n, 6) with NaN rows for sections AreTomo left out, TILT (n,) likewise, beta offset)."""
    from fasttomo.data.io.aretomo import read_aln

    aln = read_aln(path)
    if aln.raw_size is not None and tuple(aln.raw_size) != (width, height, n):
        w, h, k = aln.raw_size
        raise DataFileError(f"{path}: made for a raw stack of {k} sections of {w} x {h} pixels (# RawSize), but the "
                            f"stack has {n} of {width} x {height}; give the .aln of this stack (AreTomo's pixels "
                            "are those of the stack it read).")
    keep = [i for i in range(n) if i not in set(aln.dark_sections)]
    _check_count(aln.rows.shape[0] + len(set(aln.dark_sections)), n, path, "rows plus left-out sections")
    xf = np.full((n, 6), np.nan)
    tilt = np.full(n, np.nan)
    shifts = np.stack((aln.column("TX"), aln.column("TY")), -1)
    xf[keep] = aln_to_xf(aln.column("ROT"), aln.column("GMAG"), shifts)
    tilt[keep] = aln.column("TILT")
    for i, t in zip(aln.dark_sections, aln.dark_tilts):
        if 0 <= i < n:
            tilt[i] = t
    if aln.num_patches:
        log.info("%s: %d local-alignment patches ignored (fasttomo reads the global alignment).", path,
                 aln.num_patches)
    if aln.alpha_offset:
        log.info("%s: AlphaOffset %.2f degrees (taken as included in the TILT column).", path, aln.alpha_offset)
    return xf, tilt, aln.beta_offset


def read_file_alignment(cfg, n: int, height: int, width: int) -> tuple[dict, np.ndarray | None]:
    """(``metadata['file_alignment']``, the .aln's tilt angles or None) for ``cfg.xf`` /
    ``cfg.aln`` (and ``cfg.xtilt``) and a raw stack of n sections of height x width."""
    from fasttomo.data.io.imod import read_xf

    tilts, xtilt = None, 0.0
    if cfg.xf:
        path = os.fspath(cfg.xf)
        xf = read_xf(path)
        _check_count(xf.shape[0], n, path, "transforms")
        fmt = "imod"
    else:
        path = os.fspath(cfg.aln)
        xf, tilts, xtilt = _read_aln(path, n, width, height)
        fmt = "aretomo"
    ok = np.isfinite(xf).all(axis=1)  # NaN: a section AreTomo left out (checked with the views used)
    z3, shifts = xf_to_poses(np.where(ok[:, None], xf, [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]), path)
    z3[~ok], shifts[~ok] = np.nan, np.nan
    _check_shifts(shifts, width, height, path)
    if cfg.xtilt:
        xtilt = _read_xtilt(os.fspath(cfg.xtilt), n)
    if abs(xtilt) > XTILT_TOLERANCE_DEG:
        log.warning("%s: an X-axis tilt of %.3f degrees for the whole series; the volume comes out un-tilted about X "
                    "(IMOD's tilt would level it by that angle: rotatevol can).", path, xtilt)
    log.info("%s: alignment of %d sections read (%s): rotations %.2f..%.2f degrees, shifts up to %.1f pixels.", path,
             int(ok.sum()), fmt, float(np.nanmin(z3)), float(np.nanmax(z3)), float(np.nanmax(np.abs(shifts))))
    entry = {"source": path, "format": fmt, "raw_width": int(width), "raw_height": int(height),
             "binning": int(cfg.binning), "z3_deg": z3.tolist(), "shift_u_px": shifts[:, 0].tolist(),
             "shift_v_px": shifts[:, 1].tolist(), "xtilt_deg": xtilt}
    return entry, tilts


def view_poses(metadata: dict, view_numbers=None) -> dict | None:
    """The file alignment of the views ``view_numbers`` (1-based file sections; default
    ``metadata['view_numbers']``) as a pose dict in prepared pixels (z1_deg, z3_deg, shift_u_px,
    shift_v_px), or None when the series has no file alignment."""
    fa = metadata.get("file_alignment")
    if not fa:
        return None
    n_file = len(fa["z3_deg"])
    numbers = list(view_numbers if view_numbers is not None else metadata.get("view_numbers") or range(1, n_file + 1))
    idx = np.asarray(numbers, dtype=int) - 1
    z3 = np.asarray(fa["z3_deg"], dtype=np.float64)[idx]
    raw = np.stack((np.asarray(fa["shift_u_px"])[idx], np.asarray(fa["shift_v_px"])[idx]), -1).astype(np.float64)
    missing = [numbers[i] for i in np.flatnonzero(~np.isfinite(z3))]
    if missing:
        raise DataFileError(f"{fa['source']}: no alignment for view(s) {missing} (1-based; left out by the alignment "
                            f"program); add them to data.exclude_views, e.g. data.exclude_views={missing}.")
    b = int(fa["binning"])
    shifts = (raw + _centre_term(z3, fa["raw_width"], fa["raw_height"], b)) / b
    return {"z1_deg": np.zeros(len(numbers)).tolist(), "z3_deg": z3.tolist(), "shift_u_px": shifts[:, 0].tolist(),
            "shift_v_px": shifts[:, 1].tolist()}


def raw_frame(cfg, n: int, height: int, width: int, angles: np.ndarray) -> dict:
    """``metadata['raw_frame']``: what maps a prepared series back onto its stack file (size,
    binning, the file's tilt angles per section, and the crop and tilt-axis rotation that stop it)."""
    a = np.asarray(angles, dtype=np.float64)
    return {"width": int(width), "height": int(height), "n": int(n), "binning": int(cfg.binning),
            "tilt_deg": (a if a.ndim == 1 else a.mean(axis=1)).tolist(), "crop": cfg.crop,
            "tilt_axis_angle": float(cfg.tilt_axis_angle)}


def file_alignment_of(poses: dict, metadata: dict, shape_hw: tuple[int, int]) -> dict:
    """Per section of the stack file, in file order: ``z3_deg`` (N,), ``shifts`` (N, 2) raw pixels,
    ``tilt_deg`` (N,) and ``raw_size`` (W, H, N), from a run's pose dict (``Poses.describe()``,
    the series' views in prepared pixels). Sections the run did not use keep the input file's
    alignment (none: identity) and the file's tilt angle. Raises ValueError with the reason when
    the prepared frame is not the file's up to binning (data.crop, data.tilt_axis_angle)."""
    n_views = len(poses["tilt_deg"])
    rf = metadata.get("raw_frame")
    if not rf:  # no stack file behind the series (a phantom): the files list the run's own views in order
        rf = {"width": shape_hw[1], "height": shape_hw[0], "n": n_views, "binning": 1,
              "tilt_deg": list(poses["tilt_deg"])}
        metadata = {k: v for k, v in metadata.items() if k != "view_numbers"}
    if rf.get("crop") or rf.get("tilt_axis_angle"):
        raise ValueError("the images were cropped or rotated (data.crop, data.tilt_axis_angle), so the poses do not "
                         "map onto the stack file's frame")
    n, b = int(rf["n"]), int(rf["binning"])
    fa = metadata.get("file_alignment") or {}
    z3 = np.nan_to_num(np.asarray(fa.get("z3_deg", np.zeros(n)), dtype=np.float64))
    shifts = np.nan_to_num(np.stack((np.asarray(fa.get("shift_u_px", np.zeros(n)), dtype=np.float64),
                                     np.asarray(fa.get("shift_v_px", np.zeros(n)), dtype=np.float64)), -1))
    tilt = np.asarray(rf["tilt_deg"], dtype=np.float64).copy()
    idx = np.asarray(metadata.get("view_numbers") or range(1, n_views + 1), dtype=int) - 1
    learned = np.stack((np.asarray(poses["shift_u_px"]), np.asarray(poses["shift_v_px"])), -1).astype(np.float64)
    z3[idx] = np.asarray(poses["z3_deg"], dtype=np.float64)
    shifts[idx] = learned * b - _centre_term(z3[idx], rf["width"], rf["height"], b)
    tilt[idx] = np.asarray(poses["tilt_deg"], dtype=np.float64)
    z1 = np.abs(np.asarray(poses.get("z1_deg", [0.0]), dtype=np.float64))
    if z1.max() > 0.01:
        log.warning("poses: z1 (up to %.3f degrees) has no place in .xf/.aln files and is left out of them.",
                    float(z1.max()))
    return {"z3_deg": z3, "shifts": shifts, "tilt_deg": tilt, "raw_size": (int(rf["width"]), int(rf["height"]), n)}


def write_alignment_files(base: str | os.PathLike, poses: dict, metadata: dict, shape_hw: tuple[int, int],
                          overwrite: bool = False) -> list[str]:
    """Write ``<base>.xf``, ``<base>.tlt`` and ``<base>.aln`` for the stack file (see
    :func:`file_alignment_of`; each atomically). Returns the paths."""
    from fasttomo.data.io.aretomo import write_aln
    from fasttomo.data.io.imod import write_tilt_file, write_xf

    fa = file_alignment_of(poses, metadata, shape_hw)
    base = os.fspath(base)
    return [write_xf(base + ".xf", poses_to_xf(fa["z3_deg"], fa["shifts"]), overwrite=overwrite),
            write_tilt_file(base + ".tlt", fa["tilt_deg"], overwrite=overwrite),
            write_aln(base + ".aln", np.column_stack((-fa["z3_deg"], fa["shifts"], fa["tilt_deg"])), fa["raw_size"],
                      overwrite=overwrite)]
