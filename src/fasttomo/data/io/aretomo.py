"""AreTomo's alignment file (.aln): read and write its global alignment.

An .aln file holds ``#`` header lines (``# RawSize = W H N``, ``# NumPatches = k``,
``# DarkFrame = i j tilt`` for every section AreTomo left out, 0-based ``i`` in the raw stack,
``# AlphaOffset``, ``# BetaOffset``), then the column line ``# SEC ROT GMAG TX TY SMEAN SFIT SCALE
BASE TILT`` and one row per section kept, in stack order; a ``# Local Alignment`` section may
follow (patch shifts; fasttomo reads the global alignment only). Per row: ROT is the tilt-axis
rotation (degrees), GMAG a magnification, TX and TY the image shift (pixels of the raw stack),
TILT the tilt angle (degrees). The equivalent IMOD transform (raw -> aligned, about the image
centre) is A = GMAG R(ROT), R(a) = [[cos a, -sin a], [sin a, cos a]], (DX, DY) = -A (TX, TY): the
image is shifted back by (TX, TY), then rotated by ROT (what AreTomo's own .xf output holds).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from fasttomo.data.io.atomic import atomic_write
from fasttomo.data.io.common import DataFileError, read_text_lines

COLUMNS = ("SEC", "ROT", "GMAG", "TX", "TY", "SMEAN", "SFIT", "SCALE", "BASE", "TILT")


@dataclass
class AlnFile:
    """The global alignment of an .aln file."""

    rows: np.ndarray
    """(k, 10) numbers of the columns :data:`COLUMNS`, one row per section kept, in stack order."""
    raw_size: tuple[int, int, int] | None = None
    """(W, H, N) of the raw stack AreTomo aligned (``# RawSize``), None if absent."""
    dark_sections: list[int] = field(default_factory=list)
    """0-based raw-stack sections AreTomo left out (``# DarkFrame``), in file order."""
    dark_tilts: list[float] = field(default_factory=list)
    """Their tilt angles (degrees), NaN where the line gives none."""
    alpha_offset: float = 0.0
    beta_offset: float = 0.0
    num_patches: int = 0

    def column(self, name: str) -> np.ndarray:
        return self.rows[:, COLUMNS.index(name)]


def _header_value(line: str, path: str, lineno: int) -> list[float]:
    try:
        return [float(tok) for tok in line.split("=", 1)[1].split()]
    except (IndexError, ValueError):
        raise DataFileError(f"{path}, line {lineno}: {line.strip()!r} is not a '# Key = numbers' header line of an "
                            "AreTomo .aln file; give the .aln that AreTomo wrote as data.aln.") from None


def read_aln(path: str | os.PathLike, key: str = "data.aln") -> AlnFile:
    """Parse an .aln file given as ``key`` (format in the module docstring); an error names the bad line."""
    path = os.fspath(path)
    rows, darks, raw_size, alpha, beta, patches = [], [], None, 0.0, 0.0, 0
    in_global = False
    for lineno, line in enumerate(read_text_lines(path, ".aln", key), 1):
        text = line.strip()
        if not text:
            continue
        if text.startswith("#"):
            key = text[1:].strip()
            if key.startswith("SEC"):
                in_global = True
            elif key.startswith("Local Alignment"):
                in_global = False
            elif key.startswith("RawSize"):
                vals = _header_value(text, path, lineno)
                raw_size = tuple(int(v) for v in vals[:3]) if len(vals) >= 3 else None
            elif key.startswith("DarkFrame"):
                vals = _header_value(text, path, lineno)
                darks.append((int(vals[0]), vals[2] if len(vals) > 2 else float("nan")))
            elif key.startswith("AlphaOffset"):
                alpha = _header_value(text, path, lineno)[0]
            elif key.startswith("BetaOffset"):
                beta = _header_value(text, path, lineno)[0]
            elif key.startswith("NumPatches"):
                patches = int(_header_value(text, path, lineno)[0])
            continue
        if not in_global:
            continue
        try:
            vals = [float(tok) for tok in text.split()]
        except ValueError:
            vals = []
        if len(vals) != len(COLUMNS) or not np.all(np.isfinite(vals)):
            raise DataFileError(f"{path}, line {lineno}: {text!r} is not the 10 numbers of an .aln row "
                                f"({' '.join(COLUMNS)}); give the .aln that AreTomo wrote as data.aln.")
        rows.append(vals)
    if not rows:
        raise DataFileError(f"{path}: no global-alignment rows (after '# SEC ROT GMAG ...'); this is not an AreTomo "
                            ".aln file. Give the .aln of the stack as data.aln.")
    return AlnFile(np.asarray(rows, dtype=np.float64), raw_size, [d[0] for d in darks], [d[1] for d in darks],
                   alpha, beta, patches)


def write_aln(path: str | os.PathLike, table: np.ndarray, raw_size: tuple[int, int, int],
              overwrite: bool = False) -> str:
    """Write a global-only .aln for every section of a raw stack of ``raw_size`` (W, H, N):
    ``table`` (N, 4) holds ROT (degrees), TX, TY (pixels) and TILT (degrees) per section; GMAG 1,
    SEC numbered from 1."""
    table = np.asarray(table, dtype=np.float64).reshape(-1, 4)
    rot_deg, shifts, tilt_deg = table[:, 0], table[:, 1:3], table[:, 3]
    lines = ["# AreTomo Alignment / Priims bprmMn (written by fasttomo)",
             f"# RawSize = {raw_size[0]} {raw_size[1]} {raw_size[2]}", "# NumPatches = 0",
             "# AlphaOffset =     0.00", "# BetaOffset =     0.00",
             "# SEC     ROT         GMAG       TX          TY      SMEAN     SFIT    SCALE     BASE     TILT"]
    for i, (r, (tx, ty), t) in enumerate(zip(rot_deg, shifts, tilt_deg)):
        lines.append(f"{i + 1:5d}  {r:9.4f}  {1.0:9.5f}  {tx:9.3f}  {ty:9.3f}  {1.0:7.2f}  {1.0:7.2f}  {1.0:7.2f}  "
                     f"{0.0:7.2f}  {t:9.3f}")
    text = "\n".join(lines) + "\n"

    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(text)

    return atomic_write(path, _write, overwrite=overwrite)
