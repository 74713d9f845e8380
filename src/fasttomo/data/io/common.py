"""What every file module of fasttomo.data.io shares: its errors and small helpers (kept apart
from the package's __init__ so the modules import them without a cycle)."""

from __future__ import annotations

import os

from fasttomo.data.tiltseries import TiltSeriesError


class DataFileError(TiltSeriesError):
    """A file cannot be read or written as asked; the message names the file, problem and fix."""


class OutputExistsError(DataFileError, FileExistsError):
    """Refusing to replace existing results: a file (set ``output.overwrite=true`` to allow it) or
    a run folder holding an earlier run's results. The one such error of fasttomo: a
    :class:`DataFileError` and a :class:`FileExistsError`, so either ``except`` catches it."""


#: Suffixes understood by the readers, mapped to ``data.source`` names.
STACK_SUFFIXES = {
    ".mrc": "mrc", ".st": "mrc", ".ali": "mrc", ".mrcs": "mrc", ".preali": "mrc", ".rec": "mrc",
    ".map": "mrc",
    ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5",
    ".tif": "tiff", ".tiff": "tiff",
}


def file_size(path: str, what: str) -> int:
    """Size in bytes of an input file; a clear error if it is missing, unreadable or empty."""
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise DataFileError(f"{path}: cannot open the {what} file ({err.strerror}); check data.path.") from None
    if size == 0:
        raise DataFileError(f"{path}: the file is empty (0 bytes; a {what} file cannot be empty). Re-export or "
                            "re-copy it.")
    return size


def read_text_lines(path: str, what: str) -> list[str]:
    """Lines of a text input file; a clear error naming the config key if it cannot be read."""
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as f:  # -sig: a BOM (Notepad, Excel) is no text
            return f.readlines()
    except OSError as err:
        raise DataFileError(f"{path}: cannot read the {what} file ({err.strerror}); check data.angles.") from None


def source_from_suffix(path: str | os.PathLike) -> str:
    """``mrc``, ``hdf5`` or ``tiff`` from a file name; a :class:`DataFileError` for anything else."""
    suffix = os.path.splitext(str(path))[1].lower()
    try:
        return STACK_SUFFIXES[suffix]
    except KeyError:
        raise DataFileError(
            f"{path}: unknown file suffix {suffix!r}; fasttomo reads {sorted(STACK_SUFFIXES)}. "
            "Rename the file to its real type (e.g. .mrc for an IMOD stack) or convert it."
        ) from None


def _fmt(path, fmt: str | None) -> str:
    if fmt is None:
        src = source_from_suffix(path)
        fmt = {"hdf5": "h5"}.get(src, src)
    fmt = {"hdf5": "h5", "tif": "tiff"}.get(fmt, fmt)
    if fmt not in ("mrc", "h5", "tiff"):
        raise DataFileError(f"{path}: unknown output format {fmt!r}; use one of mrc, h5, tiff.")
    return fmt
