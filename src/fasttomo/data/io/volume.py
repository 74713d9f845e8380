"""Volume files: MRC (float32, voxel size in Angstrom), HDF5 (with attributes) and TIFF stacks.

Orientation. The volume array is (Z, Y, X): Z the beam direction at 0 degrees, Y the tilt axis
(see README "Geometry conventions"). It is written unchanged (MRC nx = X, ny = Y, nz = Z), which is
IMOD's final, reoriented frame (as after ``trimvol -rx``) and opens in 3dmod with IMOD's handedness.

``imod_xzy=True`` (MRC only) writes instead IMOD's un-rotated orientation, as ``tilt`` writes it
before ``trimvol -rx``: sections along Y, image rows along Z. It is the rotation of the volume by
+90 degrees about X, ``F = np.rot90(V, k=-1, axes=(0, 1))``, i.e. ``F[y, j, x] = V[Z-1-j, y, x]`` --
a rotation (determinant +1), never a transpose (a transpose mirrors). ``trimvol -rx`` (a -90 degree
rotation about X) brings it back; :func:`read_volume` undoes it from the file's label.

Sources: the MRC2014 format (Cheng et al., J. Struct. Biol. 192, 2015) and IMOD's description of
it (bio3d.colorado.edu/imod/doc/mrc_format.txt: header, modes, SERI/FEI extended headers, the IMOD
stamp and its signed-bytes flag); IMOD's tilt and trimvol manual pages for the XZY output of tilt
and the -rx rotation; mrcfile's documentation for FEI1/FEI2 extended-header fields.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from fasttomo import __version__
from fasttomo.data.io.common import DataFileError, _fmt, file_size, source_from_suffix

log = logging.getLogger("fasttomo.data")
XZY_LABEL = "fasttomo orientation=XZY (IMOD un-rotated; trimvol -rx gives ZYX)"


def to_imod_xzy(volume_zyx: np.ndarray) -> np.ndarray:
    """(Z, Y, X) -> IMOD's un-rotated (Y, Z', X) layout by a +90 degree rotation about X."""
    return np.ascontiguousarray(np.rot90(volume_zyx, k=-1, axes=(0, 1)))


def from_imod_xzy(volume_xzy: np.ndarray) -> np.ndarray:
    """Inverse of :func:`to_imod_xzy` (the -90 degree rotation about X of ``trimvol -rx``)."""
    return np.ascontiguousarray(np.rot90(volume_xzy, k=1, axes=(0, 1)))


SLAB_BYTES = 256 << 20
"""Bytes of float32 a volume file is written in at a time from an array or a memory map."""


def array_slabs(vol: np.ndarray, planes: int | None = None):
    """(z0, planes z0..) of ``vol`` in slabs of ``planes`` Z planes (default: ~:data:`SLAB_BYTES`),
    as float32 views where possible, so a memory-mapped volume is paged in one slab at a time."""
    per = planes or max(1, SLAB_BYTES // max(1, 4 * vol.shape[1] * vol.shape[2]))
    for z0 in range(0, vol.shape[0], per):
        yield z0, np.asarray(vol[z0:z0 + per], dtype=np.float32)


def xzy_slabs(vol: np.ndarray, planes: int | None = None):
    """The planes of :func:`to_imod_xzy` of ``vol`` (one per Y of ``vol``), slab by slab: the same
    values, without rotating the whole volume in memory."""
    per = planes or max(1, SLAB_BYTES // max(1, 4 * vol.shape[0] * vol.shape[2]))
    for y0 in range(0, vol.shape[1], per):
        yield y0, np.rot90(np.asarray(vol[:, y0:y0 + per], dtype=np.float32), k=-1, axes=(0, 1))


def _check_volume(path, volume_zyx: np.ndarray, voxel_size_A: float) -> np.ndarray:
    """The volume as float32 (Z, Y, X); a float32 array or memory map is passed on uncopied."""
    vol = volume_zyx if isinstance(volume_zyx, np.ndarray) else np.asarray(volume_zyx)
    if vol.ndim != 3:
        raise DataFileError(f"{path}: a volume must be 3-D (Z, Y, X), got shape {vol.shape}.")
    if not np.isfinite(voxel_size_A) or voxel_size_A <= 0:
        raise DataFileError(f"{path}: voxel size must be a positive number of Angstrom, got {voxel_size_A!r}.")
    return vol if vol.dtype == np.float32 else vol.astype(np.float32)


def mrc_label(label: str) -> str:
    """The MRC label of a volume named ``label`` (see :func:`write_volume`)."""
    if label.startswith("fasttomo "):
        return f"fasttomo {__version__} {label[len('fasttomo '):].strip()}"
    return f"fasttomo {__version__} run {label}"


def write_volume(path: str | os.PathLike, volume_zyx: np.ndarray, voxel_size_A: float, *, label: str,
                 attrs: dict, fmt: str, overwrite: bool = False, imod_xzy: bool = False) -> str:
    """Write a (Z, Y, X) float32 volume as ``fmt`` (mrc, h5 or tiff), atomically; returns the path.

    ``label`` names the run (MRC label "fasttomo <version> run <label>", HDF5/TIFF attribute; a
    label that starts with "fasttomo " describes the volume itself: "fasttomo <version> <rest>");
    ``attrs`` (JSON-serializable, e.g. ``{"config": {...}}``) go to HDF5/TIFF attributes. An
    existing file is refused unless ``overwrite``.
    """
    fmt = _fmt(path, fmt)
    vol = _check_volume(path, volume_zyx, float(voxel_size_A))
    if imod_xzy and fmt != "mrc":
        raise DataFileError(f"{path}: imod_xzy orientation is only written as MRC (IMOD's format); use fmt='mrc'.")
    if fmt == "mrc":
        from fasttomo.data.io.mrc import MrcHeader, write_mrc_slabs

        header = MrcHeader(voxel_size_A, (mrc_label(label),), False,
                           (XZY_LABEL,) if imod_xzy else ())
        shape = (vol.shape[1], vol.shape[0], vol.shape[2]) if imod_xzy else vol.shape
        slabs = xzy_slabs(vol) if imod_xzy else array_slabs(vol)
        out = write_mrc_slabs(path, shape, slabs, header, overwrite=overwrite)
    elif fmt == "h5":
        from fasttomo.data.io.hdf5 import write_volume_h5

        out = write_volume_h5(path, vol, voxel_size_A, label=label, attrs=attrs, overwrite=overwrite)
    else:
        from fasttomo.data.io.tiff import write_tiff

        out = write_tiff(path, vol, voxel_size_A, attrs={"label": label, **(attrs or {})}, overwrite=overwrite)
    log.info("wrote %s volume %s (Z, Y, X = %s, voxel %.4g A%s)", fmt, out, vol.shape, voxel_size_A,
             ", IMOD XZY orientation" if imod_xzy else "")
    return out


def map_volume(path: str | os.PathLike, key: str = "evaluation.truth") -> np.ndarray | None:
    """A read-only memory map (Z, Y, X) of a float32 MRC volume, its pages read as they are used
    (a camera-sized truth is never held whole); None where the file cannot be mapped as it is (not
    MRC, another mode, fasttomo's XZY orientation): :func:`read_volume` reads those. A file that
    cannot be opened is an error naming ``key``, the setting that gave it (by default the one
    volume a run maps: its ground truth)."""
    import warnings

    import mrcfile
    import mrcfile.utils

    path = os.fspath(path)
    kind = source_from_suffix(path)
    if kind != "mrc":
        file_size(path, kind.upper(), key)  # missing or unreadable: said here, where the setting is known
        return None
    from fasttomo.data.io.mrc import mrc_memmap

    vol = mrc_memmap(path, key)
    if vol is None or vol.ndim != 3 or vol.dtype != np.dtype(np.float32):  # a byte-swapped file is read
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mrcfile.open(path, header_only=True, permissive=True) as m:
            h = m.header
            labels = [mrcfile.utils.printable_string_from_bytes(b).strip() for b in h.label[: int(h.nlabl)]]
    return None if any(lab.startswith("fasttomo orientation=XZY") for lab in labels) else vol


def read_volume(path: str | os.PathLike, key: str = "the path") -> tuple[np.ndarray, float, dict]:
    """(volume_zyx float32, voxel_size_A, attrs) from an MRC, HDF5 or TIFF volume.

    A missing voxel size is a warning and 1.0 A is assumed (``attrs['voxel_size_assumed']`` is
    True); an anisotropic one is an error. fasttomo's XZY files are rotated back to (Z, Y, X).
    ``key`` names the file's setting (e.g. evaluation.truth) in errors.
    """
    path = os.fspath(path)
    kind = source_from_suffix(path)
    attrs: dict = {}
    if kind == "mrc":
        from fasttomo.data.io.mrc import read_mrc

        m = read_mrc(path, key)
        vol = m.data
        if vol.ndim != 3:
            raise DataFileError(f"{path}: MRC data has shape {vol.shape}; a volume must be 3-D.")
        attrs["labels"] = m.labels
        if any(lab.startswith("fasttomo orientation=XZY") for lab in m.labels):
            vol = from_imod_xzy(vol)
            attrs["orientation"] = "XZY"
        vx = None
        if m.voxel_size is not None:
            sizes = np.asarray(m.voxel_size)
            if np.ptp(sizes) > 1e-5 * sizes.max():
                raise DataFileError(f"{path}: anisotropic voxel size (x, y, z) = {tuple(sizes.tolist())} A; fasttomo "
                                    "volumes are isotropic. Resample the volume first.")
            vx = float(sizes[0])
    elif kind == "hdf5":
        from fasttomo.data.io.hdf5 import read_volume_h5

        vol, vx, attrs = read_volume_h5(path, key)
    else:
        from fasttomo.data.io.tiff import read_tiff

        vol, vx, attrs = read_tiff(path, key)
        if vol.ndim != 3:
            raise DataFileError(f"{path}: TIFF data has shape {vol.shape}; a volume must be a 3-D stack.")
    if vx is None:
        log.warning("%s: no voxel size in the file; assuming 1.0 A per voxel.", path)
        vx, attrs["voxel_size_assumed"] = 1.0, True
    return np.ascontiguousarray(vol, dtype=np.float32), float(vx), attrs
