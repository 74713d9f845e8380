"""CUDA-graph capture of the training step: when it is allowed, and (on a GPU) that replaying the
captured step trains exactly like the eager step."""

from __future__ import annotations

import pytest
import torch

from fasttomo.run.build import build, capture_problem_of, make_trainer
from fasttomo.config import ConfigError
from fasttomo.data.load import load_tiltseries
from fasttomo.cli.reconstruct import compose_config
from fasttomo.train.cuda_graph import WARMUP

TINY = ["logging=quiet", "data.width=24", "data.height=20", "data.n_tilts=15", "model.resolutions=[8,16]",
        "sampler.batch_size=256", "projector.samples_per_ray=24", "optim.steps=20", "output.dir=/tmp/unused",
        "model.rotation_param=quaternion"]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("override,reason", [
    ("precision=fp16", "GradScaler"),
    ("model.rotation_param=svd", "svd"),
    ("sampler.drop_last=false", "drop_last"),
])
def test_capture_rules_name_the_obstacle(override, reason):
    cfg = compose_config([*TINY, override])
    assert reason in capture_problem_of(cfg, CUDA, 1)


def test_capture_rules_allow_the_plain_step():
    assert capture_problem_of(compose_config(TINY), CUDA, 1) is None
    assert "DDP" in capture_problem_of(compose_config(TINY), CUDA, 2)
    assert "CUDA" in capture_problem_of(compose_config(TINY), torch.device("cpu"), 1)
    # frozen svd rotations are not projected every step, so they do not block capture
    assert capture_problem_of(compose_config([*TINY, "model=kplanes", "model.rotation_param=svd"]), CUDA, 1) is None


def test_on_without_cuda_is_a_clear_error():
    cfg = compose_config([*TINY, "runtime.device=cpu", "runtime.cuda_graph=on"])
    ts = load_tiltseries(cfg.data)
    with pytest.raises(ConfigError, match="runtime.cuda_graph"):
        build(cfg, ts)


def _train(overrides: list[str], steps: int):
    cfg = compose_config([*TINY, *overrides])
    ts = load_tiltseries(cfg.data)
    c = build(cfg, ts)
    tr = make_trainer(c, None)
    losses = []
    for step in range(steps):
        tr._set_lr(step)
        loss, _ = tr.train_step(c.sampler.next_batch())
        losses.append(float(loss))
    return tr, c, losses


@torch.no_grad()
def _predictions(c) -> torch.Tensor:
    """The projector's predictions of the whole validation set (fp32, no autocast)."""
    return torch.cat([c.projector(b.tilt, b.row, b.col) for b in c.sampler.val_batches()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph capture)")
@pytest.mark.parametrize("extra", [[], ["precision=bf16"], ["pose=refine", "pose.start_step=0"],
                                   ["kernels=torch", "optim.grad_clip=1.0"],
                                   ["loss.plane_tv=1", "loss.plane_tv_hold=0.3", "loss.plane_tv_ramp=0.3"]])
def test_captured_step_trains_like_the_eager_step(extra):
    steps = WARMUP + 9
    eager, ce, le = _train(["runtime.cuda_graph=off", *extra], steps)
    again, ca, la = _train(["runtime.cuda_graph=off", *extra], steps)
    graph, cg, lg = _train(["runtime.cuda_graph=on", *extra], steps)
    assert cg.cuda_graph and graph.graphed is not None and graph.graphed.replays == steps - WARMUP
    assert eager.graphed is None
    # Same kernels and random stream: the captured run may differ from the eager one only as much
    # as two eager runs differ from each other (float atomics in the backward reorder; under bf16
    # and Adam's early sign-like updates that spread to whole learning-rate steps), plus rounding.
    spread = max(abs(a - b) for a, b in zip(le, la))
    assert max(abs(a - b) for a, b in zip(lg, le)) <= 4 * spread + 1e-4 * max(abs(v) for v in le) + 1e-7
    # The trained fields must predict alike. (Not every parameter: with Adam's eps = 1e-15, a texel
    # whose gradient is ~0 takes a full learning-rate step of whichever sign rounding gives it, so
    # a 1e-9 difference between the graph's and the eager kernels' sums moves such texels by up to
    # 2 x lr while no ray sees the difference; seen on the H200 with learned poses + background.)
    pe_, pa_, pg_ = (_predictions(c) for c in (ce, ca, cg))
    noise = (pa_ - pe_).abs().max().item()
    worst = (pg_ - pe_).abs().max().item()
    assert worst <= 4 * noise + 1e-3 * pe_.abs().max().item() + 1e-6, (worst, noise)
    for (name, pe), pg in zip(ce.projector.named_parameters(), cg.projector.parameters()):
        if name.startswith(("poses.", "intensity.")):  # the pose and intensity values themselves
            assert (pg - pe).abs().max().item() <= 1e-3 * max(1.0, pe.abs().max().item()), name
    # the learning-rate schedule reaches the captured Adam step
    assert float(cg.optimizer.param_groups[0]["lr"]) == pytest.approx(ce.optimizer.param_groups[0]["lr"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph capture)")
def test_captured_run_checkpoint_resumes_eagerly(tmp_path):
    from fasttomo.train.checkpoint import load_checkpoint, save_checkpoint

    graph, cg, _ = _train(["runtime.cuda_graph=on"], WARMUP + 4)
    save_checkpoint(tmp_path / "g.pt", graph.state_dict())
    cfg = compose_config([*TINY, "runtime.cuda_graph=off"])
    c = build(cfg, load_tiltseries(cfg.data))
    tr = make_trainer(c, None)
    tr.load_state_dict(load_checkpoint(tmp_path / "g.pt"))
    assert isinstance(c.optimizer.param_groups[0]["lr"], float)
    tr.fit(WARMUP + 6)
    assert tr.step == WARMUP + 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA-graph capture)")
def test_guard_skips_bad_steps_and_rolls_back_inside_the_captured_graph():
    """The divergence guard is part of the captured step: a NaN batch is skipped on the device at
    replay (no host branch), and a rollback restores the state in place, so replays go on."""
    import dataclasses

    cfg = compose_config([*TINY, "runtime.cuda_graph=on", "guard.max_bad_steps=3"])
    c = build(cfg, load_tiltseries(cfg.data))
    tr = make_trainer(c, None)
    tr.guard.start(0)
    for step in range(WARMUP + 2):
        tr._set_lr(step)
        tr.train_step(c.sampler.next_batch())
    assert tr.graphed.graph is not None and tr.graphed.replays == 2
    good = c.sampler.next_batch()
    bad = dataclasses.replace(good, target=torch.full_like(good.target, float("nan")))
    before = [p.detach().clone() for p in c.projector.parameters()]
    tr.train_step(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, c.projector.parameters()))
    assert tr.guard.summary()["skipped_steps"] == 1
    tr.train_step(c.sampler.next_batch())
    moved = [p.detach().clone() for p in c.projector.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, moved))
    for _ in range(3):
        tr.train_step(bad)
    tr.guard.check(WARMUP + 7)
    assert tr.guard.rollbacks == 1 and tr.guard.lr_scale == 0.5
    replays = tr.graphed.replays
    tr.train_step(c.sampler.next_batch())
    assert tr.graphed.replays == replays + 1
    assert all(torch.isfinite(p).all() for p in c.projector.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_guard_merges_into_the_grad_scaler_on_cuda():
    import dataclasses

    cfg = compose_config([*TINY, "precision=fp16"])
    c = build(cfg, load_tiltseries(cfg.data))
    tr = make_trainer(c, None)
    for step in range(3):
        tr._set_lr(step)
        tr.train_step(c.sampler.next_batch())
    good = c.sampler.next_batch()
    bad = dataclasses.replace(good, target=torch.full_like(good.target, float("nan")))
    before = [p.detach().clone() for p in c.projector.parameters()]
    tr.train_step(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, c.projector.parameters()))
    assert tr.guard.summary()["skipped_steps"] == 1
