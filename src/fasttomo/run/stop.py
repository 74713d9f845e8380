"""Stopping a run cleanly on SIGINT (Ctrl-C) and SIGTERM (what schedulers and `kill` send).

While a run trains, the first signal only sets a flag: the Trainer finishes the current step and
stops, and the pipeline writes the volume so far and a checkpoint, logs
``stopped at step N; resume with ...`` and exits with 128 + the signal number (130 for SIGINT,
143 for SIGTERM). A second signal exits at once (same codes; files already written are whole,
being written atomically). Before training starts there is nothing to save, so the first signal
stops the run at once (:class:`RunInterrupted`).

Under DDP every rank must stop after the same step: the flag is all-reduced every
``DDP_CHECK_EVERY`` steps (one tiny collective) and all ranks stop together. torchrun forwards
SIGINT/SIGTERM to every worker.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger("fasttomo")

DDP_CHECK_EVERY = 10
_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class RunInterrupted(BaseException):
    """The run was stopped by a signal; ``exit_code`` is 128 + the signal number. A BaseException,
    as KeyboardInterrupt is: raised wherever the main thread is when the signal comes, it must not
    be taken for the failure of the code it lands in by an ``except Exception`` there (a
    best-effort import that would fall back, a header parser that would call the file corrupt,
    logging's emit that would print it and go on)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + int(signum)


def signal_name(signum: int) -> str:
    return _NAMES.get(signum, f"signal {signum}")


class StopRequests:
    """Context manager installing the SIGINT/SIGTERM handlers (main thread only; elsewhere the
    handlers are left alone and nothing is ever requested). ``phase`` is ``setup`` (a signal
    raises :class:`RunInterrupted` at once), ``training`` (a signal sets :attr:`signum`; the
    Trainer polls :meth:`should_stop`), ``saving`` (a signal is noted, the writes go on) or
    ``halves`` (the half-set fits, whose Trainers poll it too)."""

    def __init__(self, device=None, world_size: int = 1):
        self.device = device
        self.world_size = world_size
        self.signum: int | None = None
        self.phase = "setup"
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal_name(signum)
        if self.signum is not None:
            log.error("second interrupt (%s): exiting at once without saving more", name)
            logging.shutdown()
            os._exit(128 + signum)
        self.signum = signum
        if self.phase == "setup":
            raise RunInterrupted(signum, f"interrupted ({name}) before training started; nothing to save")
        if self.phase == "training":
            log.warning("%s received: stopping after the current step and saving the volume and a checkpoint "
                        "(press Ctrl-C again to exit at once without saving)", name)
        elif self.phase == "halves":
            log.warning("%s received: stopping the half-set fits after the current step (the volume and the "
                        "checkpoint of the whole fit are saved; press Ctrl-C again to exit at once)", name)
        else:
            log.warning("%s received while saving: finishing the writes (press Ctrl-C again to exit at once)", name)

    def agreed(self) -> bool:
        """Whether a stop was requested on any rank: under DDP a collective every rank calls at
        the same point (ranks that decide apart, one skipping a collective the other enters, hang)."""
        return self.should_stop(0)

    def should_stop(self, step: int) -> bool:
        """True when a stop was requested (on any rank, under DDP: decided together every
        DDP_CHECK_EVERY steps)."""
        if self.world_size <= 1:
            return self.signum is not None
        if step % DDP_CHECK_EVERY:
            return False
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0.0 if self.signum is None else float(self.signum)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        if value and self.signum is None:
            self.signum = value
        return bool(value)
