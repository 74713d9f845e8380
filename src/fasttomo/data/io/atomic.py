"""Atomic file writes: a crash never leaves a half-written file, an existing file is never replaced
unless asked.

The writer writes a temporary file in the destination folder (same file system, so the final rename
is atomic); the file is flushed and fsync'ed, then renamed onto the destination and the folder is
fsync'ed. Without ``overwrite`` the final step is a hard link, which fails if the destination
appeared meanwhile (no race), falling back to a checked rename on file systems without links.
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Callable

from fasttomo.data.io.common import OutputExistsError


def _exists_error(path: str) -> OutputExistsError:
    return OutputExistsError(
        f"{path}: file already exists; refusing to overwrite it. Choose another output folder or "
        "file name, or set output.overwrite=true to replace it."
    )


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse directory fsync
        pass
    finally:
        os.close(fd)


def _default_mode() -> int:
    """0o666 minus the process umask: what a plain open() would give (mkstemp gives 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | os.PathLike, writer_fn: Callable[[str], object], overwrite: bool = False) -> str:
    """Create ``path`` atomically by calling ``writer_fn(tmp_path)``.

    ``writer_fn`` receives the path of an empty temporary file in the same folder and must
    (over)write it completely. Returns ``str(path)``. Raises :class:`OutputExistsError` if ``path``
    exists and ``overwrite`` is False; on any error the temporary file is removed and the
    destination is untouched.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not overwrite and os.path.lexists(path):
        raise _exists_error(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=folder)
    os.close(fd)
    try:
        writer_fn(tmp)
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _default_mode())  # results are shared like any file the user writes
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise _exists_error(path) from None
            except OSError as err:  # no hard links here: checked rename
                if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                if os.path.lexists(path):
                    raise _exists_error(path) from None
                os.replace(tmp, path)
        _fsync_dir(folder)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return path
