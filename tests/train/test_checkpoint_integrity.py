"""Checkpoints carry a checksum of their contents, verified at load (issue 10, case 2): damaged
data is refused with an error naming the file, never loaded; error texts always say what is
wrong and never advise loading with weights_only=False."""

from __future__ import annotations

import os
import time
import zipfile

import pytest
import torch

from fasttomo.train.checkpoint import CheckpointError, checksum, find_checkpoint, load_checkpoint, save_checkpoint


def _state():
    g = torch.Generator().manual_seed(0)
    return {"step": 7, "model": {"w": torch.randn(4000, generator=g), "idx": torch.arange(50)},
            "history": [[1, 0.5], [2, 0.25]], "config": {"optim": {"steps": 7, "betas": [0.9, 0.99]}}}


def _tensor_record(path) -> tuple[int, int]:
    """(offset, size) of the largest stored record (the tensor data) inside the checkpoint zip."""
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + n + m, info.file_size


def _assert_clear(msg: str, path) -> None:
    assert str(path) in msg
    assert "weights_only" not in msg and "weights_only=False" not in msg
    assert not msg.rstrip().endswith(":"), msg


def test_random_bytes_in_tensor_data_are_refused(tmp_path):
    path = save_checkpoint(tmp_path / "ck.pt", _state())
    assert load_checkpoint(path)["step"] == 7
    offset, size = _tensor_record(path)
    data = bytearray(path.read_bytes())
    data[offset + 100: offset + 1100] = os.urandom(1000)  # 1000 random bytes into the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt.*checksum") as info:
        load_checkpoint(path)
    _assert_clear(str(info.value), path)


def test_empty_and_random_files_get_a_clear_reason(tmp_path):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"truncated or corrupt: the file is empty \(0 bytes\)") as info:
        load_checkpoint(empty)
    _assert_clear(str(info.value), empty)
    noise = tmp_path / "noise.pt"
    noise.write_bytes(os.urandom(5000))
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_checkpoint(noise)
    _assert_clear(str(info.value), noise)


@pytest.mark.parametrize("fmt", ["mrc", "h5"])
def test_a_volume_given_as_resume_is_named_a_volume(tmp_path, fmt):
    """resume=<run>/volume.mrc (a run's result, not its state) says what the file is and what to give."""
    import numpy as np

    from fasttomo.data.io.volume import write_volume

    run = tmp_path / "run"
    run.mkdir()
    path = write_volume(run / f"volume.{fmt}", np.zeros((4, 5, 6), np.float32), 1.0, label="test", attrs={}, fmt=fmt)
    with pytest.raises(CheckpointError, match=rf"resume=.*volume\.{fmt}: this is .*, not a checkpoint; give the run "
                                              rf"folder \(resume=.*run\) or its checkpoints/last\.pt"):
        load_checkpoint(path)


def test_checksum_covers_values_and_structure():
    a = _state()
    b = _state()
    assert checksum(a) == checksum(b)
    b["history"][1][1] = 0.26
    assert checksum(a) != checksum(b)
    c = _state()
    c["model"]["idx"] = c["model"]["idx"].to(torch.int32)  # same values, other dtype
    assert checksum(a) != checksum(c)
    d = _state()
    d["config"]["optim"]["betas"] = (0.9, 0.99)  # a tuple comes back from torch.load as a tuple or list
    assert checksum(a) == checksum(d)


def test_resume_from_a_run_folder_takes_the_newest_intact_checkpoint(tmp_path):
    ckdir = tmp_path / "run" / "checkpoints"
    old = save_checkpoint(ckdir / "step0000010.pt", {**_state(), "step": 10})
    time.sleep(0.01)
    new = save_checkpoint(ckdir / "last.pt", {**_state(), "step": 20})
    assert find_checkpoint(tmp_path / "run") == new
    new.write_bytes(new.read_bytes()[:-200])  # the newest one is damaged: the older one is taken
    assert find_checkpoint(tmp_path / "run") == old
    with pytest.raises(CheckpointError, match="no checkpoint"):
        find_checkpoint(tmp_path)


def test_a_checkpoint_written_in_the_background_saves_the_state_of_its_start(tmp_path):
    """The run's checkpoint is written on a thread while the run scores and draws: what it saves
    is the state when it was started, although the run's tensors change right after; join()
    records the file, or the reason it could not be written (never raises)."""
    from fasttomo.run.results import CheckpointWrite

    state = _state()
    before = state["model"]["w"].clone()
    job = CheckpointWrite(tmp_path, state)
    state["model"]["w"].zero_()  # the run goes on with its tensors
    written, failed = {}, {}
    job.join(written, failed)
    assert not failed and written == {"checkpoints/last.pt": str(tmp_path / "checkpoints" / "last.pt")}
    loaded = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    assert torch.equal(loaded["model"]["w"], before) and loaded["step"] == 7
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where the folder goes")
    written, failed = {}, {}
    CheckpointWrite(blocked, _state()).join(written, failed)
    assert not written and "checkpoints/last.pt" in failed and failed["checkpoints/last.pt"]
