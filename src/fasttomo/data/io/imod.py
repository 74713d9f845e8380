"""IMOD and SerialEM text files: tilt-angle lists (.rawtlt/.tlt) and SerialEM .mdoc.

Tilt-angle files hold angles in degrees as whitespace-separated numbers, one or many per line
(IMOD writes one per line; other tools wrap several). Blank lines and ``#`` comments are skipped.
:func:`read_tilt_file` returns the rows as read; :func:`angles_for_stack` turns them into

  * ``(n_tilts,)`` -- all numbers in reading order, when there are n_tilts of them, or
  * ``(n_tilts, H)`` per-line angles (continuous rotation) -- when there are exactly n_tilts rows of
    exactly H numbers each (row i gives the angle of every image line of view i).

No other count is accepted (a per-view list and a per-line table can never be confused, since
H >= 2). SerialEM .mdoc files give per-section ``TiltAngle``, ``PixelSpacing`` (Angstrom) and, in the
``[T = ... Tilt axis angle = A ...]`` title, the tilt-axis angle; sections are ordered by ZValue.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from fasttomo.data.io.common import DataFileError, non_ascii_hint, read_text_lines
from fasttomo.data.io.atomic import atomic_write


def read_tilt_file(path: str | os.PathLike, key: str = "data.angles") -> list[list[float]]:
    """Rows of numbers (degrees) from a .rawtlt/.tlt file given as ``key``; an error names the bad
    line (and a non-ASCII character in it)."""
    path = os.fspath(path)
    lines = read_text_lines(path, "tilt-angle", key)
    rows: list[list[float]] = []
    for lineno, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].replace(",", " ").strip()
        if not text:
            continue
        try:
            rows.append([float(tok) for tok in text.split()])
        except ValueError:
            hint = non_ascii_hint(text)
            raise DataFileError(
                f"{path}, line {lineno}: {_quoted(line)} is not a list of numbers; " + (
                    f"{hint}." if hint else "a tilt-angle file holds angles in degrees, one or many per line. "
                    f"Fix the line or give the right file as {key}.")
            ) from None
    if not rows:
        raise DataFileError(f"{path}: the tilt-angle file holds no angles; give the angle list as {key}.")
    return rows


def _quoted(line: str, limit: int = 80) -> str:
    """A line of a text file as an error quotes it: repr'd, cut to ``limit`` characters."""
    text = line.strip()
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f" (... {len(text)} characters)"


def angles_for_stack(rows: list[list[float]], n_sections: int, height: int, where: str,
                     stack_path: str) -> np.ndarray:
    """Shape tilt-file rows into (n,) or (n, H) angles for a stack of n_sections images of H lines."""
    counts = [len(r) for r in rows]
    if len(rows) == n_sections and all(c == height for c in counts) and height > 1:
        return np.asarray(rows, dtype=np.float64)
    flat = np.asarray([a for r in rows for a in r], dtype=np.float64)
    if flat.size != n_sections and len(rows) == n_sections and len(set(counts)) == 1:
        raise DataFileError(  # '-60,00' (a decimal comma) reads as two numbers, as does AreTomo's 'angle dose'
            f"{where}: every line holds {counts[0]} numbers (line 1 reads as {', '.join(map(repr, rows[0]))}), but "
            f"the stack {stack_path} has {n_sections} sections of {height} lines, so they are not per-line angles: "
            "decimal commas ('-60,00'), or an extra column (e.g. AreTomo's dose)? Write one angle per line with a '.' "
            "decimal point (or give the first column only).")
    if flat.size != n_sections:
        raise DataFileError(
            f"{where}: {flat.size} angles in {len(rows)} lines, but the stack {stack_path} has {n_sections} "
            f"sections; the angle count must equal the number of sections (or {n_sections} lines of "
            f"{height} per-line angles). Give the angle file that belongs to this stack, or exclude views "
            "only through data.exclude_views (the file must still list every section)."
        )
    return flat


def _fmt_angle(a: float) -> str:
    return repr(float(a))


def write_tilt_file(path: str | os.PathLike, angles: np.ndarray, overwrite: bool = False) -> str:
    """Write angles (degrees): one per line, or for (n, H) per-line angles one view per line."""
    angles = np.asarray(angles, dtype=np.float64)
    rows = angles[:, None] if angles.ndim == 1 else angles
    text = "".join(" ".join(_fmt_angle(a) for a in row) + "\n" for row in rows)

    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(text)

    return atomic_write(path, _write, overwrite=overwrite)


@dataclass
class MdocInfo:
    """What a SerialEM .mdoc says about a tilt series."""

    angles: np.ndarray
    """(n_sections,) tilt angles in degrees, in ZValue order."""
    pixel_size: float | None
    """Pixel spacing in Angstrom (None if absent)."""
    tilt_axis_angle: float | None
    """Tilt-axis angle in degrees from the title line (None if absent)."""


_KEY = re.compile(r"^\s*([A-Za-z][\w]*)\s*=\s*(.*?)\s*$")
_SECTION = re.compile(r"^\s*\[\s*ZValue\s*=\s*(-?\d+)\s*\]")
_AXIS = re.compile(r"Tilt\s*axis\s*angle\s*=\s*(-?[\d.]+(?:[eE][-+]?\d+)?)", re.IGNORECASE)


def read_mdoc(path: str | os.PathLike, key: str = "data.angles") -> MdocInfo:
    """Parse a SerialEM .mdoc given as ``key`` (TiltAngle, PixelSpacing, tilt-axis angle)."""
    path = os.fspath(path)
    lines = read_text_lines(path, ".mdoc", key)
    sections: dict[int, dict[str, str]] = {}
    header: dict[str, str] = {}
    current = header
    axis = None
    for line in lines:
        m = _SECTION.match(line)
        if m:
            current = sections.setdefault(int(m.group(1)), {})
            continue
        if axis is None and line.lstrip().startswith("[T") and (m := _AXIS.search(line)):
            axis = float(m.group(1))
            continue
        m = _KEY.match(line)
        if m:
            current[m.group(1)] = m.group(2)
    if not sections:
        raise DataFileError(
            f"{path}: no [ZValue = n] sections found; this is not a SerialEM tilt-series .mdoc. Give the "
            ".mdoc of the stack, or a .rawtlt/.tlt angle file, as data.angles."
        )
    zs = sorted(sections)
    if zs != list(range(len(zs))):
        raise DataFileError(f"{path}: ZValues {zs[:5]}... are not 0..{len(zs) - 1}; the .mdoc is incomplete.")
    angles = []
    for z in zs:
        try:
            angles.append(float(sections[z]["TiltAngle"].split()[0]))
        except (KeyError, ValueError, IndexError):
            raise DataFileError(
                f"{path}: section ZValue = {z} has no numeric TiltAngle; fix the .mdoc or give a .rawtlt file."
            ) from None
    spacing = [sections[z].get("PixelSpacing") or header.get("PixelSpacing") for z in zs]
    pix = None
    vals = sorted({float(s.split()[0]) for s in spacing if s})
    if vals:
        pix = vals[0]
        if len(vals) > 1:
            raise DataFileError(f"{path}: sections have different PixelSpacing values {vals}; set data.pixel_size.")
    if axis is None:
        for key in ("TiltAxisAngle",):
            if key in header:
                axis = float(header[key].split()[0])
                break
    return MdocInfo(angles=np.asarray(angles), pixel_size=pix, tilt_axis_angle=axis)


# ----------------------------------------------------------------------------------- .xf, .xtilt
def read_xf(path: str | os.PathLike, key: str = "data.xf") -> np.ndarray:
    """(n, 6) rows ``A11 A12 A21 A22 DX DY`` of an IMOD .xf file (one line per section of the
    stack it was made for). IMOD's definition: the transform maps a raw image onto the aligned one
    about the image centre, x' = A11 x + A12 y + DX, y' = A21 x + A22 y + DY with (x, y) and
    (x', y') measured from the centre (nx/2, ny/2) in IMOD's pixel coordinates (x along the columns,
    y along the rows in file order; a pixel's centre at index + 0.5), DX and DY in pixels."""
    path = os.fspath(path)
    rows = []
    for lineno, line in enumerate(read_text_lines(path, ".xf", key), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            vals = [float(tok) for tok in text.split()]
        except ValueError:
            vals = []
        if len(vals) != 6 or not np.all(np.isfinite(vals)):
            raise DataFileError(f"{path}, line {lineno}: {line.strip()!r} is not 6 numbers (A11 A12 A21 A22 DX DY); "
                                f"{key} takes IMOD's .xf (or .prexg) transform file.")
        rows.append(vals)
    if not rows:
        raise DataFileError(f"{path}: the .xf file holds no transforms; give the .xf of the stack as {key}.")
    return np.asarray(rows, dtype=np.float64)


def write_xf(path: str | os.PathLike, xf: np.ndarray, overwrite: bool = False) -> str:
    """Write (n, 6) transforms as IMOD does (four linear terms, then the two shifts, one line each)."""
    xf = np.asarray(xf, dtype=np.float64).reshape(-1, 6)
    text = "".join("".join(f"{v:12.7f}" for v in row[:4]) + "".join(f"{v:12.3f}" for v in row[4:]) + "\n"
                   for row in xf)

    def _write(tmp: str) -> None:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(text)

    return atomic_write(path, _write, overwrite=overwrite)
