"""Multi-page TIFF stacks (float or integer) and TIFF volumes.

Written files are ImageJ hyperstacks (axes ZYX; Fiji/napari see the spacing): XResolution and
YResolution = 1 / voxel size, ImageJ ``spacing`` = voxel size and ``unit`` = "angstrom"; the exact
voxel size and fasttomo's attributes are also stored as JSON in private tag 65000 so round trips are
exact. Reading takes the pixel size from that tag, else from the ImageJ unit and resolution
(angstrom, nm, micron), else reports it missing.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import tifffile

from fasttomo.data.io.common import DataFileError, file_size
from fasttomo.data.io.atomic import atomic_write

FASTTOMO_TAG = 65000
_UNIT_TO_A = {"angstrom": 1.0, "a": 1.0, "\u00c5": 1.0, "\u212b": 1.0, "nm": 10.0, "nanometer": 10.0,
              "micron": 1e4, "um": 1e4, "\u00b5m": 1e4, "microns": 1e4}


def read_tiff(path: str | os.PathLike, key: str = "data.path") -> tuple[np.ndarray, float | None, dict]:
    """(array as stored, voxel/pixel size in Angstrom or None, fasttomo attrs or {}) of the file ``key`` gives."""
    path = os.fspath(path)
    size = file_size(path, "TIFF", key)
    try:
        with tifffile.TiffFile(path) as t:
            _check_page_sizes(path, t)
            data = t.asarray()
            if len(t.series) > 1 and len(t.pages) > 1 and data.ndim == 2:
                data = t.asarray(key=range(len(t.pages)))  # pages appended one by one: a series each, one stack
            page = t.pages[0]
            tag = page.tags.get(FASTTOMO_TAG)
            attrs: dict[str, Any] = {}
            size_a = None
            if tag is not None:
                try:
                    attrs = json.loads(tag.value)
                    size_a = float(attrs.pop("voxel_size_A"))
                except (TypeError, ValueError, KeyError):
                    attrs = {}
            if size_a is None:
                size_a = _imagej_size(t, page)
    except DataFileError:
        raise
    except (tifffile.TiffFileError, ValueError, OSError, IndexError) as err:
        codec = re.match(r"<COMPRESSION\.(\w+): \d+> requires the 'imagecodecs' package", str(err))
        if codec:  # tifffile decodes only uncompressed and a few schemes itself
            raise DataFileError(f"{path}: its images are {codec.group(1)}-compressed, and reading that compression "
                                "needs the imagecodecs package: pip install imagecodecs (in fasttomo's environment), "
                                "or re-export the stack uncompressed.") from None
        raise DataFileError(f"{path}: not a readable TIFF file ({err}; file size {size} bytes); it is truncated, "
                            "corrupt or of another type. Re-export it.") from None
    return data, size_a, attrs


def _check_page_sizes(path: str, t: tifffile.TiffFile) -> None:
    """Refuse a multi-page TIFF whose pages differ in size (tifffile would read the first run of
    equal pages only, and a tilt series needs every view the same size)."""
    pages = t.pages
    if len(pages) < 2:
        return
    first = pages[0].shape
    for i in range(1, len(pages)):
        shape = pages[i].shape
        if shape != first:
            size = lambda s: " x ".join(map(str, s))  # noqa: E731
            raise DataFileError(
                f"{path}: its pages differ in size: page 1 is {size(first)} pixels, page {i + 1} is {size(shape)} "
                f"(of {len(pages)} pages); every view of a tilt series must have the same size. Re-export the stack "
                "with equal pages (crop or pad the odd ones).")


def _imagej_size(t: tifffile.TiffFile, page) -> float | None:
    meta = t.imagej_metadata or {}
    unit = str(meta.get("unit", "")).strip().lower()
    scale = _UNIT_TO_A.get(unit)
    xres = page.tags.get("XResolution")
    if scale is None or xres is None:
        return None
    num, den = xres.value
    if num <= 0 or den <= 0:
        return None
    return den / num * scale


def write_tiff(path: str | os.PathLike, data: np.ndarray, voxel_size: float, *, attrs: dict | None = None,
               overwrite: bool = False) -> str:
    """Write a (Z, Y, X) float32 array as an ImageJ TIFF stack with spacing metadata, atomically."""
    arr = np.ascontiguousarray(data, dtype=np.float32)
    if arr.ndim != 3:
        raise DataFileError(f"{path}: can only write 3-D arrays as a TIFF stack, got shape {arr.shape}.")
    vx = float(voxel_size)
    meta = dict(attrs or {})
    meta["voxel_size_A"] = vx
    blob = json.dumps(meta, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))

    def _write(tmp: str) -> None:
        tifffile.imwrite(tmp, arr, imagej=True, resolution=(1.0 / vx, 1.0 / vx),
                         metadata={"spacing": vx, "unit": "angstrom", "axes": "ZYX"},
                         extratags=[(FASTTOMO_TAG, "s", 0, blob, True)])

    return atomic_write(path, _write, overwrite=overwrite)
