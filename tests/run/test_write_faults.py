"""A full or read-only disk never costs a run its training (issue 22): every write path treats any
failure as a write failure, on a REAL small file system (a tmpfs mounted for the test; skipped
with the reason where mounting is not allowed). The whole run under a disk that fills or turns
read-only mid-training is tests/run/test_fault_injection.py."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs (needs root); yields its folder and a function that fills it."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or 'mount exit ' + str(res.returncode)})")

    def fill() -> None:
        with open(mnt / "filler", "wb", buffering=0) as f:
            for size in (1 << 16, 512, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    pass

    try:
        yield mnt, fill
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _state() -> dict:
    return {"step": 7, "model": {"w": torch.arange(50_000, dtype=torch.float32)}}


def test_a_checkpoint_on_a_full_disk_is_an_oserror_naming_the_full_disk(small_fs):
    """torch.save reports a full disk as RuntimeError('[enforce fail at inline_container.cc] unexpected
    pos'); it must come out as an OSError saying the disk is full, and leave no partial file."""
    from fasttomo.run.outputs import save_checkpoint_file
    from fasttomo.train.checkpoint import save_checkpoint

    mnt, fill = small_fs
    (mnt / "checkpoints").mkdir()
    fill()
    with pytest.raises(OSError) as info:
        save_checkpoint(mnt / "checkpoints" / "last.pt", _state())
    assert info.value.errno == errno.ENOSPC, info.value
    path, why = save_checkpoint_file(mnt / "checkpoints" / "last.pt", _state())
    assert path is None and why == "No space left on device"
    assert os.listdir(mnt / "checkpoints") == []  # no .part file left on the full disk


def test_results_refused_by_a_full_run_folder_are_rescued(small_fs, tmp_path, monkeypatch):
    """write_volumes records the failure (no exception); rescue keeps a loadable checkpoint and an
    MRC volume with the run's voxel size elsewhere."""
    import tempfile

    from fasttomo.config import Config, from_dict
    from fasttomo.data.io.volume import read_volume
    from fasttomo.run.outputs import VolumeFiles, rescue, save_checkpoint_file, write_volumes
    from fasttomo.train.checkpoint import load_checkpoint

    mnt, fill = small_fs
    cfg = from_dict(Config, {"name": "full disk"})
    volume = np.random.default_rng(0).random((40, 40, 40), dtype=np.float32)
    fill()
    written, failed = write_volumes(mnt, volume, cfg, VolumeFiles(2.5, {}))
    assert not written and set(failed) == {"volume.mrc"}  # output.formats: [mrc] by default
    assert set(failed.values()) == {"No space left on device"}
    assert save_checkpoint_file(mnt / "last.pt", _state())[0] is None
    spare = tmp_path / "spare"
    spare.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    saved = rescue(volume, _state(), cfg, 2.5, {"volume", "checkpoint"})
    assert set(saved) == {"checkpoint", "volume"} and all(p.startswith(str(spare)) for p in saved.values())
    assert torch.equal(load_checkpoint(saved["checkpoint"])["model"]["w"], _state()["model"]["w"])
    data, voxel, _ = read_volume(saved["volume"])
    assert np.array_equal(data, volume) and abs(float(np.ravel(voxel)[0]) - 2.5) < 1e-6


def test_tensorboard_on_a_full_disk_turns_itself_off_with_one_warning(small_fs, caplog, capfd):
    from fasttomo.logging import RunLogger

    mnt, fill = small_fs
    run_log = RunLogger(mnt, main=True, tensorboard=True, progress=False, total=100)
    run_log.scalars(1, {"loss/train": 1.0})
    run_log.writer.flush()
    fill()
    img = np.random.default_rng(0).random((64, 64)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="fasttomo"):
        for step in range(2, 400):
            run_log.scalars(step, {"loss/train": 1.0 / step})
            run_log.image(step, "slices/xy", img)
            if run_log.writer is not None and step % 10 == 0:
                try:
                    run_log.writer.flush()  # as the writer's own timer would, sooner
                except OSError:
                    pass
            if run_log.writer is None:
                break
            time.sleep(0.005)
        run_log.close()
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard logging is off" in r.getMessage()]
    assert run_log.writer is None and len(warnings) == 1, warnings
    assert "No space left on device" in warnings[0] and run_log.tb_error == "No space left on device"
    assert "Traceback" not in capfd.readouterr().err  # the writer thread's death is not printed


def test_the_log_file_on_a_full_disk_warns_once_and_never_raises(small_fs, capfd):
    from fasttomo.logging import add_file_log

    mnt, fill = small_fs
    handler = add_file_log(mnt / "reconstruct.log")
    logger = logging.getLogger("fasttomo.test")
    try:
        logger.info("before")
        fill()
        for i in range(200):
            logger.info("line %d %s", i, "x" * 200)
    finally:
        logging.getLogger("fasttomo").removeHandler(handler)
        handler.close()
    err = capfd.readouterr().err
    assert handler.failed == "No space left on device"
    assert "--- Logging error ---" not in err and "Traceback" not in err
    assert (mnt / "reconstruct.log").read_text().startswith("[")  # what was written before stays


def test_a_message_logged_inside_an_interrupted_log_write_is_written_after_it(tmp_path):
    """A Ctrl-C whose handler logs can arrive while the log file's buffered writer is inside its
    raw write (Python runs signal handlers there when the write is interrupted): writing the
    handler's message there reentered the writer, which raised, and the log stopped for the rest
    of the run. Here the raw file logs from inside its first write, as that signal handler does."""
    import io

    from fasttomo.logging import add_file_log

    logger = logging.getLogger("fasttomo.test")
    path = tmp_path / "reconstruct.log"

    class Interrupted(io.FileIO):
        fired = False

        def write(self, b):
            if not Interrupted.fired:
                Interrupted.fired = True
                logger.warning("SIGINT received: stopping after the current step")  # the signal handler's line
            return super().write(b)

    handler = add_file_log(path)
    handler.stream.close()
    handler.stream = io.TextIOWrapper(io.BufferedWriter(Interrupted(str(path), "w"), buffer_size=64), encoding="utf-8")
    try:
        logger.info("step 10 of 100 %s", "x" * 100)
        logger.info("step 11 of 100")
    finally:
        logging.getLogger("fasttomo").removeHandler(handler)
        handler.close()
    assert Interrupted.fired and handler.failed is None
    lines = [ln.split("] ", 3)[-1] for ln in path.read_text().splitlines()]
    assert lines == ["step 10 of 100 " + "x" * 100, "SIGINT received: stopping after the current step",
                     "step 11 of 100"], lines


def test_a_writer_failing_on_a_disk_with_room_keeps_its_own_reason(tmp_path):
    """Not every failure is a full disk: a writer's own error is reported in a few words."""
    from fasttomo.data.io.atomic import WriteFailed, atomic_write
    from fasttomo.run.outputs import _reason

    def boom(tmp):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0")

    with pytest.raises(WriteFailed) as info:
        atomic_write(tmp_path / "x.pt", boom)
    assert info.value.errno == errno.EIO
    why = _reason(info.value, tmp_path)
    assert why == "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0"


def test_a_slab_written_in_the_background_onto_a_full_disk_fails_the_volume_and_leaves_no_file(small_fs):
    """volume.mrc's slabs go to the file on a writer thread while the next slab is made: a full
    disk under it is still an OSError (ENOSPC) raised to the caller, no slab after it is made
    twice as many times as needed, and no partial file or temporary is left."""
    from fasttomo.data.io.mrc import MrcHeader, write_mrc_slabs

    mnt, _ = small_fs
    shape = (200, 128, 128)  # 12.5 MiB of float32: the 2 MiB file system fills at the 8th slab
    made = []

    def slabs():
        for z0 in range(0, shape[0], 4):
            made.append(z0)
            yield z0, np.full((4, *shape[1:]), float(z0), dtype=np.float32)

    with pytest.raises(OSError) as info:
        write_mrc_slabs(mnt / "volume.mrc", shape, slabs(), MrcHeader(1.0))
    assert info.value.errno == errno.ENOSPC, info.value
    assert len(made) < shape[0] // 4  # stopped at the failure, not after making every slab
    assert sorted(p.name for p in mnt.iterdir()) == []


def test_kept_slabs_written_after_the_return_onto_a_full_disk_fail_the_join_and_leave_no_file(small_fs):
    """With the slab kept by the caller (``kept``) the write goes on after the return: a full disk
    under it is an OSError (ENOSPC) from ``wait_written`` and from the join, and no file or
    temporary is left."""
    from fasttomo.data.io.mrc import MrcHeader, write_mrc_slabs

    mnt, _ = small_fs
    shape = (200, 128, 128)  # 12.5 MiB of float32 on a 2 MiB file system, in one slab (queued at once)
    vol = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    later = []
    mapped = write_mrc_slabs(mnt / "volume.mrc", shape, [(0, vol)], MrcHeader(1.0), later=later, kept=True)
    (pending,) = later
    assert mapped.shape == shape and pending.wait_written().errno == errno.ENOSPC
    del mapped
    with pytest.raises(OSError) as info:
        pending.join()
    assert info.value.errno == errno.ENOSPC, info.value
    assert sorted(p.name for p in mnt.iterdir()) == []


def test_a_run_whose_deferred_volume_writes_fail_reports_them_and_keeps_the_volume_from_its_copy(small_fs):
    """The run's side of a failed deferred write (``Run.volume_ready``, ``Run.join_checkpoint`` on
    the run's own state): the volume the pictures and the rescue read becomes the kept copy's values
    instead of the map of the failed file, and the join reports volume.mrc as failed, by name."""
    from types import SimpleNamespace

    import torch

    from fasttomo.data.io.mrc import MrcHeader, write_mrc_slabs
    from fasttomo.run.run import Run

    mnt, _ = small_fs
    shape = (200, 128, 128)  # 12.5 MiB on a 2 MiB file system
    vol = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    later = []
    mapped = write_mrc_slabs(mnt / "volume.mrc", shape, [(0, vol)], MrcHeader(1.0), later=later, kept=True)
    state = SimpleNamespace(method=SimpleNamespace(volume_on_device=torch.from_numpy(vol)), publishing=later,
                            volume=mapped, checkpoint=None, written={"volume.mrc": str(mnt / "volume.mrc")},
                            failed={}, publish_s={})
    got = Run.volume_ready(state)
    assert got is state.volume and not isinstance(got, np.memmap)
    np.testing.assert_array_equal(got, vol)
    Run.join_checkpoint(state)
    assert state.written == {} and "No space left on device" in state.failed["volume.mrc"], state.failed
    assert sorted(p.name for p in mnt.iterdir()) == []
