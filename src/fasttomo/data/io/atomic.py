"""Atomic file writes: a crash never leaves a half-written file, an existing file is never replaced
unless asked.

The writer writes a temporary file in the destination folder (same file system, so the final rename
is atomic); the file is flushed and fsync'ed, then renamed onto the destination and the folder is
fsync'ed. Without ``overwrite`` the final step is a hard link, which fails if the destination
appeared meanwhile (no race), falling back to a checked rename on file systems without links.

Any failure of the writer is a write failure: a library that reports a full disk or a refused
write as something other than an ``OSError`` (torch.save raises ``RuntimeError: [enforce fail at
inline_container.cc] unexpected pos``) is turned into :class:`WriteFailed`, an ``OSError`` whose
``strerror`` says what happened ("No space left on device" when the file system is full), so
callers need to catch ``OSError`` only.
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


class WriteFailed(OSError):
    """A file could not be written (the writer failed with something other than an OSError)."""


def disk_full(folder: str, slack: int = 64 << 10) -> bool:
    """Whether the file system of ``folder`` has (almost) no room left for an unprivileged writer."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < slack


def write_failed(folder: str, exc: BaseException) -> WriteFailed:
    """The :class:`WriteFailed` for a writer's non-OSError ``exc`` in ``folder``."""
    if disk_full(folder):
        return WriteFailed(errno.ENOSPC, os.strerror(errno.ENOSPC))
    detail = " ".join(str(exc).split())[:160]
    return WriteFailed(errno.EIO, f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)


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
        try:
            writer_fn(tmp)
        except (OSError, ValueError):
            raise  # an OSError already says why; a ValueError is the caller's data (no file is written)
        except Exception as exc:  # noqa: BLE001 - any other failure of a writer is a write failure
            raise write_failed(folder, exc) from exc
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
