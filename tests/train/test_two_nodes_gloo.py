"""Two "nodes" of one host: two torchrun launchers (one rank each) that meet through a c10d
rendezvous on localhost, as two machines of a cluster meet through their scheduler's first host
(docs/multi-gpu.md, "Several machines"). Each launcher's rank is LOCAL_RANK 0, so what the test
shows is that the run keys everything on the global rank: one shared run folder written by global
rank 0 alone, the two ranks' parameters identical at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from test_ddp_gloo import HERE, OVERRIDES, TIMEOUT_S, _clean_env, _inside

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_nodes_meet_through_a_c10d_rendezvous_and_train_as_one_run(tmp_path):
    run, dump = tmp_path / "run", tmp_path / "dump"
    overrides = [o for o in OVERRIDES if not o.startswith("optim.steps=")] + [f"optim.steps={STEPS}"]
    port = _free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fasttomo-two-nodes",
               "--max-restarts=0", str(HERE / "ddp_worker.py"), str(dump), f"hydra.run.dir={run}", *overrides]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=_clean_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    outs = []
    for proc in procs:
        try:
            outs.append(proc.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"the two nodes did not finish in {TIMEOUT_S} s:\n" + "\n".join(
                p.communicate()[0][-3000:] for p in procs))
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out[-6000:]

    r0 = torch.load(dump / "rank0.pt", weights_only=True)
    r1 = torch.load(dump / "rank1.pt", weights_only=True)
    assert (r0["rank"], r1["rank"], r0["world_size"], r1["world_size"]) == (0, 1, 2, 2)
    assert r0["step"] == r1["step"] == STEPS
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    assert _inside(r1["writes"], run) == []  # global rank 1 is LOCAL_RANK 0 of its node, and writes nothing
    assert (run / "metrics.json").is_file() and (run / "volume.mrc").is_file()
