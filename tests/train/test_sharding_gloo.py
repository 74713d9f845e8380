"""Two REAL gloo ranks (torchrun on the CPU): disjoint equal shards, identical validation sets,
identical batch counts when n_train is not divisible by the world size, and no hang.

The file is both the pytest test and the per-rank worker (``__main__``) that torchrun starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttomo.train.distributed import all_reduce_mean, dist_info, init_distributed

SHAPE = (3, 5, 9)  # 135 pixels: 14 val, 121 train (odd), 60 per rank in 9 batches of <= 7
SEED = 17
EPOCHS = 2


def _make(rank: int, world_size: int, kind: str, patch_size: int = 1):
    import numpy as np

    from fasttomo.config import SamplerConfig
    from fasttomo.data.sampler import build_sampler
    from fasttomo.data.tiltseries import TiltSeries

    rng = np.random.default_rng(0)
    ts = TiltSeries(stack=rng.normal(size=SHAPE).astype(np.float32), angles=[-20.0, 0.0, 20.0])
    ts.valid = None
    cfg = SamplerConfig(kind=kind, batch_size=7 if patch_size == 1 else 8, val_fraction=0.1, split_seed=3,
                        drop_last=False, patch_size=patch_size)
    return build_sampler(ts, cfg, seed=SEED, device=torch.device("cpu"), rank=rank, world_size=world_size)


def _worker(out_dir: str) -> None:
    """One rank: walk EPOCHS epochs with a gradient-like all-reduce per batch, save what it saw."""
    import torch.distributed as dist

    assert init_distributed("cpu", timeout_s=60.0)
    rank, world_size, local_rank = dist_info()
    assert (rank, world_size, local_rank) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                                              int(os.environ["LOCAL_RANK"]))
    result = {}
    for kind in ("device", "dataloader", "patch"):
        # patch: 2 x 2 patches, 3 x 5 tiles a view (the last row and column overlapping), 45 tiles
        s = _make(rank, world_size, "device", 2) if kind == "patch" else _make(rank, world_size, kind)
        epochs = []
        n_batches = 0
        for _ in range(EPOCHS):
            ids = []
            for _ in range(s.batches_per_epoch):
                b = s.next_batch()
                ids.append((b.tilt * SHAPE[1] * SHAPE[2] + b.row * SHAPE[2] + b.col)[b.weight > 0])
                # as DDP's gradient sync: one collective per step, hangs if the counts differ
                all_reduce_mean(b.target.sum().reshape(1))
                n_batches += 1
            epochs.append(torch.cat(ids))
        val = torch.cat([b.tilt * SHAPE[1] * SHAPE[2] + b.row * SHAPE[2] + b.col for b in s.val_batches(7)])
        result[kind] = {"epochs": epochs, "val": val, "n_batches": n_batches,
                        "batches_per_epoch": s.batches_per_epoch, "n_train": s.n_train,
                        "train_ids": s.train_ids, "scale": s.scale}
    mean = all_reduce_mean(torch.tensor([float(rank)]))
    result["mean_rank"] = float(mean)
    dist.barrier()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_two_gloo_ranks_shard_disjointly_and_do_not_hang(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, str(tmp_path)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:  # the ranks hung: fail, do not block the suite
        pytest.fail(f"2-rank gloo run did not finish in 180 s:\n{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    assert r0["mean_rank"] == r1["mean_rank"] == 0.5
    for kind in ("device", "dataloader"):
        a, b = r0[kind], r1[kind]
        assert a["n_train"] % 2 == 1, "the case must have n_train not divisible by the world size"
        assert a["batches_per_epoch"] == b["batches_per_epoch"] and a["n_batches"] == b["n_batches"]
        assert a["scale"] == b["scale"]
        assert torch.equal(a["val"], b["val"]) and torch.equal(a["train_ids"], b["train_ids"])
        train = set(a["train_ids"].tolist())
        assert not train & set(a["val"].tolist())
        for ea, eb in zip(a["epochs"], b["epochs"]):
            assert len(ea) == len(eb) == a["n_train"] // 2
            sa, sb = set(ea.tolist()), set(eb.tolist())
            assert len(sa) == len(ea) and len(sb) == len(eb)  # no repeats within a shard
            assert not sa & sb                              # disjoint across ranks
            assert sa | sb <= train                         # only training pixels
        assert not torch.equal(a["epochs"][0], a["epochs"][1])  # reshuffled each epoch
    for ka, kb in zip(r0["device"]["epochs"], r0["dataloader"]["epochs"]):
        assert torch.equal(ka, kb)  # both samplers agree under sharding too
    # patches: the tiles are sharded (22 of 45 a rank, equal counts), each rank trains only on
    # training pixels, and together the ranks cover all but the one tile the ragged tail drops
    a, b = r0["patch"], r1["patch"]
    assert a["batches_per_epoch"] == b["batches_per_epoch"] == 11 and a["n_batches"] == b["n_batches"]
    assert torch.equal(a["train_ids"], r0["device"]["train_ids"]) and torch.equal(a["val"], r0["device"]["val"])
    train = set(a["train_ids"].tolist())
    for ea, eb in zip(a["epochs"], b["epochs"]):
        sa, sb = set(ea.tolist()), set(eb.tolist())
        assert sa | sb <= train and len(train - (sa | sb)) <= 4
    assert not torch.equal(a["epochs"][0], a["epochs"][1])


def test_helpers_are_noops_without_a_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist_info() == (0, 1, 0)
    t = torch.tensor([1.0, 3.0])
    assert all_reduce_mean(t) is t
    assert init_distributed("cpu") is False
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed("cpu") is False


if __name__ == "__main__":
    _worker(sys.argv[1])
