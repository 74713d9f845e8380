"""The non-finite and divergence guard of the training step.

Inside the step (eager or captured in a CUDA graph; nothing here branches on the host):

* :meth:`Guard.inspect` measures the loss and the global gradient norm (fp32/bf16; under fp16 the
  GradScaler owns the gradients' overflow check) and decides on the device whether the step is
  bad: a non-finite loss or gradient norm, or a loss above ``divergence_factor`` times the running
  average (EMA) of the accepted steps' losses. Under DDP the loss and norm are all-reduced first,
  so every rank takes the same decision from the same numbers.
* The flag goes to :meth:`fasttomo.train.precision.Precision.step` as ``skip``: the fused Adam
  update takes it as its ``found_inf`` argument and leaves the parameters, moments and step
  counter untouched when it is set; under fp16 it is merged into the GradScaler's own flag. So a
  bad step changes nothing and nothing non-finite ever reaches the parameters (and, through
  them, the sampling coordinates of the kernels, which crash on NaN on the CPU).

On the host, every ``check_every`` steps (one tiny sync) :meth:`Guard.check` reads the counters:

* skipped steps are logged (and counted in metrics.json);
* after ``max_bad_steps`` bad steps in a row the parameters and optimizer state are restored, in
  place (a captured graph keeps its pointers), from the last confirmed snapshot, and the learning
  rates are multiplied by ``lr_factor`` for the rest of the run (:attr:`Guard.lr_scale`);
* after ``max_rollbacks`` rollbacks the next streak raises :class:`DivergenceError` (the state is
  rolled back first, so the caller can save the last good state).

Snapshots: the state at a check with no bad step pending becomes a candidate; it is confirmed as
the rollback target once ``snapshot_every`` more steps passed without a skipped one. The start
of the run (or the resumed state) is the first confirmed snapshot. A snapshot holds the
parameters, the optimizer state, the running loss (so that a rollback does not judge the older
state's loss against a later, lower average) and, under fp16, the GradScaler's scale (each skipped
step halves it: without the restore a recovered run trained on with gradients underflowing to 0).
"""

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger("fasttomo.train")

EMA_DECAY = 0.9
_EMA, _BAD_RUN, _BAD_TOTAL, _N_GOOD, _LOSS, _GNORM = range(6)


class DivergenceError(RuntimeError):
    """Training diverged and rollbacks did not help; the message names the fix."""


class Guard:
    def __init__(self, cfg, optimizer: torch.optim.Optimizer, device: torch.device, world_size: int = 1,
                 check_grads: bool = True, base_lrs: dict[str, float] | None = None,
                 scaler: torch.amp.GradScaler | None = None):
        self.cfg = cfg
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.enabled = bool(cfg.enabled)
        self.optimizer = optimizer
        self.device = device
        self.world_size = world_size
        self.check_grads = check_grads
        self.base_lrs = dict(base_lrs or {})
        # [ema of accepted losses, bad steps in a row, bad steps in total, accepted steps, last loss, last grad norm]
        self.state = torch.zeros(6, device=device, dtype=torch.float32)
        self.grad_norm = torch.zeros((), device=device, dtype=torch.float32)  # for clipping (same step)
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.skipped_reported = 0
        self._confirmed: dict | None = None  # {"step", "tensors"}
        self._pending: dict | None = None   # {"step", "bad_total", "tensors"}
        self._spare: dict | None = None     # buffers of a dropped snapshot, reused by the next one
        self.rolled_back_to: int | None = None  # step of the state the last rollback restored

    # ------------------------------------------------------------------ inside the step (no host sync)
    def inspect(self, loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor | None:
        """Device flag (float 0/1) that this step is bad; None when the guard is off. Updates the
        counters in place (a captured graph replays the update)."""
        if not self.enabled:
            return None
        loss = loss.detach().float().reshape(())
        if self.check_grads:
            grads = [p.grad for p in params if p.grad is not None]
            gnorm = (torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=True).float()
                     if grads else torch.zeros((), device=loss.device))
        else:
            gnorm = torch.zeros((), device=loss.device)
        pair = torch.stack([loss, gnorm.reshape(())])
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(pair, op=dist.ReduceOp.SUM)  # NaN/Inf on any rank reaches every rank
            pair = pair / self.world_size
        loss_m, gnorm_m = pair[0], pair[1]
        s = self.state
        ema, bad_run, bad_total, n_good = s[_EMA], s[_BAD_RUN], s[_BAD_TOTAL], s[_N_GOOD]
        has_ref = n_good > 0
        bad = ~(torch.isfinite(loss_m) & torch.isfinite(gnorm_m))
        if self.cfg.divergence_factor > 0:
            bad = bad | (has_ref & (loss_m > self.cfg.divergence_factor * ema))
        badf = bad.float()
        new_ema = torch.where(bad, ema, torch.where(has_ref, EMA_DECAY * ema + (1 - EMA_DECAY) * loss_m, loss_m))
        s.copy_(torch.stack([new_ema, (bad_run + 1) * badf, bad_total + badf, n_good + 1 - badf, loss_m, gnorm_m]))
        self.grad_norm.copy_(gnorm.reshape(()))
        return badf

    # ------------------------------------------------------------------ on the host, every check_every steps
    def due(self, step: int) -> bool:
        return self.enabled and step % self.cfg.check_every == 0

    def check(self, step: int, final: bool = False) -> None:
        """Read the counters (a sync), log skipped steps, roll back after a bad streak, keep the
        snapshots; raises :class:`DivergenceError` when the rollbacks are used up, or when the
        run ends (``final``) in a bad streak (no steps are left to recover)."""
        if not self.enabled:
            return
        if self._confirmed is None:  # fit() calls start(); a caller driving train_step itself may not
            self.start(step)
        ema, bad_run, bad_total, n_good, loss, gnorm = self.state.tolist()
        bad_run, bad_total = int(bad_run), int(bad_total)
        new = bad_total - self.skipped_reported
        if new > 0:
            self.skipped_reported = bad_total
            log.warning("step %d: skipped %d step(s) with a non-finite or exploding loss or gradient (%d in a row; "
                        "last loss %.4g, gradient norm %.4g, running loss %.4g); the parameters were left as they "
                        "were.",
                        step, new, bad_run, loss, gnorm, ema)
        if bad_run >= self.cfg.max_bad_steps:
            self._rollback(step, bad_run, loss, gnorm, final)
            return
        if bad_run:
            return
        p = self._pending
        if p is not None and p["bad_total"] != bad_total:  # a bad step since it was taken: not trustworthy
            self._spare, self._pending, p = p["tensors"], None, None
        if p is not None and step - p["step"] >= self.cfg.snapshot_every:
            self._spare, self._confirmed, self._pending, p = self._confirmed["tensors"], p, None, None
        if p is None:
            self._pending = {"step": step, "bad_total": bad_total, "tensors": self._take(self._spare),
                             **self._host_state(ema, n_good)}
            self._spare = None

    def start(self, step: int) -> None:
        """The state at the start of fitting is the first rollback target."""
        if self.enabled and self._confirmed is None:
            ema, _, _, n_good, _, _ = self.state.tolist()
            self._confirmed = {"step": step, "tensors": self._take(None), **self._host_state(ema, n_good)}

    def _host_state(self, ema: float, n_good: float) -> dict:
        """What a snapshot keeps beside the tensors: the running loss and, under fp16, the scale."""
        return {"ema": ema, "n_good": n_good, "scale": self.scaler.get_scale() if self.scaler is not None else None}

    def reset_for_continuation(self) -> None:
        """Before the last good state is saved at a divergence: the continuation starts with the
        learning rates the user gives it, all rollbacks available and no running loss."""
        self.rollbacks, self.lr_scale = 0, 1.0
        self.state[_EMA] = 0
        self.state[_N_GOOD] = 0
        self.state[_BAD_RUN] = 0

    def _take(self, into: dict | None) -> dict:
        with torch.no_grad():
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            snap = {"params": [], "state": []}
            for i, p in enumerate(params):
                old_p = into["params"][i] if into is not None else None
                snap["params"].append(_copy(p.data, old_p))
                st = self.optimizer.state.get(p, {})
                old_st = into["state"][i] if into is not None else {}
                snap["state"].append({k: _copy(v, old_st.get(k)) for k, v in st.items() if torch.is_tensor(v)})
            return snap

    def _restore(self, snap: dict) -> None:
        with torch.no_grad():
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for p, sp, sst in zip(params, snap["params"], snap["state"]):
                p.data.copy_(sp)
                st = self.optimizer.state.get(p, {})
                for k, v in st.items():
                    if torch.is_tensor(v):
                        if k in sst:
                            v.copy_(sst[k])
                        else:  # created after the snapshot (the run's first step): back to fresh
                            v.zero_()

    def _rollback(self, step: int, bad_run: int, loss: float, gnorm: float, final: bool = False) -> None:
        target = self._confirmed
        self._restore(target["tensors"])
        self.state[_BAD_RUN] = 0
        self.state[_EMA] = target["ema"]
        self.state[_N_GOOD] = target["n_good"]
        if self.scaler is not None:  # a rollback follows bad steps, so the scaler has its scale tensor
            self.scaler.update(new_scale=float(target["scale"]))  # in place: a captured graph reads it
        self.rolled_back_to = target["step"]
        if self._pending is not None:
            self._spare, self._pending = self._pending["tensors"], None
        if self.rollbacks >= self.cfg.max_rollbacks or final:
            lrs = ", ".join(f"optim.lr_{k}={v:g}" + _vs_default(k, v) for k, v in self.base_lrs.items())
            why = (f"after {self.rollbacks} rollback(s) with the learning rates lowered to {self.lr_scale:.3g} x the "
                   f"configured ones" if not final or self.rollbacks else "at the end of the run")
            raise DivergenceError(
                f"training diverged at step {step}: {bad_run} steps in a row had a non-finite or exploding loss or "
                f"gradient (last loss {loss:.4g}, gradient norm {gnorm:.4g}) {why} ({lrs}); the parameters were "
                f"rolled back to their last good state (step {target['step']}). Lower the learning rates, or clip "
                "the gradients (optim.grad_clip=1.0), or allow more rollbacks (guard.max_rollbacks).")
        self.rollbacks += 1
        self.lr_scale *= self.cfg.lr_factor
        log.warning("step %d: %d steps in a row had a non-finite or exploding loss or gradient (last loss %.4g, "
                    "gradient norm %.4g): rolled back to the state of step %d and lowered the learning rates to "
                    "%.3g x the configured ones (rollback %d of %d allowed).", step, bad_run, loss, gnorm,
                    target["step"], self.lr_scale, self.rollbacks, self.cfg.max_rollbacks)

    # ------------------------------------------------------------------ logging and checkpoints
    def scalars(self) -> dict[str, float]:
        """TensorBoard values at a log step (the caller syncs there anyway)."""
        if not self.enabled:
            return {}
        ema, bad_run, bad_total, n_good, loss, gnorm = self.state.tolist()
        out = {"guard/skipped_steps": bad_total, "guard/lr_scale": self.lr_scale}
        if self.check_grads and math.isfinite(gnorm):
            out["grad_norm"] = gnorm
        return out

    def summary(self) -> dict:
        ema, bad_run, bad_total, n_good, loss, gnorm = self.state.tolist()
        return {"enabled": self.enabled, "skipped_steps": int(bad_total), "rollbacks": self.rollbacks,
                "lr_scale": self.lr_scale}

    def state_dict(self) -> dict:
        return {"state": self.state.detach().cpu().clone(), "lr_scale": self.lr_scale, "rollbacks": self.rollbacks,
                "skipped_reported": self.skipped_reported}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        saved = state["state"].to(self.state.device, torch.float32)
        self.state[: saved.numel()].copy_(saved)
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skipped_reported = int(state.get("skipped_reported", 0))


def _vs_default(group: str, lr: float) -> str:
    """' (N x its default D)' for a learning rate far above its default, the likely culprit."""
    from fasttomo.config import OptimConfig

    default = getattr(OptimConfig, f"lr_{group}", None)
    if isinstance(default, float) and default > 0 and lr > 10 * default:
        return f" ({lr / default:.3g} x its default {default:g})"
    return ""


def _copy(src: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    if into is not None and into.shape == src.shape and into.dtype == src.dtype and into.device == src.device:
        return into.copy_(src)
    return src.detach().clone()
