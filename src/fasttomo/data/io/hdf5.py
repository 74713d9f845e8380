"""HDF5 tilt series (fasttomo's layout or any user-named datasets) and HDF5 volumes.

fasttomo tilt-series layout (written by :func:`write_tiltseries_h5`, read by default)::

    /tiltseries                 group; attrs: format="fasttomo-tiltseries", version=1,
                                pixel_size_A (float, Angstrom), units="angstrom",
                                angle_units="degrees", axis_order="tilt,y,x" (rows = tilt axis),
                                source (str), metadata (JSON string)
    /tiltseries/stack           (n_tilts, H, W) float32 projections
    /tiltseries/angles          (n_tilts,) or (n_tilts, H) float64, degrees (attr units="degrees")
    /tiltseries/valid           optional (n_tilts, H, W) bool; False = pixel to ignore
    /ground_truth/volume        optional (Z, H, W) float32 (synthetic data); attrs voxel_size_A,
                                axis_order="z,y,x"

Other files: ``data.hdf5_stack`` names the stack dataset, ``data.hdf5_angles`` a dataset path or
an attribute name (looked up on the stack dataset, then its parent groups up to the root), and
``data.hdf5_pixel_size`` the same for the pixel size in Angstrom.

Volume layout (:func:`write_volume_h5`): dataset ``/volume`` (Z, Y, X) float32 with attrs
voxel_size (Angstrom), units="angstrom", axis_order="ZYX", label, config (JSON string, when
given), fasttomo_attrs (JSON of every attribute passed, for an exact round trip).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from fasttomo.data.io.common import DataFileError, file_size
from fasttomo.data.io.atomic import atomic_write

FORMAT = "fasttomo-tiltseries"
VOLUME_DATASET = "/volume"


def _open(path: str, key: str) -> h5py.File:
    size = file_size(path, "HDF5", key)
    try:
        return h5py.File(path, "r")
    except OSError as err:
        msg = str(err)
        if "unable to lock file" in msg:  # HDF5 locks a file open for writing (h5py mode 'a'/'w', a Jupyter kernel)
            raise DataFileError(
                f"{path}: the HDF5 file is open (locked) by another program, which may be writing it; close it there "
                "(e.g. the notebook or viewer that holds it) and run again, or set the environment variable "
                "HDF5_USE_FILE_LOCKING=FALSE to read it anyway.") from None
        m = re.search(r"eof = (\d+).*stored_eof = (\d+)", msg)
        if m:
            raise DataFileError(
                f"{path}: truncated HDF5 file: it should be {int(m.group(2))} bytes but has {int(m.group(1))} "
                f"(file size {size}). The copy or export was interrupted; copy the file again."
            ) from None
        raise DataFileError(f"{path}: not a readable HDF5 file ({msg}; file size {size} bytes). The file is "
                            "corrupt or of another type; check data.path and data.source.") from None


def _read_dataset(path: str, ds: h5py.Dataset) -> np.ndarray:
    try:
        return ds[()]
    except (OSError, ValueError) as err:
        raise DataFileError(
            f"{path}: dataset {ds.name} {ds.shape} {ds.dtype} cannot be read ({err}); the file is truncated or "
            f"corrupt (expected {ds.size * ds.dtype.itemsize} data bytes, file size {os.path.getsize(path)}). "
            "Copy the file again."
        ) from None


def _numbers(value: Any, where: str) -> tuple[np.ndarray | None, str]:
    """(``value`` as float64 numbers, "") or (None, what ``where`` holds instead: a text such as
    '10 A', a compound or string dataset)."""
    try:
        return np.asarray(value, dtype=np.float64), ""
    except (TypeError, ValueError):
        shown = repr(value) if np.size(value) <= 3 else f"{np.shape(value)} {getattr(value, 'dtype', type(value))}"
        return None, f"{where} holds {shown}, not numbers"


def _lookup(f: h5py.File, stack: h5py.Dataset, name: str) -> tuple[Any, str] | None:
    """A named dataset, or an attribute on the stack or one of its parents; (value, where) or None."""
    if name in f and isinstance(f[name], h5py.Dataset):
        return f[name], f"dataset {f[name].name}"
    key = name.rsplit("/", 1)[-1]
    obj = stack
    while True:
        if key in obj.attrs:
            return obj.attrs[key], f"attribute {key!r} of {obj.name}"
        if obj.name == "/":
            return None
        obj = obj.parent


@dataclass
class H5Stack:
    data: np.ndarray
    angles: np.ndarray | None
    pixel_size: float | None
    valid: np.ndarray | None
    ground_truth: np.ndarray | None
    metadata: dict
    notes: list[str]
    angles_hint: str = ""
    """Where the angles were looked for, when none were found (for the error that follows)."""
    angles_where: str = ""
    """Where the angles were found: 'dataset /a/b' or "attribute 'angles' of /a"."""


def read_stack_h5(path: str | os.PathLike, stack_path: str = "/tiltseries/stack",
                  angles_path: str = "/tiltseries/angles", pixel_size_name: str = "pixel_size_A",
                  key: str = "data.path") -> H5Stack:
    """Read a tilt stack and (if present) its angles, pixel size, validity mask and ground truth
    from the file ``key`` gives."""
    path = os.fspath(path)
    notes: list[str] = []
    with _open(path, key) as f:
        if stack_path not in f or not isinstance(f[stack_path], h5py.Dataset):
            found: list[str] = []
            f.visititems(lambda n, o: found.append(f"/{n} {o.shape}") if isinstance(o, h5py.Dataset) else None)
            raise DataFileError(
                f"{path}: no dataset {stack_path!r}; the file holds {found[:10] or 'no datasets'}. Set "
                "data.hdf5_stack=<dataset path> to the (n_tilts, H, W) stack."
            )
        ds = f[stack_path]
        if ds.ndim != 3:
            raise DataFileError(f"{path}: dataset {stack_path} has shape {ds.shape} ({ds.ndim}-D); a tilt series "
                                "must be 3-D (n_tilts, H, W). Point data.hdf5_stack at the stack.")
        data = _read_dataset(path, ds)
        angles, angles_hint, angles_where = None, "", ""
        hit = _lookup(f, ds, angles_path)
        if hit is not None:
            value, where = hit
            angles, bad = _numbers(_read_dataset(path, value) if isinstance(value, h5py.Dataset) else value, where)
            if angles is not None:
                angles_where = where
            else:  # an error only if no other source of angles is given (load.py)
                angles_hint = (f"{bad} (tilt angles in degrees): store plain numbers there, or set "
                               "data.hdf5_angles=<dataset path>.")
        else:
            found: list[str] = []
            f.visititems(lambda n, o: found.append(f"/{n} {o.shape}") if isinstance(o, h5py.Dataset) else None)
            angles_hint = (f"No dataset {angles_path!r} and no attribute {angles_path.rsplit('/', 1)[-1]!r} on the "
                           f"stack or its groups; the file holds {found[:10]}. If the angles are one of them, set "
                           "data.hdf5_angles=<dataset path>.")
        pix = None
        hit = _lookup(f, ds, pixel_size_name)
        if hit is not None:
            value, where = hit
            value = _read_dataset(path, value) if isinstance(value, h5py.Dataset) else value
            arr, bad = _numbers(value, where)
            if arr is not None and arr.size > 1 and np.ptp(arr) > 1e-9 * abs(arr).max():
                raise DataFileError(f"{path}: {where} gives an anisotropic pixel size {arr.tolist()}; fasttomo needs "
                                    "square pixels. Resample the data, or set data.pixel_size to override.")
            pix = float(arr.flat[0]) if arr is not None and arr.size else math.nan
            if math.isfinite(pix) and pix > 0:
                notes.append(f"pixel size from {where}")
            else:  # load.py then warns that it assumes 1.0 unless data.pixel_size is set
                notes.append(f"{bad} (a pixel size in Angstrom); ignored" if bad
                             else f"{where} holds {pix}, not a pixel size in Angstrom; ignored")
                pix = None
        group = ds.parent
        valid = _read_dataset(path, group["valid"]).astype(bool) if "valid" in group and group.attrs.get(
            "format") == FORMAT else None
        gt = _read_dataset(path, f["/ground_truth/volume"]) if "/ground_truth/volume" in f else None
        metadata: dict = {}
        if "metadata" in group.attrs:
            try:
                metadata = json.loads(group.attrs["metadata"])
            except (TypeError, ValueError):
                notes.append("metadata attribute is not JSON; ignored")
    return H5Stack(data=data, angles=angles, pixel_size=pix, valid=valid, ground_truth=gt, metadata=metadata,
                   notes=notes, angles_hint=angles_hint, angles_where=angles_where)


def write_tiltseries_h5(path: str | os.PathLike, ts, overwrite: bool = False) -> str:
    """Write a TiltSeries in fasttomo's layout (module docstring), atomically."""

    def _write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            g = f.create_group("tiltseries")
            g.attrs.update(format=FORMAT, version=1, pixel_size_A=float(ts.pixel_size), units="angstrom",
                           angle_units="degrees", axis_order="tilt,y,x", source=str(ts.source),
                           metadata=json.dumps(ts.metadata, default=_json_default))
            g.create_dataset("stack", data=np.ascontiguousarray(ts.stack, dtype=np.float32))
            a = g.create_dataset("angles", data=np.asarray(ts.angles, dtype=np.float64))
            a.attrs["units"] = "degrees"
            if ts.valid is not None:
                g.create_dataset("valid", data=ts.valid)
            if ts.ground_truth is not None:
                v = f.create_group("ground_truth").create_dataset("volume", data=ts.ground_truth)
                v.attrs.update(voxel_size_A=float(ts.pixel_size), axis_order="z,y,x")

    return atomic_write(path, _write, overwrite=overwrite)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


def write_volume_h5(path: str | os.PathLike, volume: np.ndarray, voxel_size: float, *, label: str,
                    attrs: dict, overwrite: bool = False) -> str:
    """Write a (Z, Y, X) float32 volume with its attributes (module docstring), atomically."""
    arr = np.ascontiguousarray(volume, dtype=np.float32)

    def _write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            d = f.create_dataset(VOLUME_DATASET, data=arr)
            d.attrs.update(voxel_size=float(voxel_size), units="angstrom", axis_order="ZYX", label=str(label),
                           fasttomo_attrs=json.dumps(attrs or {}, default=_json_default))
            if attrs and "config" in attrs:
                d.attrs["config"] = json.dumps(attrs["config"], default=_json_default)

    return atomic_write(path, _write, overwrite=overwrite)


def read_volume_h5(path: str | os.PathLike, key: str = "the path") -> tuple[np.ndarray, float | None, dict]:
    """(volume_zyx, voxel_size_A or None, attrs) from an HDF5 volume (fasttomo's ``/volume`` or the
    only 3-D dataset of the file) that ``key`` gives."""
    path = os.fspath(path)
    with _open(path, key) as f:
        if VOLUME_DATASET in f:
            ds = f[VOLUME_DATASET]
        else:
            found: list[h5py.Dataset] = []
            f.visititems(lambda n, o: found.append(o) if isinstance(o, h5py.Dataset) and o.ndim == 3 else None)
            stacks = [d for d in found if d.parent.attrs.get("format") == FORMAT]  # fasttomo's tilt series
            cands = [d for d in found if d not in stacks]
            if stacks and not cands:
                raise DataFileError(f"{path}: holds a tilt series ({stacks[0].name}, {stacks[0].shape[0]} views with "
                                    f"their angles), not a volume; give a volume (e.g. a run's volume.h5 or "
                                    f"volume.mrc) as {key}.")
            if len(cands) != 1:
                raise DataFileError(f"{path}: no {VOLUME_DATASET} dataset and {len(cands)} other 3-D datasets; "
                                    "cannot tell which is the volume. Write it as /volume.")
            ds = cands[0]
        if ds.ndim != 3:
            raise DataFileError(f"{path}: dataset {ds.name} has shape {ds.shape}; a volume must be 3-D (Z, Y, X).")
        vol = _read_dataset(path, ds)
        attrs = json.loads(ds.attrs["fasttomo_attrs"]) if "fasttomo_attrs" in ds.attrs else {
            k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in ds.attrs.items()}
        vx = ds.attrs.get("voxel_size")
        if vx is not None:
            arr = np.atleast_1d(np.asarray(vx, dtype=np.float64))
            if arr.size != 1 and np.ptp(arr) > 1e-9 * abs(arr).max():
                raise DataFileError(f"{path}: anisotropic voxel size {arr.tolist()} in {ds.name}; fasttomo volumes "
                                    "are isotropic. Resample the volume first.")
            vx = float(arr.flat[0])
            units = ds.attrs.get("units", "angstrom")
            scale = _UNIT_TO_A.get(str(units).lower())
            if scale is None:
                raise DataFileError(f"{path}: unknown voxel size units {units!r}; use angstrom, nm or um.")
            vx *= scale
    return vol, vx, attrs


_UNIT_TO_A = {"angstrom": 1.0, "a": 1.0, "å": 1.0, "nm": 10.0, "nanometer": 10.0, "um": 1e4, "micron": 1e4,
              "µm": 1e4, "m": 1e10}
