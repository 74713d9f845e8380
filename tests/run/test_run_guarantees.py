"""What a run guarantees (issue 10, cases 2-7; README "What a run guarantees"), checked on real
processes where the behaviour is about processes (signals, locks, kills, exit codes) and in
process with injected write failures where it is about files.

Each test failed on the code before issue 10: corrupt checkpoints were loaded, a failing write
lost the finished volume, overwrite left the previous run's files, two runs shared a folder,
failed runs left an empty log that blocked the rerun and empty dated folders, signals saved
nothing, and resume ignored the checkpoint's config."""

from __future__ import annotations

import json
import os
import re
import signal
import shutil
import time
from collections import namedtuple
from pathlib import Path

import mrcfile
import numpy as np
import pytest
from cli_helpers import TINY, TINY_RUN, cli, start, strict_json, wait_for_text

from fasttomo.quality.report import headline
from fasttomo.run.outputs import OutputWriteError
from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.run.folder import OutputFolderError
from fasttomo.train.checkpoint import load_checkpoint, save_checkpoint

LONG = [*TINY, "optim.steps=1000000"]  # runs until stopped
TRAINING = "training from step"


def _one_line_error(res, *needles: str) -> str:
    text = res.stdout + res.stderr
    assert "Traceback" not in text, text
    errors = [ln for ln in text.splitlines() if "[ERROR]" in ln]
    assert len(errors) == 1, text
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


# ----------------------------------------------------------------------------------- case 1
def test_cli_divergence_is_exit_3_with_one_line_not_a_segfault(tmp_path):
    """optim.lr_decoder=1e6 used to end in a segmentation fault (exit 139)."""
    out = tmp_path / "run"
    res = cli([*TINY, "optim.steps=40", "optim.lr_decoder=1e6", "guard.check_every=5", "guard.max_rollbacks=1",
               f"hydra.run.dir={out}"], tmp_path)
    assert res.returncode == 3, res.stdout + res.stderr
    _one_line_error(res, "training diverged", "optim.lr_decoder=1e+06")
    assert not list(out.glob("volume*")) and strict_json(out / "manifest.json")["status"] == "diverged"


# ----------------------------------------------------------------------------------- case 2
def test_cli_resume_from_a_damaged_checkpoint_is_one_line_and_leaves_nothing(tmp_path):
    good = tmp_path / "first"
    run(compose_config([*TINY, "optim.steps=2", f"output.dir={good}"]))
    ck = good / "checkpoints" / "last.pt"
    data = bytearray(ck.read_bytes())
    data[len(data) // 2: len(data) // 2 + 1000] = os.urandom(1000)
    ck.write_bytes(bytes(data))
    res = cli([f"resume={ck}", "optim.steps=4"], tmp_path)
    assert res.returncode == 2
    _one_line_error(res, str(ck), "corrupt")
    assert "weights_only" not in res.stdout + res.stderr
    assert not (tmp_path / "outputs").exists()  # no empty dated folder either


# ----------------------------------------------------------------------------------- case 3
def _rescued(msg: str, name: str) -> Path:
    found = re.search(rf"rescued to: (\S*/fasttomo-rescue-[^/]+/{re.escape(name)})", msg)
    assert found, msg
    return Path(found.group(1))


def _fail_inside(folder: Path, original, exc: OSError):
    def patched(path, *args, **kwargs):
        if Path(path).resolve().is_relative_to(folder.resolve()):
            raise exc
        return original(path, *args, **kwargs)
    return patched


def test_checkpoint_write_failure_keeps_the_volume_and_rescues_the_checkpoint(tmp_path, monkeypatch):
    import fasttomo.train.checkpoint as ckpt

    out = tmp_path / "run"
    monkeypatch.setattr(ckpt, "save_checkpoint", _fail_inside(out, ckpt.save_checkpoint,
                                                              PermissionError(13, "Permission denied")))
    with pytest.raises(OutputWriteError) as info:
        run(compose_config([*TINY, "optim.steps=3", f"output.dir={out}"]))
    msg = str(info.value)
    assert (out / "volume.mrc").is_file()  # written first, kept
    assert "checkpoints/last.pt (Permission denied)" in msg and f"saved: {out / 'volume.mrc'}" in msg
    rescued = _rescued(msg, "last.pt")
    assert load_checkpoint(rescued)["step"] == 3
    assert "resume=" in msg
    assert strict_json(out / "manifest.json")["status"] == "failed"
    assert "could not write" in (out / "reconstruct.log").read_text()
    shutil.rmtree(rescued.parent)


def test_volume_write_failure_keeps_the_checkpoint(tmp_path, monkeypatch):
    import errno

    import fasttomo.data.io.mrc as mrc

    out = tmp_path / "run"  # the MRC writer under both the slab-wise and the one-shot export
    monkeypatch.setattr(mrc, "write_mrc_slabs", _fail_inside(out, mrc.write_mrc_slabs,
                                                             OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OutputWriteError, match=r"volume\.mrc \(No space left on device\)") as info:
        run(compose_config([*TINY, "optim.steps=3", f"output.dir={out}"]))
    msg = str(info.value)
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == 3
    assert f"saved: {out / 'checkpoints' / 'last.pt'}" in msg
    rescued = _rescued(msg, "volume.mrc")
    assert rescued.is_file()
    shutil.rmtree(rescued.parent)


def test_a_volume_that_cannot_take_its_name_is_rescued_whole(tmp_path, monkeypatch):
    """volume.mrc goes to the disk and takes its name on a thread after the export: when that last
    step fails (here its rename, refused), the run says so by name, writes no volume.mrc and no
    temporary file into the run folder, and saves the volume, whole, in a rescue folder."""
    import errno

    import fasttomo.data.io.atomic as atomic

    out, original = tmp_path / "run", atomic._publish

    def refuse_the_volume(tmp, path, overwrite):
        if Path(path) == out / "volume.mrc":
            raise PermissionError(errno.EACCES, "Permission denied")
        return original(tmp, path, overwrite)

    monkeypatch.setattr(atomic, "_publish", refuse_the_volume)
    with pytest.raises(OutputWriteError, match=r"volume\.mrc \(.*Permission denied") as info:
        run(compose_config([*TINY, "optim.steps=3", f"output.dir={out}"]))
    assert not (out / "volume.mrc").exists() and not list(out.glob(".volume.mrc.*"))
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == 3
    rescued = _rescued(str(info.value), "volume.mrc")
    with mrcfile.open(rescued, permissive=True) as m:
        assert m.data.shape == (12, 20, 24) and np.isfinite(m.data).all() and float(np.abs(m.data).max()) > 0
    assert strict_json(out / "manifest.json")["status"] == "failed"
    shutil.rmtree(rescued.parent)


def test_a_failing_periodic_checkpoint_does_not_end_the_training(tmp_path, monkeypatch):
    import errno

    import fasttomo.train.checkpoint as ckpt

    original = ckpt.save_checkpoint

    def full_disk(path, state):
        if Path(path).name.startswith("step"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, state)

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk)
    out = tmp_path / "run"
    metrics = run(compose_config([*TINY, "optim.steps=4", "logging.checkpoint_every=2", f"output.dir={out}"]))
    assert metrics["steps"] == 4 and (out / "checkpoints" / "last.pt").is_file()
    assert "could not write the checkpoint of step 2 (No space left on device); training goes on" in \
        (out / "reconstruct.log").read_text()


def test_unwritable_output_folder_is_one_line_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    res = cli([*TINY, "optim.steps=2", f"output.dir={tmp_path / 'afile' / 'run'}", f"hydra.run.dir={tmp_path / 'h'}"],
              tmp_path)
    assert res.returncode == 2
    _one_line_error(res, "which is a file, not a folder", "give a folder")  # refused before Hydra makes h/
    assert not (tmp_path / "h").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder_is_one_line_error(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        res = cli([*TINY, "optim.steps=2", f"hydra.run.dir={folder}"], tmp_path)
    finally:
        folder.chmod(0o755)
    assert res.returncode == 2
    _one_line_error(res, "cannot write to output folder")


def test_too_little_free_space_is_refused_before_training(tmp_path, monkeypatch):
    import fasttomo.run.preflight as pf

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9 - 5000, 5000))
    out = tmp_path / "run"
    with pytest.raises(OutputFolderError, match=r"has 5 kB free but this run writes about .*logging.checkpoint_every"):
        run(compose_config([*TINY, "optim.steps=3", f"output.dir={out}"]))
    assert not (out / "checkpoints").exists() and not list(out.glob("volume*"))
    assert "[ERROR]" in (out / "reconstruct.log").read_text()


# ----------------------------------------------------------------------------------- case 4
def test_overwrite_removes_every_file_of_the_previous_run_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    run(compose_config([*TINY, "optim.steps=4", "output.formats=[mrc,h5,tiff]", "output.imod_xzy=true",
                        "logging.checkpoint_every=2", "logging.tensorboard=true", f"output.dir={out}"]))
    first = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert {"volume.tif", "volume_xzy.mrc", "step0000002.pt"} <= set(first) and list((out / "tb").iterdir())
    (out / "notes.txt").write_text("mine")  # a user's files, two of them named like the run's patterns
    (out / "checkpoints" / "step_best_by_eye.pt").write_text("mine")
    (out / "tb" / "events.out.tfevents.1.otherhost.1.0").write_text("mine")
    run(compose_config([*TINY, "optim.steps=3", "output.overwrite=true", f"output.dir={out}"]))
    after = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert after == ["checkpoints/last.pt", "checkpoints/step_best_by_eye.pt", "config.yaml", "fsc_truth.png",
                     "loss.png", "manifest.json", "metrics.json", "notes.txt", "reconstruct.log", "report.png",
                     "slices.png", "tb/events.out.tfevents.1.otherhost.1.0", "volume.mrc"]
    log = (out / "reconstruct.log").read_text()
    assert "removed the" in log
    summary = log[log.index("finished."):]  # lists the run's files, not the user's
    assert "\n  volume.mrc " in summary and "\n  manifest.json " in summary and "\n  checkpoints/last.pt " in summary
    assert "notes.txt" not in summary and "step_best_by_eye" not in summary and "tb/" not in summary


def test_overwriting_a_killed_run_removes_its_own_step_checkpoints_and_event_files_only(tmp_path):
    """A killed run's manifest has patterns, no list of files: they are narrowed to the names the
    run itself writes (7-digit steps; event files of its host and pid)."""
    from fasttomo.run.folder import RunFolder

    out = tmp_path / "killed"
    (out / "checkpoints").mkdir(parents=True)
    (out / "tb").mkdir()
    (out / "manifest.json").write_text(json.dumps({  # continued in place once: an earlier process on node7
        "format": "fasttomo-run-v1", "status": "running", "pid": 4242, "host": "n[7]",
        "processes": [{"host": "node7", "pid": 1111}],
        "outputs": ["manifest.json", "checkpoints/last.pt", "checkpoints/step*.pt", "tb/events.out.tfevents.*"]}))
    theirs = ["checkpoints/step0000010.pt", "tb/events.out.tfevents.1700000000.n[7].4242.0",
              "tb/events.out.tfevents.1690000000.node7.1111.0"]
    mine = ["checkpoints/step_best.pt", "checkpoints/step12.pt", "tb/events.out.tfevents.1700000000.node7.99.0"]
    for name in theirs + mine:
        (out / name).write_text(name)
    folder = RunFolder(out, overwrite=True).open()
    folder.finish("failed")
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert left == sorted(["manifest.json", *mine]), left
    assert any("removed the 4 file(s)" in n for n in folder.notes), folder.notes  # and the old manifest


def test_a_run_continued_in_place_keeps_the_earlier_processes_for_their_event_files(tmp_path):
    from fasttomo.run.folder import RunFolder

    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.pt").write_text("x")
    (out / "manifest.json").write_text(json.dumps({
        "format": "fasttomo-run-v1", "status": "running", "pid": 1111, "host": "node7",
        "outputs": ["manifest.json", "checkpoints/last.pt", "tb/events.out.tfevents.*"]}))
    folder = RunFolder(out, resume=str(out / "checkpoints" / "last.pt")).open()
    try:
        assert folder.continuing and folder.manifest["processes"] == [{"host": "node7", "pid": 1111}]
    finally:
        folder.finish("interrupted")


def test_files_with_fasttomo_names_but_no_fasttomo_manifest_are_never_touched_without_overwrite(tmp_path):
    """A user's config.yaml and slices.png, or another tool's manifest.json, in the output folder:
    the run refuses the folder and leaves every byte (they were taken for an old failed run and
    removed, and a foreign manifest.json was overwritten); output.overwrite=true moves them into a
    replaced-<time> folder beside the new run's files."""
    from fasttomo.data.io.common import OutputExistsError

    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    (mine / "config.yaml").write_text("my precious notes")
    (mine / "slices.png").write_bytes(b"x")
    (other / "manifest.json").write_text('{"my": "dataset manifest"}')
    for out, names in ((mine, r"config\.yaml, slices\.png"), (other, r"manifest\.json \(not fasttomo's\)")):
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        with pytest.raises(OutputExistsError, match=rf"holds files with the names fasttomo writes \({names}\) but no "
                                                    r"manifest of a fasttomo run.*output\.overwrite=true"):
            run(compose_config([*TINY, "optim.steps=2", f"output.dir={out}"]))
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    for out, names in ((mine, ["config.yaml", "slices.png"]), (other, ["manifest.json"])):
        before = {n: (out / n).read_bytes() for n in names}
        run(compose_config([*TINY, "optim.steps=2", "output.overwrite=true", f"output.dir={out}"]))
        assert (out / "volume.mrc").is_file() and json.loads((out / "manifest.json").read_text())["status"] == "finished"
        aside = [d for d in out.iterdir() if d.name.startswith("replaced-")]  # moved, never deleted
        assert len(aside) == 1 and {n: (aside[0] / n).read_bytes() for n in names} == before
        assert f"into {aside[0]}" in (out / "reconstruct.log").read_text()


def test_files_to_move_aside_on_another_file_system_are_refused_before_any_moves(tmp_path):
    """checkpoints/ linked to another file system: a rename cannot move a file from there into
    replaced-<time>/; the folder is refused naming it, and nothing was moved."""
    import tempfile

    from fasttomo.data.io.common import OutputExistsError

    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's folder")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my notes")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        (Path(other) / "last.pt").write_text("my checkpoint")
        (out / "checkpoints").symlink_to(other)
        with pytest.raises(OutputExistsError, match=r"checkpoints/last\.pt \(no fasttomo manifest names them, so "
                                                    r"they may be yours\) lie on another file system"):
            run(compose_config([*TINY, "optim.steps=2", "output.overwrite=true", f"output.dir={out}"]))
        assert (Path(other) / "last.pt").read_text() == "my checkpoint"
    assert (out / "config.yaml").read_text() == "my notes" and not list(out.glob("replaced-*"))


def test_two_runs_started_at_once_into_one_folder_one_is_refused_even_with_overwrite(tmp_path):
    out = tmp_path / "run"
    args = [*LONG, "output.overwrite=true", f"hydra.run.dir={out}"]
    procs = [start(args, tmp_path, tmp_path / f"p{i}.txt") for i in range(2)]
    try:
        refused = None
        while refused is None:
            for i, p in enumerate(procs):
                if p.poll() is not None:
                    refused = i
                    break
            else:
                time.sleep(0.05)
        assert procs[refused].returncode == 2
        text = (tmp_path / f"p{refused}.txt").read_text()
        assert "in use by another fasttomo run" in text and f"pid {procs[1 - refused].pid}" in text
        assert "Traceback" not in text
        wait_for_text(out / "reconstruct.log", TRAINING, procs[1 - refused])
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                assert p.wait(120) == 143
    manifest = strict_json(out / "manifest.json")
    assert manifest["status"] == "interrupted" and manifest["pid"] == procs[1 - refused].pid


def test_a_run_whose_default_folder_another_run_took_that_second_writes_beside_it(tmp_path):
    """Two runs started in the same second (a job array, a shell loop) get the same time-stamped
    default folder; the second writes to <folder>-2 instead of being refused. Here the other run's
    claim is planted in the default folders of the next 60 seconds."""
    import datetime

    from fasttomo.cli.reconstruct import CLAIM

    now = datetime.datetime.now()
    for s in range(60):
        t = now + datetime.timedelta(seconds=s)
        folder = tmp_path / "outputs" / f"{t:%Y-%m-%d}" / f"{t:%H-%M-%S}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CLAIM).write_text("")
    res = cli([*TINY, "optim.steps=3"], tmp_path)
    assert res.returncode == 0, res.stderr
    runs = [p.parent for p in (tmp_path / "outputs").rglob("volume.mrc")]
    assert len(runs) == 1 and runs[0].name.endswith("-2"), runs
    assert (runs[0].parent / runs[0].name[:-2] / CLAIM).is_file()  # the other run's folder: untouched
    assert not (runs[0] / CLAIM).exists() and strict_json(runs[0] / "manifest.json")["status"] == "finished"


# ----------------------------------------------------------------------------------- case 5
def test_failed_run_logs_its_error_and_does_not_block_the_rerun(tmp_path, monkeypatch):
    """A run that fails after its folder was opened (here: too little free space; refused input
    leaves no folder at all) logs the error, and a rerun into the folder is not blocked."""
    import fasttomo.run.preflight as pf

    usage = namedtuple("usage", "total used free")
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(pf.shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9 - 5000, 5000))
        with pytest.raises(OutputFolderError):
            run(compose_config([*TINY, "optim.steps=2", f"output.dir={out}"]))
    logged = (out / "reconstruct.log").read_text()
    assert "[ERROR]" in logged and "has 5 kB free" in logged
    assert strict_json(out / "manifest.json")["status"] == "failed"
    again = cli([*TINY, "optim.steps=2", f"hydra.run.dir={out}"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    log_text = (out / "reconstruct.log").read_text()
    assert "held a failed run without results (its error:" in log_text and "has 5 kB free" in log_text


def test_killed_run_without_results_does_not_block_and_its_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    first = start([*LONG, f"hydra.run.dir={out}"], tmp_path, tmp_path / "first.txt")
    wait_for_text(out / "reconstruct.log", TRAINING, first)
    first.kill()  # SIGKILL: no cleanup at all
    first.wait(60)
    assert (out / "reconstruct.lock").exists()
    again = cli([*TINY, "optim.steps=2", f"hydra.run.dir={out}"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    log_text = (out / "reconstruct.log").read_text()
    assert "took over the lock of a run that is no longer running" in log_text
    assert "held a killed run without results" in log_text
    assert not (out / "reconstruct.lock").exists()


def test_config_errors_and_dry_runs_leave_no_folders(tmp_path):
    res = cli([*TINY, "sampler.batch_size=-5"], tmp_path)
    assert res.returncode == 2
    _one_line_error(res, "sampler.batch_size")
    dry = cli([*TINY, "dry_run=true"], tmp_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "dry run: config and data are valid" in dry.stdout and "memory on cpu (estimate)" in dry.stdout
    assert "output folder" in dry.stdout and "empty or new: usable" in dry.stdout
    assert not (tmp_path / "outputs").exists()


# ----------------------------------------------------------------------------------- case 6
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_volume_and_checkpoint_then_resume_continues_in_place(tmp_path, sig, code):
    out = tmp_path / "run"
    proc = start([*TINY, "optim.steps=100000", f"hydra.run.dir={out}"], tmp_path, tmp_path / "out.txt")
    wait_for_text(out / "reconstruct.log", TRAINING, proc)
    proc.send_signal(sig)
    assert proc.wait(120) == code
    text = (tmp_path / "out.txt").read_text()
    assert "Traceback" not in text
    logged = (out / "reconstruct.log").read_text()
    line = [ln for ln in logged.splitlines() if "stopped at step" in ln][0]
    step = int(line.split("stopped at step ")[1].split()[0])
    assert f"resume with: fasttomo-reconstruct resume={out} hydra.run.dir={out}" in line
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == step
    with mrcfile.open(out / "volume.mrc") as m:
        assert np.isfinite(m.data).all()
    stopped = strict_json(out / "metrics.json")
    assert stopped["status"] == "interrupted"
    assert headline(stopped).startswith(f"stopped at step {step} of 100000")  # report.png's title line
    if sig == signal.SIGINT:  # the rerun the message suggests finishes the run in the same folder
        res = cli([f"resume={out}", f"hydra.run.dir={out}", f"optim.steps={step + 3}"], tmp_path)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"steps {step + 1}-{step + 3} in " in res.stdout + res.stderr  # what this process trained
        metrics = strict_json(out / "metrics.json")
        assert metrics["status"] == "finished" and metrics["steps"] == step + 3
        assert metrics["resumed_from"]["step"] == step


def test_ctrl_c_during_the_half_set_fits_stops_them_and_resume_computes_them(tmp_path):
    """The half fits polled no stop request: a Ctrl-C there was 'noted while saving' and both
    half fits ran to their end, exit 0. Now they stop after the current step, the whole fit's
    results stay, the run is interrupted (130) and the printed resume computes the halves."""
    out = tmp_path / "run"
    proc = start([*TINY, "optim.steps=2000", "evaluation.half_sets=true", f"hydra.run.dir={out}"], tmp_path,
                 tmp_path / "out.txt")
    wait_for_text(out / "reconstruct.log", "half sets: reconstructing the even views", proc)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 130
    assert time.perf_counter() - t0 < 5  # not the two half fits (about 7 s each here)
    logged = (out / "reconstruct.log").read_text()
    assert "SIGINT received: stopping the half-set fits after the current step" in logged
    line = [ln for ln in logged.splitlines() if "stopped before the half-set fits were done" in ln][0]
    assert line.endswith(f"resume with: fasttomo-reconstruct resume={out} hydra.run.dir={out}")
    stopped = strict_json(out / "metrics.json")
    assert stopped["status"] == "interrupted" and stopped["steps"] == 2000
    assert stopped["half_sets"] == {"skipped": "SIGINT during the half-set fits"}
    assert (out / "volume.mrc").is_file() and load_checkpoint(out / "checkpoints" / "last.pt")["step"] == 2000
    res = cli([f"resume={out}", f"hydra.run.dir={out}"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    done = strict_json(out / "metrics.json")
    assert done["status"] == "finished" and "fsc" in done["half_sets"]


def test_second_ctrl_c_exits_at_once(tmp_path):
    out = tmp_path / "run"
    # a large exported volume keeps the saving after the first Ctrl-C busy for a while
    proc = start([*LONG, "output.volume_shape=[256,256,256]", f"hydra.run.dir={out}"], tmp_path, tmp_path / "out.txt")
    wait_for_text(out / "reconstruct.log", TRAINING, proc)
    proc.send_signal(signal.SIGINT)
    wait_for_text(tmp_path / "out.txt", "SIGINT received", proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    text = (tmp_path / "out.txt").read_text()
    assert "second interrupt (SIGINT): exiting at once" in text and "stopped at step" not in text


# ----------------------------------------------------------------------------------- case 7
def test_cli_resume_needs_no_repeated_overrides(tmp_path):
    from fasttomo.config import DataConfig
    from fasttomo.data.io import write_tiltseries
    from fasttomo.data.phantom import make_tiltseries

    paths = write_tiltseries(tmp_path / "ph.mrc", make_tiltseries(DataConfig(width=24, height=20, n_tilts=15)), "mrc")
    first = tmp_path / "first"
    run(compose_config([*TINY_RUN, "data=mrc", f"data.path={paths[0]}", f"data.angles={paths[1]}", "data.thickness=12",
                        "optim.steps=3", f"output.dir={first}"]))
    res = cli([f"resume={first / 'checkpoints' / 'last.pt'}", "optim.steps=5", f"hydra.run.dir={tmp_path / 'second'}"],
              tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    metrics = strict_json(tmp_path / "second" / "metrics.json")
    assert metrics["steps"] == 5 and metrics["box_zyx"] == [12, 20, 24]
    res = cli([f"resume={first}", "model.channels=4", f"hydra.run.dir={tmp_path / 'third'}"], tmp_path)
    assert res.returncode == 2
    _one_line_error(res, "model.channels: cannot change when resuming")
    assert not (tmp_path / "third").exists()


def test_old_checkpoint_without_checksum_still_loads(tmp_path):
    """Checkpoints written before checksums existed load, with a warning."""
    import torch

    path = tmp_path / "old.pt"
    torch.save({"format": "fasttomo-checkpoint-v1", "step": 1, "w": torch.ones(3)}, path)
    assert load_checkpoint(path)["step"] == 1
    assert save_checkpoint(tmp_path / "new.pt", {"step": 1})  # and new ones carry it
    assert "checksum" in torch.load(tmp_path / "new.pt", weights_only=True)


def test_a_run_in_process_under_a_file_names_the_file(tmp_path):
    """The library path (no command line): the folder's own check says what is in the way."""
    from fasttomo.cli.reconstruct import compose_config, run
    from fasttomo.run.folder import OutputFolderError

    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputFolderError, match=r"lies under .*afile, which is a file, not a folder; choose a folder"):
        run(compose_config([*TINY, "optim.steps=2", f"output.dir={tmp_path / 'afile' / 'run'}"]))
    assert (tmp_path / "afile").read_text() == "x"
