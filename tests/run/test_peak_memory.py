"""The run's peak host memory (the timeline in metrics.json, the camera benchmarks' host column)
is the process's own: a run started by a process that once held a lot does not report that."""

from __future__ import annotations

import resource
import subprocess
import sys

import numpy as np
import pytest

CHILD = ("import resource; from fasttomo.timeline import peak_rss_bytes; "
         "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and ru_maxrss's inheritance are Linux's")
def test_a_child_reports_its_own_peak_not_its_parents():
    held = np.ones(400 * 2**20 // 8)  # 400 MiB resident in this process
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 >= held.nbytes
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120)
    own, inherited = (int(v) for v in out.stdout.split())
    assert inherited >= held.nbytes  # getrusage in the child carries this process's peak over
    assert own < 200 * 2**20  # the child's own: an interpreter and numpy, far below 400 MiB
    del held


PHASES = ("import numpy as np; from fasttomo import timeline as t\n"
          "a = np.ones(400 * 2**20 // 8); del a\n"
          "first = t.phase_peaks()\n"
          "b = np.ones(50 * 2**20 // 8)\n"
          "print(first['host'], t.phase_peaks()['host'], t.peak_rss_bytes(), t._HOST_RESETS)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and its reset are Linux's")
def test_phase_peaks_are_apart_and_the_process_peak_keeps_them_all():
    out = subprocess.run([sys.executable, "-c", PHASES], capture_output=True, text=True, check=True, timeout=120)
    first, second, whole, resets = out.stdout.split()
    if resets != "True":
        pytest.skip("this kernel does not restart VmHWM through /proc/self/clear_refs")
    assert int(first) >= 400 * 2**20  # the phase that held 400 MiB
    assert 50 * 2**20 <= int(second) < 300 * 2**20  # the next one: its 50 MiB, not the 400 before it
    assert int(whole) >= 400 * 2**20  # the process's peak is still the whole run's
