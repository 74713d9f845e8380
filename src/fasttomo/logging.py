"""Run logging: the console handler, a rank-0 TensorBoard writer, a tqdm progress bar and the
run's log file.

* :class:`ConsoleHandler` (configs/hydra/job_logging/fasttomo.yaml) prints INFO to stdout and
  warnings and errors to stderr; while a progress bar is on screen it prints through
  ``tqdm.write``, so messages appear above the bar instead of inside it.
* The bar is drawn only when stderr is a terminal: a redirected log gets no carriage returns, and
  periodic progress lines (logger ``fasttomo.progress``) take its place. Those lines always go to
  reconstruct.log; on the console they show only when there is no bar.
* Under DDP only rank 0 logs (:func:`quiet_other_ranks`), unless ``logging.all_ranks=true``: then
  every rank logs, each line prefixed with its rank.

RunLogger is a no-op on ranks other than 0, so callers never branch on the rank.

Logging never ends a run: when TensorBoard's files cannot be written (a full disk, a folder turned
read-only) RunLogger turns TensorBoard off with one warning, and when reconstruct.log cannot be
written its handler stops with one warning on the console.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger("fasttomo")
PROGRESS_LOGGER = "fasttomo.progress"


def _bars_on_screen() -> bool:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return False
    return any(not getattr(b, "disable", False) for b in list(getattr(tqdm, "_instances", ())))


class _OneAtATime:
    """A handler mixin: a message logged while this thread is inside the handler already (a
    signal handler that logs, run by Python inside an interrupted write to the same file) is
    written right after the message being written, not into the middle of it: a reentrant write
    to one buffered stream raises, and the run's log would stop there."""

    _local = threading.local()

    def handle(self, record: logging.LogRecord) -> bool:
        busy = self._local.__dict__.setdefault(id(self), [])
        if busy:  # inside this handler on this thread: queued for the outer call
            busy[0].append(record)
            return True
        queue: list[logging.LogRecord] = []
        busy.append(queue)
        try:
            done = super().handle(record)  # type: ignore[misc]
            while queue:
                super().handle(queue.pop(0))  # type: ignore[misc]
        finally:
            busy.clear()
            while queue:  # queued between the last check and the clear: handled as any message now
                self.handle(queue.pop(0))
        return done


class ConsoleHandler(_OneAtATime, logging.Handler):
    """INFO to stdout, WARNING and above to stderr (streams looked up at each message, so a
    redirected or captured stream is honoured); above the progress bar while one is drawn."""

    prefix = ""
    """Put before every message (the rank, with logging.all_ranks under DDP)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            bars = _bars_on_screen()
            if bars and record.name == PROGRESS_LOGGER:
                return  # the bar shows the progress; the lines go to reconstruct.log only
            msg = self.prefix + self.format(record)
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            if bars:
                from tqdm import tqdm

                tqdm.write(msg, file=stream)
            else:
                stream.write(msg + "\n")
                stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def quiet_other_ranks(rank: int, all_ranks: bool) -> object:
    """Under DDP: only rank 0 logs (other ranks keep their errors), or with ``all_ranks`` every
    rank logs with a "[rank N] " prefix. Returns a token for :func:`restore_ranks`."""
    logger = logging.getLogger("fasttomo")
    token = (logger.level, ConsoleHandler.prefix)
    if all_ranks:
        ConsoleHandler.prefix = f"[rank {rank}] "
    elif rank != 0:
        logger.setLevel(logging.ERROR)
    return token


def restore_ranks(token: object) -> None:
    level, prefix = token  # type: ignore[misc]
    logging.getLogger("fasttomo").setLevel(level)
    ConsoleHandler.prefix = prefix


def progress_line(step: int, total: int, loss: float | None, seconds: float, steps_done: int,
                  val: float | None = None) -> str:
    """"step 300/1500 (20 %): loss 1.234e-03, 11.2 steps/s, 1 min 47 s left"."""
    rate = steps_done / seconds if seconds > 0 else None
    parts = [f"step {step}/{total} ({100.0 * step / max(total, 1):.0f} %)"]
    vals = []
    if loss is not None:
        vals.append(f"loss {loss:.4g}")
    if val is not None:
        vals.append(f"validation {val:.4g}")
    if rate:
        vals.append(f"{rate:.3g} steps/s")
        if step < total:
            vals.append(f"{duration_text((total - step) / rate)} left")
    return parts[0] + (": " + ", ".join(vals) if vals else "")


def duration_text(seconds: float) -> str:
    """12.3 s, 4 min 05 s, 1 h 02 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def size_text(n: int) -> str:
    """A byte count for people: 512 B, 3.4 KiB, 1.2 MiB ..."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split())[:160] or type(exc).__name__


class RunFileHandler(_OneAtATime, logging.FileHandler):
    """The run's log file; when a message cannot be written (full disk, read-only folder) it says
    so once on the console and writes nothing more (no logging traceback per message)."""

    failed: str | None = None
    """Why the file stopped being written (None while it works)."""

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed is None:
            super().emit(record)

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.handleError(None)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the last buffered lines cannot be written either
            pass

    def handleError(self, record: logging.LogRecord | None) -> None:  # noqa: N802 - logging's name
        if self.failed is not None:
            return
        exc = sys.exc_info()[1]
        self.failed = _why(exc) if exc is not None else "unknown error"
        logging.getLogger("fasttomo").warning("cannot write the log file %s (%s); messages go to the console only",
                                              self.baseFilename, self.failed)


def add_file_log(path: Path, overwrite: bool = False, append: bool = False) -> logging.Handler:
    """Send the 'fasttomo' loggers to ``path`` too (opened after the output folder was checked;
    an existing log is replaced only when the user asked to overwrite, and appended to when a
    run continues in its own folder)."""
    handler = RunFileHandler(path, mode="a" if append else "w" if overwrite else "x", encoding="utf-8")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    logging.getLogger("fasttomo").addHandler(handler)
    logging.getLogger("fasttomo").setLevel(logging.INFO)
    return handler


def to_uint8(img: np.ndarray, lo: float | None = None, hi: float | None = None) -> np.ndarray:
    """Scale an image to 0..255 (percentile window 0.5-99.5 unless lo/hi given)."""
    img = np.asarray(img, dtype=np.float32)
    if lo is None or hi is None:
        lo, hi = np.percentile(img, [0.5, 99.5])
    if hi <= lo:
        hi = lo + 1e-6
    return (np.clip((img - lo) / (hi - lo), 0, 1) * 255).astype(np.uint8)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


_previous_excepthook = None


def _tensorboard_thread_hook(args) -> None:
    """threading.excepthook: TensorBoard's writer thread dies on a failed write and the next call
    on its writer raises the error (RunLogger turns TensorBoard off then); its traceback is not
    printed. Other threads' errors go to the previous hook."""
    if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, Exception):
        return
    (_previous_excepthook or threading.__excepthook__)(args)


def quiet_tensorboard_threads() -> None:
    """Install :func:`_tensorboard_thread_hook` (once per process)."""
    global _previous_excepthook
    if threading.excepthook is not _tensorboard_thread_hook:
        _previous_excepthook = threading.excepthook
        threading.excepthook = _tensorboard_thread_hook


class RunLogger:
    """TensorBoard scalars/images and a progress bar, active on the main rank only. A TensorBoard
    write that fails turns TensorBoard off for the rest of the run, with one warning."""

    def __init__(self, out_dir: Path | None, *, main: bool, tensorboard: bool, progress: bool, total: int,
                 initial: int = 0):
        self.main = main
        self.writer = None
        self.bar = None
        self.tb_dir = None if out_dir is None else Path(out_dir) / "tb"
        self.tb_error: str | None = None
        """Why TensorBoard logging stopped (None while it works or was never on)."""
        if main and tensorboard and out_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                quiet_tensorboard_threads()
                self.writer = SummaryWriter(log_dir=str(self.tb_dir))
            except Exception as exc:  # noqa: BLE001 - logging must never end a run
                self._tensorboard_failed(exc)
        if main and progress and _is_terminal(sys.stderr):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="reconstruct", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def _tensorboard_failed(self, exc: BaseException) -> None:
        """Turn TensorBoard off for the rest of the run, with one warning."""
        self.tb_error = _why(exc)
        log.warning("TensorBoard logging is off for the rest of this run: cannot write %s (%s); training goes on",
                    self.tb_dir, self.tb_error)
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - it failed already; nothing more to save
                pass

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            try:
                for k, v in values.items():
                    self.writer.add_scalar(k, v, step)
            except Exception as exc:  # noqa: BLE001 - logging must never end a run
                self._tensorboard_failed(exc)

    def image(self, step: int, tag: str, img: np.ndarray) -> None:
        """A 2-D float image, windowed to uint8 (HW)."""
        if self.writer is not None:
            try:
                self.writer.add_image(tag, to_uint8(img), step, dataformats="HW")
            except Exception as exc:  # noqa: BLE001 - logging must never end a run
                self._tensorboard_failed(exc)

    def progress(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            try:
                self.writer.flush()
                self.writer.close()
            except Exception as exc:  # noqa: BLE001 - logging must never end a run
                self._tensorboard_failed(exc)
            self.writer = None
