"""Traced atoms on disk: atoms.csv, extended XYZ, and the picture of the central slabs.

atoms.csv: header ``x_A,y_A,z_A,intensity,fit_error,species``, one atom a line. Positions in
Angstrom with the origin at the centre of the volume's first voxel (voxel (0, 0, 0) of the
(Z, Y, X) array, the first value of volume.mrc); x along X (columns, MRC nx), y along Y (rows,
the tilt axis, MRC ny), z along Z (sections, the beam at 0 degrees, MRC nz). ``intensity`` is the
integrated intensity of the fitted Gaussian (volume units x voxels), ``fit_error`` the RMS residual
of the fit over its neighbourhood divided by the fitted amplitude, ``species`` 1 .. classes in
increasing order of intensity. Plain CSV (the header is the first line), so ``pandas.read_csv``
and ``csv.DictReader`` read it as it is. What describes the file as a whole (where it comes from,
the voxel size, the frame) goes into a JSON file beside it with the same stem (atoms.json).
The reader also takes files of older versions, which started with ``#`` comment lines.

Extended XYZ (ASE's ``ase.io.read(..., format="extxyz")`` and OVITO): the atom count, then
``Lattice="Lx 0 0 0 Ly 0 0 0 Lz" Origin="ox oy oz" Properties=species:S:1:pos:R:3:intensity:R:1:
fit_error:R:1:class:I:1 pbc="F F F"`` (the lattice is the volume's box, whose corner lies half a
voxel before the first voxel's centre), then one line per atom: element symbol, x, y, z (A),
intensity, fit error and species class.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

CSV_HEADER = "x_A,y_A,z_A,intensity,fit_error,species"
CSV_COLUMNS = CSV_HEADER.split(",")


class AtomsFileError(ValueError):
    """A coordinates file cannot be read; the message names the file, the problem and the fix."""


def _atomic_text(path, text: str, overwrite: bool) -> str:
    from fasttomo.data.io.atomic import atomic_write

    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), overwrite=overwrite)


def atoms_csv_text(xyz_A, intensity, fit_error, species) -> str:
    xyz = np.asarray(xyz_A, dtype=np.float64).reshape(-1, 3)
    n = xyz.shape[0]
    inten = np.broadcast_to(np.asarray(intensity, dtype=np.float64), (n,))
    err = np.broadcast_to(np.asarray(fit_error, dtype=np.float64), (n,))
    spec = np.broadcast_to(np.asarray(species, dtype=np.int64), (n,))
    lines = [CSV_HEADER]
    lines += [f"{x:.4f},{y:.4f},{z:.4f},{i:.6g},{e:.4g},{s:d}" for (x, y, z), i, e, s in zip(xyz, inten, err, spec)]
    return "\n".join(lines) + "\n"


def meta_path(path) -> Path:
    """The JSON file that describes the coordinates file ``path`` (atoms.csv -> atoms.json)."""
    return Path(path).with_suffix(".json")


def write_atoms_csv(path, xyz_A, intensity, fit_error, species, *, meta: dict | None = None,
                    overwrite: bool = False) -> list[str]:
    """Write atoms.csv (see the module doc) and, with ``meta``, its description as JSON beside it
    (:func:`meta_path`), each atomically; returns the paths written. Unless ``overwrite``, an
    existing file is refused before anything is written."""
    import json

    targets = [Path(path)] + ([meta_path(path)] if meta is not None else [])
    if not overwrite:
        from fasttomo.data.io.atomic import _exists_error

        for t in targets:
            if os.path.lexists(t):
                raise _exists_error(os.fspath(t))
    out = [_atomic_text(path, atoms_csv_text(xyz_A, intensity, fit_error, species), overwrite)]
    if meta is not None:
        doc = {"columns": CSV_HEADER, **meta}
        out.append(_atomic_text(targets[1], json.dumps(doc, indent=2) + "\n", overwrite))
    return out


def read_atoms_csv(path) -> dict:
    """{"xyz_A" (N, 3), "intensity", "fit_error", "species"} from an atoms.csv-style file.

    Needs the columns x_A, y_A, z_A (in any order, extra columns ignored); intensity, fit_error
    and species are optional (NaN, NaN and 0 when missing).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise AtomsFileError(f"{path}: file not found; give a coordinates file written by fasttomo-trace or "
                             "fasttomo-simulate data.phantom=nanoparticle (<out>_atoms.csv).")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise AtomsFileError(f"{path}: no header line; the first line must be {CSV_HEADER!r}.")
    cols = [c.strip() for c in lines[0].split(",")]
    missing = [c for c in ("x_A", "y_A", "z_A") if c not in cols]
    if missing:
        raise AtomsFileError(f"{path}: the header {lines[0]!r} lacks {missing}; coordinates files have the header "
                             f"{CSV_HEADER!r} (Angstrom, origin at the centre of the volume's first voxel).")
    rows = []
    for k, ln in enumerate(lines[1:], start=2):
        parts = ln.split(",")
        if len(parts) != len(cols):
            raise AtomsFileError(f"{path}: data line {k - 1} has {len(parts)} values but the header has {len(cols)}.")
        try:
            rows.append([float(v) for v in parts])
        except ValueError:
            raise AtomsFileError(f"{path}: data line {k - 1} holds a value that is not a number: {ln!r}.") from None
    arr = np.asarray(rows, dtype=np.float64).reshape(-1, len(cols))
    if not np.all(np.isfinite(arr[:, [cols.index(c) for c in ("x_A", "y_A", "z_A")]])):
        raise AtomsFileError(f"{path}: some coordinates are not finite numbers.")
    get = lambda c, fill: arr[:, cols.index(c)] if c in cols else np.full(arr.shape[0], fill)  # noqa: E731
    return {"xyz_A": np.stack([get("x_A", 0), get("y_A", 0), get("z_A", 0)], -1),
            "intensity": get("intensity", np.nan), "fit_error": get("fit_error", np.nan),
            "species": get("species", 0).astype(np.int64)}


def write_xyz(path, xyz_A, species, symbols, intensity, fit_error, box_A, voxel_size_A: float, *,
              overwrite: bool = False) -> str:
    """Write the extended XYZ file (see the module doc). ``symbols[k]`` is the element of species
    k + 1; ``box_A`` (Lx, Ly, Lz) the volume's extent (voxels x voxel size)."""
    xyz = np.asarray(xyz_A, dtype=np.float64).reshape(-1, 3)
    spec = np.asarray(species, dtype=np.int64)
    lx, ly, lz = (float(v) for v in box_A)
    o = -0.5 * float(voxel_size_A)
    head = (f'Lattice="{lx:.6g} 0 0 0 {ly:.6g} 0 0 0 {lz:.6g}" Origin="{o:.6g} {o:.6g} {o:.6g}" '
            'Properties=species:S:1:pos:R:3:intensity:R:1:fit_error:R:1:class:I:1 pbc="F F F"')
    lines = [str(xyz.shape[0]), head]
    for (x, y, z), s, i, e in zip(xyz, spec, intensity, fit_error):
        sym = symbols[s - 1] if 1 <= s <= len(symbols) else "X"
        lines.append(f"{sym} {x:.4f} {y:.4f} {z:.4f} {i:.6g} {e:.4g} {s:d}")
    return _atomic_text(path, "\n".join(lines) + "\n", overwrite)


def read_xyz(path) -> dict:
    """A small extended-XYZ reader for fasttomo's own files: {"symbols", "xyz_A", "info",
    "properties": {name: array}}."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    n = int(lines[0].strip())
    info = {}
    import shlex

    for tok in shlex.split(lines[1]):
        k, _, v = tok.partition("=")
        info[k] = v
    spec = info["Properties"].split(":")
    fields = [(spec[k], spec[k + 1], int(spec[k + 2])) for k in range(0, len(spec), 3)]
    rows = [ln.split() for ln in lines[2:2 + n]]
    if len(rows) != n:
        raise AtomsFileError(f"{path}: the count line says {n} atoms but {len(rows)} follow.")
    props, col = {}, 0
    for name, kind, width in fields:
        vals = [r[col:col + width] for r in rows]
        conv = {"S": str, "R": float, "I": int}[kind]
        arr = np.array([[conv(v) for v in r] for r in vals], dtype=object if kind == "S" else None).reshape(n, width)
        props[name] = arr[:, 0] if width == 1 else arr
        col += width
    return {"symbols": [str(s) for s in props.get("species", [])], "xyz_A": np.asarray(props["pos"], dtype=float),
            "info": info, "properties": props}


_COLORS = [(255, 60, 60), (60, 200, 255), (255, 210, 40), (120, 255, 120), (230, 120, 255), (255, 150, 60)]


def slabs_png(path, volume: np.ndarray, zyx: np.ndarray, species: np.ndarray, half_thickness: float, *,
              voxel_size_A: float, overwrite: bool = False, min_panel: int = 320) -> str:
    """The three central slabs (XY at the middle Z, XZ at the middle Y, YZ at the middle X; each
    the maximum over +-``half_thickness`` voxels), side by side, with every traced atom inside a
    slab drawn as a circle at its position (colour by species)."""
    from PIL import Image, ImageDraw

    from fasttomo.data.io.atomic import atomic_write
    from fasttomo.quality.plots import _font

    vol = np.asarray(volume, dtype=np.float32)
    zn, yn, xn = vol.shape
    h = max(0, int(math.floor(half_thickness)))
    cz, cy, cx = zn // 2, yn // 2, xn // 2
    panels = [  # (image rows x cols, slab axis, center, (row axis, col axis), title)
        (vol[max(0, cz - h):cz + h + 1].max(axis=0), 0, cz, (1, 2), f"XY slab, z = {cz} +- {h} voxels"),
        (vol[:, max(0, cy - h):cy + h + 1].max(axis=1), 1, cy, (0, 2), f"XZ slab, y = {cy} +- {h}"),
        (vol[:, :, max(0, cx - h):cx + h + 1].max(axis=2), 2, cx, (0, 1), f"YZ slab, x = {cx} +- {h}"),
    ]
    finite = np.concatenate([p[0].ravel() for p in panels])
    lo, hi = np.percentile(finite, [0.5, 99.8]) if finite.size else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    scale = max(1, int(math.ceil(min_panel / max(1, max(vol.shape)))))
    font = _font(13)
    imgs = []
    zyx = np.asarray(zyx, dtype=np.float64).reshape(-1, 3)
    for img, axis, centre, (ra, ca), title in panels:
        g = np.clip((img - lo) / (hi - lo), 0, 1)
        pil = Image.fromarray((g * 255).astype(np.uint8)).resize((img.shape[1] * scale, img.shape[0] * scale),
                                                                  Image.NEAREST).convert("RGB")
        canvas = Image.new("RGB", (pil.width, pil.height + 20), (255, 255, 255))
        canvas.paste(pil, (0, 20))
        d = ImageDraw.Draw(canvas)
        d.text((2, 3), title, fill=(0, 0, 0), font=font)
        sel = np.abs(zyx[:, axis] - centre) <= h + 0.5
        rad = max(3.0, 0.8 * scale)
        for p, s in zip(zyx[sel], np.asarray(species)[sel]):
            x, y = (p[ca] + 0.5) * scale, (p[ra] + 0.5) * scale + 20
            d.ellipse([x - rad, y - rad, x + rad, y + rad], outline=_COLORS[(int(s) - 1) % len(_COLORS)], width=1)
        imgs.append(canvas)
    gap = 6
    width = sum(i.width for i in imgs) + gap * (len(imgs) - 1)
    out = Image.new("RGB", (width, max(i.height for i in imgs) + 18), (255, 255, 255))
    x = 0
    for i in imgs:
        out.paste(i, (x, 0))
        x += i.width + gap
    ImageDraw.Draw(out).text((2, out.height - 16), f"{zyx.shape[0]} atoms traced; circles: atoms within the slab "
                             f"(colour = species); voxel {voxel_size_A:.4g} A", fill=(0, 0, 0), font=font)
    return atomic_write(path, lambda tmp: out.save(tmp, format="PNG"), overwrite=overwrite)
