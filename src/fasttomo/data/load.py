"""``load_tiltseries(cfg)``: the one entry from a DataConfig to a validated TiltSeries.

For ``source=phantom`` the built-in phantom (:func:`fasttomo.data.phantom.make_tiltseries`) is
returned as simulated (no preparation). For ``mrc``, ``hdf5`` and ``tiff``:

 1. Read the stack (suffix must match ``data.source``; dimensionality must be 3).
 2. Convert to float32. Integer data is converted exactly, its min/median/max are logged, and
    ``data.intensity_offset`` (if set) is subtracted -- nothing is guessed.
 3. Angles: ``data.angles`` (.rawtlt/.tlt, or SerialEM .mdoc) if given, else the MRC extended header
    (FEI1/FEI2/legacy FEI/SERI) or the HDF5 angle dataset/attribute. Their count must equal the
    number of sections.
 4. Pixel size (Angstrom), first found of: ``data.pixel_size``; the file header (MRC cell/mx unless it
    is IMOD's unset default 1.0, HDF5 ``data.hdf5_pixel_size``, TIFF resolution); the extended header
    (FEI, metres converted); the .mdoc PixelSpacing; the header's 1.0; else 1.0 A is assumed with a
    warning. Non-square pixels are an error.
 5. :func:`fasttomo.data.prepare.prepare` (exclusion, rotation, binning, cropping, dark views,
    sorting, inversion, normalization -- in that order, see there).
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np

from fasttomo.data.io import DataFileError, source_from_suffix
from fasttomo.data.prepare import RawSeries, prepare
from fasttomo.data.tiltseries import TiltSeries

log = logging.getLogger("fasttomo.data")


def load_tiltseries(cfg) -> TiltSeries:
    """Read (or simulate) and prepare the tilt series described by ``cfg`` (a DataConfig)."""
    if cfg.source == "phantom":
        from fasttomo.data.phantom import make_tiltseries

        ts = make_tiltseries(cfg)
        log.info("phantom tilt series: %d tilts of %d x %d pixels, %.4g A/pixel, angles %.1f..%.1f degrees.",
                 ts.n_tilts, ts.height, ts.width, ts.pixel_size, float(np.min(ts.angles)), float(np.max(ts.angles)))
        return ts
    raw = read_raw(cfg)
    ts = prepare(raw, cfg)
    if "file_alignment" in ts.metadata:  # every view used has an alignment (else: which to exclude)
        from fasttomo.data.io.alignment import view_poses

        view_poses(ts.metadata)
    log.info("%s: prepared %d tilts of %d x %d pixels (%s angles %.2f..%.2f degrees), %.4g A/pixel%s.",
             ts.source, ts.n_tilts, ts.height, ts.width, "per-line" if ts.per_line_angles else "per-view",
             float(np.min(ts.angles)), float(np.max(ts.angles)), ts.pixel_size,
             "" if ts.valid is None else f", {int((~ts.valid).sum())} pixels masked")
    return ts


def to_float32(data: np.ndarray, offset: float | None, where: str) -> np.ndarray:
    """Exact float32 conversion; integer data gets the optional offset subtracted and its stats logged."""
    if np.issubdtype(data.dtype, np.integer):
        sample = data.ravel()[:: max(1, data.size // 2_000_000)]
        log.info("%s: %s integer data: min %d, median %g (of %d sampled values), max %d.", where, data.dtype,
                 int(data.min()), float(np.median(sample)), sample.size, int(data.max()))
        out = data.astype(np.float32)
        if offset is not None:
            out -= np.float32(offset)
            log.info("%s: subtracted data.intensity_offset = %g.", where, offset)
        else:
            log.info("%s: no intensity offset subtracted (set data.intensity_offset if the camera adds one).", where)
        return out
    if not np.issubdtype(data.dtype, np.floating):
        raise DataFileError(f"{where}: data type {data.dtype} cannot be used; give real-valued (integer or float) data.")
    if offset is not None:
        log.warning("%s: data.intensity_offset=%g ignored: it applies to integer data and this stack is %s.", where,
                    offset, data.dtype)
    return np.ascontiguousarray(data, dtype=np.float32)


def _check_stack_shape(data: np.ndarray, where: str) -> None:
    if data.ndim != 3:
        extra = " (a single image is not a tilt series)" if data.ndim == 2 else ""
        raise DataFileError(f"{where}: the data has shape {data.shape} ({data.ndim}-D){extra}; a tilt series must be a "
                            "3-D stack (n_tilts, H, W). Give the stack file (e.g. the .st or .ali).")


def _read_mrc_stack(cfg, path: str):
    """(the MRC file read, its square pixel size from the header or None); logs its notes and
    refuses a stack that is not 3-D or has anisotropic pixels (unless data.pixel_size is set)."""
    from fasttomo.data.io.mrc import read_mrc

    m = read_mrc(path)
    for note in m.notes:
        log.warning("%s: %s", path, note)
    _check_stack_shape(m.data, path)
    log.info("%s: MRC mode %d, %d sections of %d x %d%s.", path, m.mode, *m.data.shape,
             f", {m.ext_type} extended header" if m.ext_type else "")
    if m.voxel_size is None:
        return m, None
    vx, vy, _ = m.voxel_size
    if cfg.pixel_size is None and not math.isclose(vx, vy, rel_tol=1e-4):
        raise DataFileError(f"{path}: anisotropic pixel size x = {vx:.6g} A, y = {vy:.6g} A; fasttomo needs "
                            "square pixels. Resample the stack, or set data.pixel_size if the header is wrong.")
    return m, vx


def read_raw(cfg) -> RawSeries:
    """Read stack, angles and pixel size as the module docstring says (no preparation yet)."""
    path = os.fspath(cfg.path)
    if not os.path.exists(path):
        raise DataFileError(f"{path}: file not found; check data.path.")
    if os.path.isdir(path):  # before the suffix check, which would call it a file of unknown type
        raise DataFileError(f"{path}: is a directory; give the tilt-series file in it as data.path.")
    kind = source_from_suffix(path)
    if kind != cfg.source:
        raise DataFileError(f"{path}: data.source={cfg.source} but the suffix says {kind}; use data={kind} "
                            f"(or data.source={kind}).")
    header_pix: float | None = None  # from the file header
    ext_pix: float | None = None
    file_axis: float | None = None
    meta: dict = {"stack_file": path}
    angles = valid = gt = None
    angle_source, angles_hint = None, ""
    if kind == "mrc":
        m, header_pix = _read_mrc_stack(cfg, path)
        data = m.data
        ext_pix, file_axis = m.ext_pixel_size, m.ext_tilt_axis
        if m.ext_angles is not None:
            angles, angle_source = m.ext_angles, f"the {m.ext_type} extended header of {path}"
        meta["mrc_labels"] = m.labels
    elif kind == "hdf5":
        from fasttomo.data.io.hdf5 import read_stack_h5

        h = read_stack_h5(path, cfg.hdf5_stack, cfg.hdf5_angles, cfg.hdf5_pixel_size)
        for note in h.notes:  # what was found is said below; a value it ignored is a warning
            (log.warning if "ignored" in note else log.info)("%s: %s", path, note)
        data, header_pix, valid, gt = h.data, h.pixel_size, h.valid, h.ground_truth
        meta.update({k: v for k, v in h.metadata.items() if k not in ("preparation", "view_numbers",
                                                                     "sort_permutation", "file_alignment",
                                                                     "raw_frame")})
        if h.angles is not None:
            angles, angle_source = h.angles, f"{h.angles_where} in {path}"
        angles_hint = h.angles_hint
    else:
        from fasttomo.data.io.tiff import read_tiff

        data, header_pix, _ = read_tiff(path)
        _check_stack_shape(data, path)
    n, height = data.shape[0], data.shape[1]
    mdoc_pix = aln_tilts = None
    if getattr(cfg, "xf", None) or getattr(cfg, "aln", None):
        from fasttomo.data.io.alignment import read_file_alignment

        meta["file_alignment"], aln_tilts = read_file_alignment(cfg, n, height, data.shape[2])
    if cfg.angles:
        own, own_source = angles, angle_source  # the stack file's own angles, if it carries any
        angles, angle_source, mdoc_pix, mdoc_axis = _read_angle_file(cfg.angles, n, height, path)
        file_axis = mdoc_axis if mdoc_axis is not None else file_axis
        _compare_angles(angles, angle_source, own, own_source)
    elif aln_tilts is not None:
        angles, angle_source = aln_tilts, f"the TILT column of {cfg.aln}"
    elif angles is None:
        raise DataFileError(f"{path}: no tilt angles: {angles_hint or 'the file carries none.'} {_sibling_hint(path)}")
    else:
        angles = np.asarray(angles, dtype=np.float64)
        if angles.shape[0] != n or angles.ndim not in (1, 2) or (angles.ndim == 2 and angles.shape[1] != height):
            raise DataFileError(f"{angle_source}: angles of shape {angles.shape} for a stack of {n} sections of "
                                f"{height} lines; need ({n},) or ({n}, {height}). Fix the file or give "
                                f"data.angles.{_tilts_last(angles, data.shape)}")
    stack = to_float32(data, cfg.intensity_offset, path)
    pixel = _pixel_size(cfg, path, header_pix, ext_pix, mdoc_pix, meta)
    _check_pixel_size(pixel, meta["pixel_size_source"], path, data.shape)
    if file_axis is not None:
        meta["file_tilt_axis_angle"] = file_axis
        if abs(file_axis - cfg.tilt_axis_angle) > 0.5 and "file_alignment" not in meta:
            log.warning("%s: the acquisition metadata gives a tilt-axis angle of %.2f degrees, data.tilt_axis_angle="
                        "%.2f is used. For a raw (unaligned) stack set data.tilt_axis_angle=%.2f; an aligned .ali "
                        "already has the axis along Y.", path, file_axis, cfg.tilt_axis_angle, file_axis)
    meta["angle_source"] = angle_source
    from fasttomo.data.io.alignment import raw_frame

    meta["raw_frame"] = raw_frame(cfg, n, height, data.shape[2], angles)
    log.info("%s: %d angles from %s.", path, n, angle_source)
    return RawSeries(stack=stack, angles=angles, pixel_size=pixel, source=path, angle_source=angle_source,
                     valid=valid, ground_truth=gt, metadata=meta)


def _tilts_last(angles: np.ndarray, shape: tuple[int, ...]) -> str:
    """The hint for a stack stored (H, W, n_tilts): its last axis as long as the angle list."""
    if angles.ndim == 1 and angles.shape[0] == shape[2] != shape[0]:
        return (f" The stack's last axis has {shape[2]} entries, as many as the angles: is it stored (H, W, "
                "n_tilts)? Store it as (n_tilts, H, W) (numpy: np.moveaxis(stack, -1, 0)).")
    return ""


PLAUSIBLE_PIXEL_A = (0.01, 1e6)
"""Pixel sizes (Angstrom) outside this range are used with a warning: electron tomography's run
from under 1 A to a few hundred, X-ray tomography's to micrometres."""


def _check_pixel_size(pixel: float, source: str, path: str, shape: tuple[int, ...]) -> None:
    """Refuse a pixel size the volume's MRC header cannot hold (its cell is float32 Angstrom);
    warn about one far outside what a tilt series has."""
    with np.errstate(over="ignore"):
        fits = bool(np.isfinite(np.float32(pixel) * np.float32(16 * max(shape)))) and np.float32(pixel) > 0
    if not fits:
        raise DataFileError(f"{path}: pixel size {pixel:.6g} A (from {source}) does not fit a volume header (MRC "
                            "cells are 32-bit floats in Angstrom); set data.pixel_size=<Angstrom>.")
    lo, hi = PLAUSIBLE_PIXEL_A
    if not lo <= pixel <= hi:
        log.warning("%s: pixel size %.6g A (from %s) is outside %g..%g A, where tomograms' pixel sizes lie; the "
                    "volume's header and scale bars use it. If it is wrong, set data.pixel_size=<Angstrom>.",
                    path, pixel, source, lo, hi)


ANGLES_DISAGREE_DEG = 2.0
"""data.angles and the stack file's own angles differing by more than this (refined angles move
less) are said in a warning."""


def _compare_angles(given: np.ndarray, given_source: str, own, own_source: str | None) -> None:
    """Warn when data.angles contradicts the angles the stack file itself carries (an extended
    header, an HDF5 dataset): another order, or other values. data.angles is used either way."""
    if own is None:
        return
    own = np.asarray(own, dtype=np.float64)
    if own.shape != given.shape or given.ndim != 1:
        return
    diff = np.abs(given - own)
    if not np.isfinite(diff).all() or diff.max() <= ANGLES_DISAGREE_DEG:
        return
    if np.abs(np.sort(given) - np.sort(own)).max() <= ANGLES_DISAGREE_DEG:
        how = "the same angles in another order"
    else:
        k = int(np.argmax(diff))
        how = (f"they differ by up to {diff.max():.4g} degrees (section {k + 1}: {given[k]:.4g} against "
               f"{own[k]:.4g})")
    log.warning("%s and %s give the sections different tilt angles: %s. %s is used; if the stack's own angles are "
                "the right ones, leave data.angles out.", given_source, own_source, how, given_source)


def _sibling_hint(path: str) -> str:
    stem = os.path.splitext(path)[0]
    found = [p for p in (stem + ".tlt", stem + ".rawtlt", path + ".mdoc", stem + ".mdoc") if os.path.exists(p)]
    if found:
        return f"Found {found[0]} next to it: set data.angles={found[0]}."
    return "Give the angle file: data.angles=<file.rawtlt|.tlt|.mdoc>."


def _read_angle_file(angle_path, n: int, height: int, stack_path: str):
    from fasttomo.data.io import imod

    angle_path = os.fspath(angle_path)
    if angle_path.lower().endswith(".mdoc"):
        info = imod.read_mdoc(angle_path)
        if info.angles.size != n:
            raise DataFileError(f"{angle_path}: {info.angles.size} sections (TiltAngle entries) but the stack "
                                f"{stack_path} has {n}; give the .mdoc that belongs to this stack.")
        return info.angles, angle_path, info.pixel_size, info.tilt_axis_angle
    if not angle_path.lower().endswith((".rawtlt", ".tlt", ".txt")):
        raise DataFileError(f"{angle_path}: unknown angle-file suffix; data.angles takes .rawtlt, .tlt (degrees, one "
                            "or many per line) or a SerialEM .mdoc.")
    rows = imod.read_tilt_file(angle_path)
    return imod.angles_for_stack(rows, n, height, angle_path, stack_path), angle_path, None, None


def _pixel_size(cfg, path: str, header: float | None, ext: float | None, mdoc: float | None, meta: dict) -> float:
    candidates = [("data.pixel_size", cfg.pixel_size),
                  ("the file header", header if header is not None and header != 1.0 else None),
                  ("the extended header", ext), ("the .mdoc PixelSpacing", mdoc)]
    for name, value in candidates:
        if value is not None and value > 0:
            others = [f"{n2} {v2:.6g}" for n2, v2 in candidates if n2 != name and v2 and not
                      math.isclose(v2, value, rel_tol=1e-3)]
            log.info("%s: pixel size %.6g A from %s%s.", path, value, name,
                     f" (differs from {', '.join(others)})" if others else "")
            meta["pixel_size_source"] = name
            return float(value)
    if header == 1.0:
        log.warning("%s: the header pixel size is 1.0 A, IMOD's value for 'unset'; using it. Set data.pixel_size=<A> "
                    "if that is wrong.", path)
        meta["pixel_size_source"] = "the file header (1.0, possibly unset)"
        return 1.0
    log.warning("%s: no pixel size in the file or config; assuming 1.0 A per pixel. Set data.pixel_size=<Angstrom> "
                "for a correctly scaled volume.", path)
    meta["pixel_size_source"] = "assumed"
    meta["pixel_size_assumed"] = True
    return 1.0
