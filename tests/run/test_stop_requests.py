"""run/stop.py: what a SIGINT or SIGTERM does in each phase of a run, with real signals."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from fasttomo.run.stop import RunInterrupted, StopRequests


def _signal_and_wait(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(2)  # the handler runs in the main thread, here, long before this ends


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_setup_interrupt_is_not_taken_for_the_failure_of_the_code_it_lands_in(signum):
    """During setup a signal stops the run at once, wherever the main thread is: inside a
    best-effort ``except Exception`` (an optional import, a header parser) it still stops the run."""
    with StopRequests() as stop:
        with pytest.raises(RunInterrupted) as info:
            try:
                _signal_and_wait(signum)
            except Exception:  # noqa: BLE001 - what a best-effort block does
                pass
    assert info.value.exit_code == 128 + signum and stop.signum == signum
    assert "before training started" in str(info.value)


def test_a_setup_interrupt_inside_a_log_call_stops_the_run():
    """logging's handlers catch what their emit raises (Exception) and print it: the interrupt
    must pass through a handler that is writing when it comes."""

    class Slow(logging.Handler):
        def emit(self, record):
            try:
                _signal_and_wait(signal.SIGINT)
            except Exception:  # noqa: BLE001 - as logging.StreamHandler.emit does
                self.handleError(record)

    log = logging.getLogger("fasttomo.test_stop_requests")
    handler = Slow()
    log.addHandler(handler)
    try:
        with StopRequests():
            with pytest.raises(RunInterrupted):
                log.warning("writing when the signal comes")
    finally:
        log.removeHandler(handler)


def test_in_training_a_signal_asks_to_stop_after_the_step():
    with StopRequests() as stop:
        stop.phase = "training"
        _signal_and_wait(signal.SIGINT)
        assert stop.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler given back
