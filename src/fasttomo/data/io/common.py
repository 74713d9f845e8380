"""What every file module of fasttomo.data.io shares: its errors and small helpers (kept apart
from the package's __init__ so the modules import them without a cycle)."""

from __future__ import annotations

import io
import os
import unicodedata

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


def _cannot_open(path: str, what: str, key: str, err: OSError) -> DataFileError:
    """The error for an input file that ``open`` refuses, naming ``key``, the setting that gave it."""
    if isinstance(err, IsADirectoryError):
        return DataFileError(f"{path}: is a directory; set {key} to the {what} file in it.")
    if isinstance(err, PermissionError):
        return DataFileError(f"{path}: the {what} file cannot be read (permission denied); fix its permissions "
                             f"(e.g. chmod a+r) or give a readable copy as {key}.")
    return DataFileError(f"{path}: cannot open the {what} file ({err.strerror}); check {key}.")


def file_size(path: str, what: str, key: str) -> int:
    """Size in bytes of an input file given as ``key``; a clear error if it is missing, a
    directory, unreadable or empty."""
    try:
        with open(path, "rb") as f:  # opened, not just stat'ed: a directory or a chmod 000 file fails here
            size = os.fstat(f.fileno()).st_size
    except OSError as err:
        raise _cannot_open(path, what, key, err) from None
    if size == 0:
        raise DataFileError(f"{path}: the file is empty (0 bytes; a {what} file cannot be empty). Re-export or "
                            "re-copy it.")
    return size


def read_text_lines(path: str, what: str, key: str) -> list[str]:
    """Lines of a text input file given as ``key``; a clear error if it cannot be read or is UTF-16."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise _cannot_open(path, what, key, err) from None
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # its BOM; read as UTF-8 it would be NUL-riddled noise
        raise DataFileError(f"{path}: the {what} file is UTF-16 text (Windows Notepad's 'Unicode'); save it as "
                            f"UTF-8 or ASCII and give it again as {key}.")
    if b"\0" in raw:  # no text file holds a NUL byte: a stack, a picture or an archive given by mistake
        kind = ("an MRC file" if raw[208:212] == b"MAP " else "an HDF5 file" if raw.startswith(b"\x89HDF")
                else "a TIFF file" if raw[:4] in (b"II*\0", b"MM\0*") else "a binary file")
        raise DataFileError(f"{path}: the {what} file is not text (it holds NUL bytes: {kind}?); give the {what} "
                            f"text file as {key}.")
    # -sig: a UTF-8 BOM (Notepad, Excel) is no text; newline=None: CRLF and CR line ends as in text mode
    return io.StringIO(raw.decode("utf-8-sig", errors="replace"), newline=None).readlines()


def non_ascii_hint(text: str) -> str:
    """"it holds '−' (U+2212 MINUS SIGN); use the ASCII '-'" for the first non-ASCII character of
    ``text``, "" if there is none: a minus pasted from a PDF looks like '-' but is no number to Python."""
    ch = next((c for c in text if ord(c) > 127), None)
    if ch is None:
        return ""
    if ch == "\ufffd":  # what read_text_lines decodes a byte that is not UTF-8 to
        return ("it holds a byte that is not UTF-8 text (shown as '\ufffd'; a Latin-1 '°'?); write plain ASCII "
                "numbers (digits, '.', '-', 'e')")
    dash = unicodedata.category(ch) == "Pd" or ch == "\u2212"
    return (f"it holds {ch!r} (U+{ord(ch):04X} {unicodedata.name(ch, 'unnamed character')}); "
            + ("use the ASCII '-'" if dash else "write plain ASCII numbers (digits, '.', '-', 'e')"))


def source_from_suffix(path: str | os.PathLike) -> str:
    """``mrc``, ``hdf5`` or ``tiff`` from a file name; a :class:`DataFileError` for anything else."""
    suffix = os.path.splitext(str(path))[1].lower()
    try:
        return STACK_SUFFIXES[suffix]
    except KeyError:
        if suffix in (".npy", ".npz"):
            raise DataFileError(
                f"{path}: fasttomo does not read numpy files; save the array as MRC (mrcfile) or HDF5 (h5py; a tilt "
                "series as a (n_tilts, H, W) dataset /tiltseries/stack, its degrees in /tiltseries/angles) and give "
                "that file."
            ) from None
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
