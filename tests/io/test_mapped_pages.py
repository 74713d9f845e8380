"""Pages of a memory-mapped volume read slab by slab leave the process (drop_mapped_pages), so
reading a camera-size volume through its map (the central slices, the streamed scores) does not
hold it all resident; the values read are unchanged."""

from __future__ import annotations

import sys

import mrcfile
import numpy as np
import pytest

from fasttomo.data.io.mrc import drop_mapped_pages, mrc_memmap
from fasttomo.quality.report import central_slices

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _volume(tmp_path, shape=(64, 512, 512)):
    """A float32 MRC of 64 MiB with a known pattern, mapped read-only."""
    path = tmp_path / "v.mrc"
    with mrcfile.new_mmap(path, shape, mrc_mode=2) as m:
        for z in range(shape[0]):
            m.data[z] = np.arange(shape[1] * shape[2], dtype=np.float32).reshape(shape[1:]) + z
    return mrc_memmap(path)


def test_dropped_pages_leave_the_process_and_read_back_the_same(tmp_path):
    vol = _volume(tmp_path)
    before = _rss_mb()
    total = float(np.sum(vol, dtype=np.float64))  # touches all 64 MiB
    assert _rss_mb() - before > 48
    drop_mapped_pages(vol)
    assert _rss_mb() - before < 8
    assert float(np.sum(vol, dtype=np.float64)) == total  # paged in again, the same values


def test_central_slices_of_a_map_are_the_slices_without_holding_the_volume(tmp_path):
    vol = _volume(tmp_path)
    before = _rss_mb()
    xy, xz, yz = central_slices(vol)
    assert _rss_mb() - before < 16  # the YZ slice touches every page; they were released
    np.testing.assert_array_equal(xy, vol[32])
    np.testing.assert_array_equal(xz, vol[:, 256])
    np.testing.assert_array_equal(yz, vol[:, :, 256])
    plain = np.array(vol)
    for a, b in zip(central_slices(plain), (plain[32], plain[:, 256], plain[:, :, 256])):
        np.testing.assert_array_equal(a, b)


def test_arrays_that_are_not_file_maps_are_left_alone():
    a = np.ones((4, 5), dtype=np.float32)
    drop_mapped_pages(a)
    drop_mapped_pages(a[:, 1])
    assert a.sum() == 20
