"""Per-view pose files (``<name>_poses.json``): the true poses of a misaligned synthetic series.

fasttomo-simulate writes one beside the tilt series whenever the views were posed
(``data.pose_error_shift`` or ``data.pose_error_rotation`` > 0). It is one JSON object:

    {
      "format": "fasttomo-poses", "version": 1,
      "convention": "(u, v, w) = Rz(z3) Ry(tilt) Rz(z1) p + (shift_u, shift_v, 0) ...",
      "n_views": N,
      "reference_index": r,          # 0-based view of smallest |tilt|; its pose is zero
      "tilt_deg":   [N numbers],     # the tilt angles, in stack (and .rawtlt) order
      "z1_deg":     [N numbers],     # rotation about the specimen z before the tilt (degrees)
      "z3_deg":     [N numbers],     # in-plane image rotation about the detector centre (degrees)
      "shift_u_px": [N numbers],     # image shift along columns (u, along X), pixels
      "shift_v_px": [N numbers],     # image shift along rows (v, along the tilt axis Y), pixels
      "source": {...}                # how they were made (error ranges, seed)
    }

The per-view keys are those of ``Poses.describe()`` (the ``poses`` of metrics.json), so
:func:`fasttomo.geometry.alignment.pose_errors` compares the two directly and
:func:`fasttomo.geometry.alignment.set_poses` loads either into a ``Poses`` module. Convention
(:mod:`fasttomo.geometry.poses`): p is a volume point (x, y, z) in centred voxel units, (u, v) the
detector coordinates of the pixel centre (u = column - (W-1)/2, v = row - (H-1)/2), so view n
images p at column u and row v.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from fasttomo.data.io.common import DataFileError
from fasttomo.data.io.atomic import atomic_write

FORMAT = "fasttomo-poses"
VERSION = 1
PER_VIEW = ("tilt_deg", "z1_deg", "z3_deg", "shift_u_px", "shift_v_px")
CONVENTION = ("(u, v, w) = Rz(z3) Ry(tilt) Rz(z1) p + (shift_u, shift_v, 0); p = (x, y, z) centred voxel units, "
              "u = column - (W-1)/2, v = row - (H-1)/2, angles in degrees, shifts in pixels; the reference view "
              "(smallest |tilt|) has zero pose (fasttomo.geometry.poses)")


def poses_path(base: str | os.PathLike) -> str:
    """``<base>_poses.json`` for an output base path (no suffix)."""
    return f"{os.fspath(base)}_poses.json"


def _validated(poses: Mapping[str, Any], where: str) -> dict:
    missing = [k for k in (*PER_VIEW, "reference_index") if k not in poses]
    if missing:
        raise DataFileError(f"{where}: pose data lack {missing}; a poses file needs reference_index and the per-view "
                            f"lists {list(PER_VIEW)}.")
    out = {}
    n = None
    for k in PER_VIEW:
        a = np.asarray(poses[k], dtype=np.float64)
        if a.ndim != 1 or (n is not None and a.shape[0] != n) or not np.all(np.isfinite(a)):
            raise DataFileError(f"{where}: {k!r} must be a list of finite numbers, one per view (as many as tilt_deg).")
        n = a.shape[0]
        out[k] = [float(v) for v in a]
    ref = poses["reference_index"]
    if isinstance(ref, bool) or not isinstance(ref, (int, np.integer)) or not 0 <= int(ref) < n:
        raise DataFileError(f"{where}: reference_index must be a view index in [0, {n}), got {ref!r}.")
    out["reference_index"] = int(ref)
    return out


def write_poses_json(path: str | os.PathLike, poses: Mapping[str, Any], source: Mapping[str, Any] | None = None,
                     overwrite: bool = False) -> str:
    """Write a poses file (format in the module docstring) atomically; never replaces an existing
    file unless ``overwrite`` (:class:`~fasttomo.data.io.OutputExistsError`). Returns the path."""
    body = _validated(poses, os.fspath(path))
    doc = {"format": FORMAT, "version": VERSION, "convention": CONVENTION, "n_views": len(body["tilt_deg"]),
           "reference_index": body["reference_index"], **{k: body[k] for k in PER_VIEW},
           "source": dict(source or {})}
    # one key per line, each per-view list on one line: readable and diffable
    text = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items()) + "\n}\n"

    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    return atomic_write(path, _write, overwrite=overwrite)


def read_poses_json(path: str | os.PathLike) -> dict:
    """Read a poses file: {reference_index, tilt_deg, z1_deg, z3_deg, shift_u_px, shift_v_px, source}."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as err:
        raise DataFileError(f"{path}: cannot read the poses file ({err.strerror}).") from None
    except json.JSONDecodeError as err:
        raise DataFileError(f"{path}: not a JSON poses file ({err}).") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise DataFileError(f"{path}: not a fasttomo poses file (expected \"format\": \"{FORMAT}\").")
    if doc.get("version") != VERSION:
        raise DataFileError(f"{path}: poses file version {doc.get('version')!r}; this fasttomo reads version "
                            f"{VERSION}.")
    return {**_validated(doc, path), "source": doc.get("source", {})}
