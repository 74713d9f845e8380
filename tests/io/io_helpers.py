"""Helpers for the I/O tests (imported as io_helpers; no conftest so names stay unique): real files written with mrcfile/h5py/tifffile in tmp_path."""

from __future__ import annotations

import mrcfile
import numpy as np

from fasttomo.config import DataConfig


def write_raw_mrc(path, data, voxel=None, exttyp=None, ext=None, patch=None):
    """A real MRC written by mrcfile (not fasttomo), optionally with an extended header and byte patches
    {offset: bytes} applied to the 1024-byte header afterwards."""
    with mrcfile.new(str(path), overwrite=True) as m:
        m.set_data(data)
        if voxel is not None:
            m.voxel_size = voxel
        if ext is not None:
            m.set_extended_header(ext)
        if exttyp is not None:
            m.header.exttyp = exttyp
    if patch:
        with open(path, "r+b") as f:
            for off, blob in patch.items():
                f.seek(off)
                f.write(blob)
    return str(path)


def write_tlt(path, angles, per_line=1):
    a = np.asarray(angles, dtype=float)
    lines = [" ".join(repr(float(v)) for v in a[i:i + per_line]) for i in range(0, a.size, per_line)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def data_cfg(**kw) -> DataConfig:
    kw.setdefault("normalize", "none")
    return DataConfig(**kw)


def make_stack(n=5, h=12, w=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.random((n, h, w)) * 100 + 10).astype(np.float32)


ANGLES5 = np.array([-40.0, -20.0, 0.0, 20.0, 40.0])
