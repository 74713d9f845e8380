"""Exact resume (single process), checkpoint contents, refusal of pickled objects, and poses that
survive device moves and state round trips.

N steps + save + resume (everything rebuilt from the config, global RNG disturbed) + M steps must
equal N + M steps straight: parameters (poses included), optimizer state and logged losses.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fasttomo.run.build import build, make_trainer
from fasttomo.config import to_dict
from fasttomo.data.load import load_tiltseries
from fasttomo.run.pipeline import OutputExistsError
from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.train.checkpoint import FORMAT, CheckpointError, load_checkpoint, save_checkpoint
from fasttomo.train.trainer import Trainer

N, M = 8, 6  # batch 256 -> 8 batches per epoch: the pause lands exactly on an epoch boundary

TINY = [
    "experiment=quick", "logging=quiet", "runtime=cpu", "runtime.threads=1",
    "data.width=16", "data.height=16", "data.n_tilts=9",
    "model.resolutions=[8]", "sampler.batch_size=256", "projector.samples_per_ray=16",
    "pose=refine", "pose.start_step=0",   # poses move from the first step (_cfg: which parts)
    "loss=tv",                            # volume TV draws from the regularizer generator
    "schedule=plateau", "schedule.plateau_patience=0", "schedule.warmup_steps=3",
    f"optim.steps={N + M}", "logging.log_every=1", "logging.val_every=3",  # N is not a validation step
]


def _cfg(out: Path, *extra: str, z1: bool = True):
    """z1: every pose part learned (z1, z3, shifts); otherwise the default split (z3, the shared
    tilt-axis rotation, shifts)."""
    return compose_config([*TINY, f"pose.learn_z1={str(z1).lower()}", f"output.dir={out}", *extra])


def _assert_close_tree(a, b, path="", tol=1e-6):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, path
        if a.is_floating_point():
            assert torch.allclose(a, b, rtol=0, atol=tol), f"{path}: max diff {(a - b).abs().max()}"
        else:
            assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _assert_close_tree(a[k], b[k], f"{path}.{k}", tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close_tree(x, y, f"{path}[{i}]", tol)
    elif isinstance(a, float):
        assert abs(a - b) <= tol * max(1.0, abs(a)), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


@pytest.mark.parametrize("z1", [True, False], ids=["z1-z3-shifts", "z3-tilt-axis-shifts"])
def test_exact_resume_single_process(tmp_path, z1):
    # A: N + M straight, with a checkpoint at step N on the way
    cfg_a = _cfg(tmp_path / "a", f"logging.checkpoint_every={N}", z1=z1)
    run(cfg_a)
    straight = load_checkpoint(tmp_path / "a/checkpoints/last.pt")
    at_n = load_checkpoint(tmp_path / "a/checkpoints" / f"step{N:07d}.pt")

    # the checkpoint holds everything an exact resume needs, as plain values (weights_only)
    assert at_n["format"] == FORMAT and at_n["step"] == N and at_n["world_size"] == 1
    for key in ("model", "optimizer", "scaler", "plateau", "sampler", "rng", "history", "val_history", "config"):
        assert key in at_n, key
    assert {"poses.z1", "poses.z3", "poses.shifts", "field.plane_data"} <= set(at_n["model"])
    assert at_n["optimizer"]["state"] and {g["name"] for g in at_n["optimizer"]["param_groups"]} >= {"grids", "pose_rotations", "pose_shifts"}
    assert set(at_n["plateau"]) == {"best", "bad", "factor"}
    assert (at_n["sampler"]["epoch"], at_n["sampler"]["position"]) == (0, N)  # epoch used up, not yet advanced
    assert len(at_n["rng"]["ranks"]) == 1 and {"torch", "reg"} <= set(at_n["rng"]["ranks"][0])
    resolved = to_dict(cfg_a)
    assert resolved["loss"]["plane_tv"] is None  # chosen from the data at build: the checkpoint holds the choice
    resolved["loss"]["plane_tv"] = 3e-2
    assert at_n["config"] == resolved
    assert isinstance(at_n["scaler"], dict)

    # B: a run that stops at N (a fresh Trainer, fit(N), save) ...
    cfg_b = _cfg(tmp_path / "b", z1=z1)
    comps = build(cfg_b, load_tiltseries(cfg_b.data))
    trainer = make_trainer(comps, tmp_path / "b")
    trainer.fit(N)
    assert trainer.step == N
    trainer.save("paused.pt")
    paused = load_checkpoint(tmp_path / "b/checkpoints/paused.pt")
    _assert_close_tree(paused["model"], at_n["model"], "model@N", tol=0.0)  # pausing == checkpointing on the way
    assert paused["history"] == at_n["history"] and paused["sampler"] == at_n["sampler"]
    b_files = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*"))

    # ... C: resumed in a NEW run folder; everything rebuilt, global RNG disturbed first
    torch.manual_seed(12345)
    torch.rand(1000)
    metrics = run(_cfg(tmp_path / "c", f"resume={tmp_path / 'b/checkpoints/paused.pt'}", z1=z1))
    resumed = load_checkpoint(tmp_path / "c/checkpoints/last.pt")

    assert metrics["steps"] == N + M and metrics["resumed_from"]["step"] == N
    assert resumed["step"] == straight["step"] == N + M
    _assert_close_tree(resumed["model"], straight["model"], "model")
    _assert_close_tree(resumed["optimizer"], straight["optimizer"], "optimizer")
    _assert_close_tree(resumed["plateau"], straight["plateau"], "plateau")
    assert resumed["sampler"] == straight["sampler"]
    _assert_close_tree(resumed["history"], straight["history"], "history")
    _assert_close_tree(resumed["val_history"], straight["val_history"], "val_history")
    assert [h[0] for h in resumed["history"]] == list(range(1, N + M + 1))
    _assert_close_tree(resumed["rng"], straight["rng"], "rng", tol=0.0)
    learned = ("poses.shifts", "poses.z3", "poses.z1" if z1 else "poses.axis")
    assert all(straight["model"][k].abs().max() > 0 for k in learned), learned
    # the paused run's folder was not touched by the resumed run
    assert sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*")) == b_files

    # resuming INTO an earlier run's folder is refused (nothing is overwritten)
    with pytest.raises(OutputExistsError):
        run(_cfg(tmp_path / "a", f"resume={tmp_path / 'a/checkpoints/last.pt'}"))


def test_resume_refuses_wrong_total_or_world_size(tmp_path):
    cfg = _cfg(tmp_path / "r")
    comps = build(cfg, load_tiltseries(cfg.data))
    trainer = make_trainer(comps, tmp_path / "r")
    trainer.fit(2)
    state = trainer.state_dict()
    fresh = make_trainer(build(cfg, load_tiltseries(cfg.data)), None)
    with pytest.raises(CheckpointError, match="optim.steps is the total"):
        fresh.load_state_dict({**state, "step": N + M + 1})
    with pytest.raises(CheckpointError, match="same number of processes"):
        fresh.load_state_dict({**state, "world_size": 2})
    other = make_trainer(build(_cfg(tmp_path / "r", "model.resolutions=[6]"), load_tiltseries(cfg.data)), None)
    with pytest.raises(CheckpointError, match="does not fit this run"):
        other.load_state_dict(state)
    fresh.load_state_dict(state)
    assert fresh.step == 2


class _Payload:  # a class instance: weights_only loading must refuse it
    def __init__(self):
        self.x = 1


@pytest.mark.parametrize("evil", [_Payload(), os.system], ids=["instance", "function"])
def test_checkpoint_with_pickled_object_is_refused(tmp_path, evil):
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "step": 0, "model": {"w": torch.zeros(2)}, "extra": evil}, path)
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(path)


def test_checkpoint_truncated_or_foreign_is_refused(tmp_path):
    good = save_checkpoint(tmp_path / "good.pt", {"step": 1, "w": torch.ones(3)})
    assert load_checkpoint(good)["step"] == 1
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(tmp_path / "cut.pt")
    torch.save({"w": torch.ones(3)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a"):
        load_checkpoint(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_learned_poses_survive_device_moves_and_state_round_trip(tmp_path):
    cfg = _cfg(tmp_path / "p")
    comps = build(cfg, load_tiltseries(cfg.data))
    make_trainer(comps, None).fit(4)
    proj = comps.projector
    learned = {k: v.detach().clone() for k, v in proj.poses.state_dict().items()}
    assert learned["shifts"].abs().max() > 0 and learned["z3"].abs().max() > 0
    z1 = proj.poses.z1
    proj.to("cpu")
    proj.to(torch.device("cpu"))
    proj.to(torch.float64).to(torch.float32)  # exact for float32 values
    proj.cpu()
    assert proj.poses.z1.requires_grad and proj.poses.z1 is not None and z1.requires_grad
    _assert_close_tree({k: v for k, v in proj.poses.state_dict().items()}, learned, "poses", tol=0.0)
    # into a freshly built projector (poses start at zero there) through a checkpoint file
    save_checkpoint(tmp_path / "p.pt", {"model": proj.state_dict()})
    fresh = build(cfg, load_tiltseries(cfg.data)).projector
    assert fresh.poses.shifts.abs().max() == 0
    fresh.load_state_dict(load_checkpoint(tmp_path / "p.pt")["model"])
    fresh.to("cpu")
    _assert_close_tree(dict(fresh.poses.state_dict()), learned, "poses", tol=0.0)


def test_exact_resume_with_patch_batches(tmp_path):
    """sampler.patch_size=4 (16 tiles a view, 16 a batch): a run paused mid-epoch and resumed in a
    new folder ends where the straight run ends; a different patch size is refused on resume."""
    from fasttomo.config import ConfigError

    patch = "sampler.patch_size=4"
    run(_cfg(tmp_path / "a", patch, f"logging.checkpoint_every={N}", z1=False))
    straight = load_checkpoint(tmp_path / "a/checkpoints/last.pt")
    at_n = tmp_path / "a/checkpoints" / f"step{N:07d}.pt"
    state = load_checkpoint(at_n)["sampler"]
    assert state["patch_size"] == 4 and (state["epoch"], state["position"]) == (0, N)  # mid-epoch: 9 a epoch
    torch.manual_seed(7)
    metrics = run(_cfg(tmp_path / "c", f"resume={at_n}", z1=False))
    resumed = load_checkpoint(tmp_path / "c/checkpoints/last.pt")
    assert metrics["steps"] == N + M
    _assert_close_tree(resumed["model"], straight["model"], "model")
    _assert_close_tree(resumed["optimizer"], straight["optimizer"], "optimizer")
    assert resumed["sampler"] == straight["sampler"]
    _assert_close_tree(resumed["history"], straight["history"], "history")
    with pytest.raises(ConfigError, match="sampler.patch_size"):
        run(_cfg(tmp_path / "d", f"resume={at_n}", "sampler.patch_size=2", z1=False))
    assert not (tmp_path / "d").exists()
