"""The non-finite and divergence guard (issue 10, case 1): a bad step changes nothing, a bad
streak rolls back to the last good state with lower learning rates, unrecoverable divergence is
a clear error, and nothing non-finite reaches the parameters, a volume file or metrics.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fasttomo.run.build import build, make_trainer
from fasttomo.config import GuardConfig
from fasttomo.data.load import load_tiltseries
from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.train.guard import DivergenceError, Guard
from fasttomo.train.precision import Precision
from fasttomo.train.trainer import Trainer

TINY = ["experiment=quick", "logging=quiet", "runtime=cpu", "runtime.threads=1", "data.width=16", "data.height=16",
        "data.n_tilts=9", "model.resolutions=[8]", "sampler.batch_size=128", "projector.samples_per_ray=16",
        "guard.check_every=5"]


def _strict(path: Path):
    def bad(token):
        raise ValueError(f"{token} is not JSON")
    return json.loads(path.read_text(), parse_constant=bad)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _toy(cfg: GuardConfig, dtype: str = "fp32"):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(lin.parameters(), lr=0.1, fused=True)
    for g in opt.param_groups:
        g["name"] = "grids"
    prec = Precision(dtype, torch.device("cpu"))
    guard = Guard(cfg, opt, torch.device("cpu"), check_grads=not prec.scaler.is_enabled(), base_lrs={"grids": 0.1},
                  scaler=prec.scaler)
    guard.start(0)
    x = torch.randn(8, 4)

    def step(bad: bool = False):
        opt.zero_grad(set_to_none=True)
        loss = lin(x).square().mean() * (float("nan") if bad else 1.0)
        prec.backward(loss)
        params = list(lin.parameters())
        skip = guard.inspect(loss, params)
        prec.step(opt, params, None, skip=skip, grad_norm=guard.grad_norm)
    return lin, opt, guard, step, prec


def test_a_bad_step_changes_nothing_and_is_counted():
    lin, opt, guard, step, _ = _toy(GuardConfig())
    step()
    before = _params(lin)
    state = {k: v.clone() for k, v in opt.state[lin.weight].items()}
    step(bad=True)  # NaN loss and gradients: the fused update is cancelled on the device
    for a, b in zip(before, _params(lin)):
        assert torch.equal(a, b)
    for k, v in opt.state[lin.weight].items():
        assert torch.equal(v, state[k]), k
    step()  # and training goes on
    assert not torch.equal(before[0], lin.weight.detach())
    assert guard.summary()["skipped_steps"] == 1


def test_exploding_loss_counts_as_bad():
    lin, opt, guard, step, _ = _toy(GuardConfig(divergence_factor=10.0))
    step()
    before = _params(lin)
    with torch.no_grad():
        lin.weight.mul_(1e4)  # the next loss is ~1e8 x the running average: exploding
    huge = _params(lin)
    step()
    assert guard.summary()["skipped_steps"] == 1
    assert torch.equal(huge[0], lin.weight.detach())
    assert not torch.equal(before[0], huge[0])


def test_bad_streak_rolls_back_and_lowers_the_learning_rate_then_gives_up():
    cfg = GuardConfig(max_bad_steps=3, max_rollbacks=1, lr_factor=0.5, snapshot_every=2)
    lin, opt, guard, step, _ = _toy(cfg)
    for i in range(1, 6):  # good steps; a snapshot taken at a check is confirmed 2 good steps later
        step()
        guard.check(i)
    confirmed = guard._confirmed["step"]
    assert confirmed == 3  # taken at 3, confirmed at 5
    with torch.no_grad():
        lin.weight.add_(100.0)  # a poisoned state: every later step explodes
    for i in range(6, 10):
        step()
    guard.check(9)
    assert guard.rollbacks == 1 and guard.lr_scale == 0.5 and guard.rolled_back_to == confirmed
    assert lin.weight.abs().max() < 50  # restored from the snapshot
    with torch.no_grad():
        lin.weight.add_(100.0)
    for i in range(10, 14):
        step()
    with pytest.raises(DivergenceError, match=r"training diverged at step 13.*guard.max_rollbacks"):
        guard.check(13)
    assert lin.weight.abs().max() < 50  # rolled back before giving up: the caller can save the good state


def test_fp16_scaler_takes_the_guard_flag():
    """Under fp16 the GradScaler owns the overflow check; the guard's flag (here: an exploding
    loss with finite gradients) is merged into it, so the step is skipped there too."""
    lin, opt, guard, step, prec = _toy(GuardConfig(divergence_factor=10.0), dtype="fp16")
    step()
    scale = prec.scaler.get_scale()
    with torch.no_grad():
        lin.weight.mul_(1e3)
    huge = _params(lin)
    step()
    assert torch.equal(huge[0], lin.weight.detach())
    assert prec.scaler.get_scale() < scale


def test_a_rollback_restores_the_running_loss_of_its_state():
    """The restored state's loss is judged against the running loss of that state, not against the
    lower average of the later training it undid (which rejected every step after a rollback and
    declared a recovering run diverged)."""
    cfg = GuardConfig(max_bad_steps=3, max_rollbacks=2, snapshot_every=2, divergence_factor=1.3)
    lin, opt, guard, step, _ = _toy(cfg)
    for i in range(1, 6):
        step()
        guard.check(i)
    target = dict(guard._confirmed)
    for _ in range(6, 30):  # training goes on, the running loss falls well below the snapshot's
        step()
    assert guard.state[0] < target["ema"] / 1.3
    for _ in range(3):
        step(bad=True)
    guard.check(32)
    assert guard.rolled_back_to == target["step"] and guard.state[0].item() == pytest.approx(target["ema"])
    skipped = guard.summary()["skipped_steps"]
    for _ in range(5):
        step()
    assert guard.summary()["skipped_steps"] == skipped  # the restored state trains on


def test_fp16_rollback_restores_the_gradient_scale():
    """Under fp16 every skipped step halves the GradScaler's scale; a rollback restores the scale of
    its state, so the recovered run does not train on with gradients underflowing to zero."""
    cfg = GuardConfig(max_bad_steps=4, max_rollbacks=2, snapshot_every=2, divergence_factor=10.0)
    lin, opt, guard, step, prec = _toy(cfg, dtype="fp16")
    for i in range(1, 6):
        step()
        guard.check(i)
    scale = guard._confirmed["scale"]
    with torch.no_grad():
        lin.weight.mul_(1e3)  # exploding, finite: skipped, and each skip halves the scale
    for _ in range(4):
        step()
    assert prec.scaler.get_scale() <= scale / 16
    guard.check(9)
    assert guard.rollbacks == 1 and prec.scaler.get_scale() == scale


def test_the_state_saved_at_a_divergence_continues_with_a_fresh_guard():
    """The last good state saved at a divergence is continued with the user's lower learning rates:
    all rollbacks available again, no lowered rate factor, no running loss of the diverged run."""
    cfg = GuardConfig(max_bad_steps=2, max_rollbacks=0, snapshot_every=1)
    lin, opt, guard, step, _ = _toy(cfg)
    for i in range(1, 4):
        step()
        guard.check(i)
    for _ in range(2):
        step(bad=True)
    with pytest.raises(DivergenceError):
        guard.check(5)
    guard.rollbacks, guard.lr_scale = 3, 0.125
    guard.reset_for_continuation()
    saved = guard.state_dict()
    assert saved["rollbacks"] == 0 and saved["lr_scale"] == 1.0 and saved["state"][3] == 0 and saved["state"][0] == 0


def _nan_at(trainer: Trainer, steps: set[int]):
    """Make the data loss NaN at the given steps (0-based)."""
    original = trainer.projector.data_loss
    calls = {"n": 0}

    def data_loss(pred, batch, *rest):
        out = original(pred, batch, *rest)
        i = calls["n"]
        calls["n"] += 1
        return {k: v * float("nan") for k, v in out.items()} if i in steps else out
    trainer.projector.data_loss = data_loss


def test_one_nan_step_in_a_run_is_skipped_and_the_run_finishes(tmp_path):
    cfg = compose_config([*TINY, "optim.steps=12", f"output.dir={tmp_path / 'r'}"])
    comps = build(cfg, load_tiltseries(cfg.data))
    trainer = make_trainer(comps, None)
    _nan_at(trainer, {6})
    trainer.fit(6)
    before = _params(comps.projector)
    trainer.fit(7)
    after = _params(comps.projector)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # step 7 (NaN) left the parameters alone
    trainer.fit()
    assert trainer.step == 12 and trainer.guard.summary()["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in comps.projector.parameters())


@pytest.mark.parametrize("override", ["model=kplanes", "model=kplanes_tilted"])
def test_divergent_decoder_rate_is_a_clear_error_and_writes_no_nan(tmp_path, override):
    """optim.lr_decoder=1e6 used to end in a segfault (NaN rotations -> NaN sampling coordinates ->
    grid_sample) or, with plain K-Planes, in exit 0 with an all-NaN volume and NaN in metrics.json."""
    out = tmp_path / "run"
    cfg = compose_config([*TINY, override, "optim.lr_decoder=1e6", "optim.steps=40", "guard.max_rollbacks=1",
                          f"output.dir={out}"])
    with pytest.raises(DivergenceError, match=r"training diverged.*optim.lr_decoder=1e\+06 \(2e\+08 x its default"):
        run(cfg)
    assert not list(out.glob("volume*"))
    metrics = _strict(out / "metrics.json")  # the status is where the README says it is
    assert metrics["status"] == "diverged" and "training diverged" in metrics["error"]
    assert metrics["guard"]["rollbacks"] >= 1 and metrics["loss"]["curve"]
    manifest = _strict(out / "manifest.json")
    assert "metrics.json" in manifest["files"]
    assert manifest["status"] == "diverged" and "training diverged" in manifest["error"]
    assert "[ERROR] training diverged" in (out / "reconstruct.log").read_text()


def test_exploding_grid_rate_is_caught_not_reported_as_success(tmp_path):
    """optim.lr_grids=1e6 used to exit 0 with loss 1e34 and a volume max of 1.5e16."""
    cfg = compose_config([*TINY, "optim.lr_grids=1e6", "optim.steps=40", "guard.max_rollbacks=1",
                          f"output.dir={tmp_path / 'run'}"])
    with pytest.raises(DivergenceError, match="optim.lr_grids=1e\\+06"):
        run(cfg)
    assert not list((tmp_path / "run").glob("volume*"))


def test_metrics_json_is_strict_json_even_without_validation(tmp_path):
    """No validation pixels: the validation loss is NaN, which used to be written as a bare NaN."""
    out = tmp_path / "run"
    metrics = run(compose_config([*TINY, "optim.steps=4", "sampler.val_fraction=0.0", f"output.dir={out}"]))
    saved = _strict(out / "metrics.json")
    assert saved["val_loss"]["last"] is None and math.isnan(metrics["val_loss"]["last"])
    assert saved["status"] == "finished" and saved["guard"]["skipped_steps"] == 0


def test_a_field_that_learned_nothing_is_not_reported_as_finished(tmp_path):
    """A decoder learning rate that kills the decoder (every ReLU off) leaves a finite but constant
    volume: the run ends as diverged (exit code 3 on the command line, status in metrics.json and
    the manifest), naming the flat volume and the fix; the volume file is kept for inspection."""
    from fasttomo.run import results

    out = tmp_path / "dead"
    with pytest.raises(DivergenceError, match=r"the reconstructed volume is flat \(its values span .* against the "
                                              r"data's contrast of .*Lower the learning rates"):
        run(compose_config([*TINY, "optim.steps=100", "optim.lr_decoder=0.25", f"output.dir={out}"]))
    metrics = _strict(out / "metrics.json")
    assert metrics["status"] == "diverged" and "span" in metrics["volume_flat"]
    assert json.loads((out / "manifest.json").read_text())["status"] == "diverged"
    assert (out / "volume.mrc").is_file()
    ts = load_tiltseries(compose_config(TINY).data)
    assert results.flat_volume(torch.full((4, 8, 8), 0.06).numpy(), ts) is not None
    varied = torch.linspace(0, 1, 256).reshape(4, 8, 8).numpy()
    assert results.flat_volume(varied, ts) is None  # a working field's range reaches the data's contrast
