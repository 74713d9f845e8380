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
import functools
import os
import sys
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


def atomic_write(path: str | os.PathLike, writer_fn: Callable[[str], object], overwrite: bool = False,
                 later: list | None = None) -> str:
    """Create ``path`` atomically by calling ``writer_fn(tmp_path)``.

    ``writer_fn`` receives the path of an empty temporary file in the same folder and must
    (over)write it completely. Returns ``str(path)``. Raises :class:`OutputExistsError` if ``path``
    exists and ``overwrite`` is False; on any error the temporary file is removed and the
    destination is untouched.

    With ``later`` (a list), the last step (fsync, rename) runs on a thread instead, a
    :class:`PublishLater` appended to ``later`` before ``writer_fn`` is called (the writer may hand
    it the ranges it has written, to be sent to the disk at once); the rename may come any time
    after ``writer_fn`` returns, so whatever must read the file opens it (or maps it) inside
    ``writer_fn``; the caller must :meth:`PublishLater.join` it, which returns ``str(path)`` or
    raises.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not overwrite and os.path.lexists(path):
        raise _exists_error(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=folder)
    os.close(fd)
    publish = None
    try:
        if later is not None:
            publish = PublishLater(tmp, path, overwrite)
            later.append(publish)
        try:
            writer_fn(tmp)
        except (OSError, ValueError):
            raise  # an OSError already says why; a ValueError is the caller's data (no file is written)
        except Exception as exc:  # noqa: BLE001 - any other failure of a writer is a write failure
            raise write_failed(folder, exc) from exc
        if publish is not None:
            publish.finish()
            return path
        with open(tmp, "rb+") as f:
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path, overwrite)
    finally:
        if publish is not None and not publish.finished:
            publish.abandon()
            later.remove(publish)
        if publish is None and os.path.lexists(tmp):
            os.unlink(tmp)
    return path


def _publish(tmp: str, path: str, overwrite: bool) -> None:
    """The complete, fsync'ed ``tmp`` made ``path`` (see the module doc); ``tmp`` is gone after."""
    folder = os.path.dirname(os.path.abspath(path))
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
        if os.path.lexists(tmp):
            os.unlink(tmp)
    _fsync_dir(folder)


_ABANDON, _DEFERRED = object(), object()


class PublishLater:
    """The end of an :func:`atomic_write` on a (non-daemon) thread: the ranges the writer hands
    over (:meth:`written`) are sent to the disk as they come (``sync_file_range``, without
    waiting), then, once the writer has finished, the file is fsync'ed and renamed onto its
    destination. So a camera-sized volume goes to the disk while the run scores it and draws its
    pictures, and its name appears only once all of it is on the disk, as with a plain
    :func:`atomic_write`. :meth:`join` waits and returns the path, or raises the error (the
    temporary file removed, the destination untouched). ``seconds``: the fsync's and the
    rename's time on the thread.

    A writer may also leave writes going on after it returns (:meth:`defer`): the fsync and the
    rename then wait for them, and :meth:`wait_written` waits for them alone (the file's data
    complete, not yet on the disk). ``write_seconds``: those writes' own time."""

    def __init__(self, tmp: str, path: str, overwrite: bool):
        import queue
        import threading

        self.tmp, self.path, self.overwrite = tmp, path, overwrite
        self.finished, self.error, self.seconds, self.write_seconds = False, None, 0.0, 0.0
        self._ranges: queue.SimpleQueue = queue.SimpleQueue()
        self._writes: list = []  # one Event per deferred write, set when it is done
        self._write_errors: list = []
        self._thread = threading.Thread(target=self._run, name="fasttomo-publish")
        self._thread.start()

    def written(self, offset: int, nbytes: int) -> None:
        """The writer has written ``nbytes`` at ``offset``: send them to the disk."""
        self._ranges.put((offset, nbytes))

    def defer(self):
        """Called by the writer before it returns: its writes go on elsewhere (a thread), which
        calls the function returned, ``done(error or None, seconds)``, once they are all made."""
        import threading

        event = threading.Event()
        self._writes.append(event)
        self._ranges.put(_DEFERRED)

        def done(error: BaseException | None, seconds: float = 0.0) -> None:
            self.write_seconds += seconds
            if error is not None:
                self._write_errors.append(error)
            event.set()
            self._ranges.put((_DEFERRED, error))

        return done

    def wait_written(self) -> BaseException | None:
        """Wait for the deferred writes (none: at once); their error, or None when the file's
        data are all written (in the page cache at least)."""
        for event in self._writes:
            event.wait()
        return self._write_errors[0] if self._write_errors else None

    def finish(self) -> None:
        """The writer is done (its deferred writes aside): fsync and rename on the thread."""
        self.finished = True
        self._ranges.put(None)

    def abandon(self) -> None:
        """The writer failed: the thread stops and removes the temporary file."""
        self._ranges.put(_ABANDON)
        self._thread.join()

    def join(self) -> str:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.path

    def _next(self, state: dict):
        """The next range to send to the disk, or None once the writer and its deferred writes are
        done (their first error raised) or the writer failed (``state["abandon"]``)."""
        while True:
            item = self._ranges.get()
            if item is _ABANDON:
                state["abandon"] = True
                return None
            if item is _DEFERRED:
                state["open"] += 1
            elif item is None:
                state["open"] -= 1
            elif isinstance(item, tuple) and item[0] is _DEFERRED:
                state["open"] -= 1
                state["error"] = state["error"] or item[1]
            else:
                return item
            if state["open"] == 0:
                if state["error"] is not None:
                    raise state["error"]
                return None

    def _run(self) -> None:
        import time

        state = {"open": 1, "error": None, "abandon": False}
        try:
            fd = os.open(self.tmp, os.O_RDWR)
            try:
                while (item := self._next(state)) is not None:
                    start_writeback(fd, *item)
                if not state["abandon"]:
                    t0 = time.perf_counter()
                    os.fsync(fd)
                    self.seconds += time.perf_counter() - t0
            finally:
                os.close(fd)
            if not state["abandon"]:
                t0 = time.perf_counter()
                _publish(self.tmp, self.path, self.overwrite)
                self.seconds += time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - raised by join()
            self.error = exc
            while not state["abandon"] and state["open"] > 0:  # the writer and its deferred writes may go on
                try:
                    self._next(state)
                except BaseException:  # noqa: BLE001 - the first error is the one reported
                    pass
        finally:
            if os.path.lexists(self.tmp) and (self.error is not None or state["abandon"]):
                os.unlink(self.tmp)


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing the range's dirty pages to the disk without waiting for them
    (SYNC_FILE_RANGE_WRITE; it may wait for the device's queue); nothing where the call is missing
    or the file system refuses it (the fsync does it all)."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, 2)
