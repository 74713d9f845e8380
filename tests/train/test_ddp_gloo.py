"""Two REAL gloo ranks (torchrun on the CPU) running the full ``fasttomo.cli.reconstruct`` Hydra entry
with one shared run folder, and an exact 2-rank resume launched through scripts/launch_ddp.sh.

Checked: the run finishes (a hang fails the test after a timeout and the ranks are killed); both
ranks log identical reduced losses and hold identical parameters (poses included, learned: they
live in the DDP-wrapped Projector) although each rank draws its own volume-TV sub-grids (so the
regularizer's gradients, computed outside DDP's forward, must be all-reduced too); only rank 0
writes into the run folder; the Z-sharded, gathered volume equals one evaluation of the final
model (Z = 9 is not divisible by 2); n_train is odd; N + resume + M equals N + M straight.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fasttomo.train.checkpoint import load_checkpoint

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LAUNCH = REPO / "scripts" / "launch_ddp.sh"
N, M = 6, 6  # 8 batches per rank and epoch: the resumed part crosses an epoch boundary
TIMEOUT_S = 240

OVERRIDES = [
    "experiment=quick", "logging=quiet", "runtime=cpu", "runtime.threads=1",
    "data.width=16", "data.height=16", "data.n_tilts=9", "data.thickness=9",  # Z = 9: ragged Z shards
    "model.resolutions=[8]", "sampler.batch_size=128", "projector.samples_per_ray=16",
    "sampler.val_fraction=0.03",          # 2304 pixels -> 69 val, 2235 train (odd)
    "pose=refine", "pose.start_step=0", "pose.learn_z1=true",   # every pose part learned (and kept in sync)
    "loss=tv",                            # volume TV on per-rank random sub-grids
    f"optim.steps={N + M}", "logging.log_every=2", "logging.val_every=4",
    "logging.tensorboard=true",
]


def _clean_env() -> dict:
    from cli_helpers import _env  # an absolute PYTHONPATH to this checkout's sources

    env = dict(_env(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill that whole process group (torchrun and its
    ranks) and fail instead of hanging the suite."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env or _clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[:6]} did not finish in {TIMEOUT_S} s (hung ranks?):\n{out[-6000:]}")
    assert proc.returncode == 0, f"{cmd[:6]} failed ({proc.returncode}):\n{out[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _inside(paths, folder: Path) -> list[str]:
    root = str(folder.resolve())
    return sorted({p for p in paths if p.startswith(root + os.sep)})


def _read_mrc(path: Path) -> np.ndarray:
    import mrcfile

    with mrcfile.open(path, permissive=True) as f:
        return np.array(f.data, dtype=np.float32)


@pytest.mark.distributed
def test_two_gloo_ranks_train_identically_and_resume_exactly(tmp_path):
    run1, dump = tmp_path / "run1", tmp_path / "dump"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "ddp_worker.py"), str(dump), f"hydra.run.dir={run1}", *OVERRIDES,
           f"logging.checkpoint_every={N}"]
    _run(cmd, cwd=tmp_path)
    r0 = torch.load(dump / "rank0.pt", weights_only=True)
    r1 = torch.load(dump / "rank1.pt", weights_only=True)

    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2) and r0["ddp"] == "DistributedDataParallel"
    assert r0["step"] == r1["step"] == N + M
    assert r0["n_train"] % 2 == 1 and r0["n_per_rank"] == r0["n_train"] // 2  # ragged tail dropped
    # identical reduced losses on both ranks
    assert len(r0["history"]) == (N + M) // 2
    assert r0["history"] == r1["history"] and r0["val_history"] == r1["val_history"]
    # identical parameters on both ranks, the learned poses included
    assert set(r0["params"]) == set(r1["params"])
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    assert r0["params"]["poses.shifts"].abs().max() > 0 and r0["params"]["poses.z1"].abs().max() > 0 \
        and r0["params"]["poses.z3"].abs().max() > 0
    # only rank 0 writes into the shared run folder
    assert _inside(r1["writes"], run1) == []
    written = _inside(r0["writes"], run1)
    for name in ("config.yaml", "metrics.json", "volume.mrc", "slices.png", "reconstruct.log",
                 "checkpoints/last.pt", f"checkpoints/step{N:07d}.pt"):
        assert str((run1 / name).resolve()) in written, name
        assert (run1 / name).is_file(), name
    assert any(p.startswith(str((run1 / "tb").resolve())) for p in written) and list((run1 / "tb").iterdir())
    # the Z-sharded, gathered export equals one evaluation of the final model
    assert r1["gathered"] is None and r0["gathered"].shape == (9, 16, 16)
    torch.testing.assert_close(r0["gathered"], r0["single"], rtol=0, atol=1e-6)
    torch.testing.assert_close(r0["single"], r1["single"], rtol=0, atol=0)
    np.testing.assert_allclose(_read_mrc(run1 / "volume.mrc"), r0["gathered"].numpy(), rtol=0, atol=1e-6)
    straight = load_checkpoint(run1 / "checkpoints/last.pt")
    assert straight["world_size"] == 2 and len(straight["rng"]["ranks"]) == 2
    assert not torch.equal(straight["rng"]["ranks"][0]["reg"], straight["rng"]["ranks"][1]["reg"])
    for k, v in straight["model"].items():
        assert torch.equal(v, r0["params"][k]), k

    # N + resume + M == N + M straight, 2 ranks, launched by scripts/launch_ddp.sh (default run folder)
    run1_files = sorted((p.relative_to(run1), p.stat().st_mtime_ns) for p in run1.rglob("*"))
    out = _run([str(LAUNCH), "2", *OVERRIDES, f"resume={run1 / 'checkpoints' / f'step{N:07d}.pt'}"], cwd=tmp_path)
    run2 = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run2) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-ddp",
                                           str(run2[0].relative_to(tmp_path / "outputs"))), run2
    assert f"resumed from {run1 / 'checkpoints'}" in out.stdout
    assert out.stdout.count("training from step") == 1 and out.stdout.count("finished.") == 1  # rank 0 alone logs
    resumed = load_checkpoint(run2[0] / "checkpoints/last.pt")
    assert resumed["step"] == N + M
    for k, v in straight["model"].items():
        torch.testing.assert_close(resumed["model"][k], v, rtol=0, atol=1e-6, msg=k)
    for (sa, la), (sb, lb) in zip(resumed["history"], straight["history"], strict=True):
        assert sa == sb and abs(la - lb) <= 1e-6
    for (sa, la), (sb, lb) in zip(resumed["val_history"], straight["val_history"], strict=True):
        assert sa == sb and abs(la - lb) <= 1e-6
    assert resumed["sampler"] == straight["sampler"]
    # the earlier run's folder was left alone
    assert sorted((p.relative_to(run1), p.stat().st_mtime_ns) for p in run1.rglob("*")) == run1_files


def test_launch_ddp_script_builds_the_torchrun_command(tmp_path):
    """The launcher's contract without starting torch: a stand-in PYTHON records its arguments
    and the multicast switches."""
    fake = tmp_path / "fakepython"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$OUT_ARGS"\n'
                    'echo "$NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST" > "$OUT_ENV"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), OUT_ARGS=str(tmp_path / "args"), OUT_ENV=str(tmp_path / "env"))
    env.pop("NCCL_NVLS_ENABLE", None)
    env.pop("TORCH_SYMM_MEM_DISABLE_MULTICAST", None)
    assert os.access(LAUNCH, os.X_OK), "scripts/launch_ddp.sh must be executable"

    subprocess.run([str(LAUNCH), "3", "optim.steps=5"], env=env, cwd=tmp_path, check=True, timeout=30)
    args = (tmp_path / "args").read_text().split("\n")[:-1]
    assert args[:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "-m",
                        "fasttomo.cli.reconstruct"]
    assert args[6] == "optim.steps=5"
    assert re.fullmatch(r"hydra\.run\.dir=outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-ddp", args[7]) and len(args) == 8
    assert (tmp_path / "env").read_text().split() == ["0", "1"]

    subprocess.run([str(LAUNCH), "2", "hydra.run.dir=mine", "x=1"], env=env, cwd=tmp_path, check=True, timeout=30)
    assert (tmp_path / "args").read_text().split("\n")[6:-1] == ["hydra.run.dir=mine", "x=1"]

    bad = subprocess.run([str(LAUNCH), "two"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_a_refused_input_under_torchrun_is_said_once_with_the_runs_exit_code(tmp_path):
    """Every rank meets a missing data file; rank 0 alone says it, and scripts/launch_ddp.sh exits
    2 (refused input), the run's own code, where torchrun's is 1 for any failed rank."""
    res = subprocess.run([str(LAUNCH), "2", "runtime=cpu", "runtime.threads=1", "data=mrc",
                          f"data.path={tmp_path / 'nope.mrc'}", f"data.angles={tmp_path / 'nope.rawtlt'}",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=_clean_env(), capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert text.count("nope.mrc: file not found; check data.path.") == 1, text
    # the last line points back at it, past torchrun's report of the failed ranks
    assert res.stderr.rstrip().splitlines()[-1].startswith("launch_ddp.sh: the run ended with exit code 2; its own "
                                                           "message is the [ERROR] or [WARNING] line above"), text
