"""fasttomo's Adam is torch's Adam minus the import of torch._dynamo: same updates, same
state_dict (loadable by either), and a run's build, steps and checkpoint never import dynamo."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fasttomo.train.adam import Adam

SRC = Path(__file__).resolve().parents[2] / "src"


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g).requires_grad_(), torch.randn(7, generator=g).requires_grad_()]


@pytest.mark.parametrize("fused", [True, None])
def test_same_updates_and_state_as_torch_adam(fused):
    a, b = _params(), _params()
    kw = dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, fused=fused)
    ta = torch.optim.Adam([{"params": a[:1], "lr": 0.1}, {"params": a[1:], "lr": 0.01}], **kw)
    fb = Adam([{"params": b[:1], "lr": 0.1}, {"params": b[1:], "lr": 0.01}], **kw)
    for step in range(6):
        for opt, ps in ((ta, a), (fb, b)):
            opt.zero_grad()
            sum(((p - step) ** 2).sum() for p in ps).backward()
            opt.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    sa, sb = ta.state_dict(), fb.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k in sa["state"]:
        for name in sa["state"][k]:
            torch.testing.assert_close(sa["state"][k][name], sb["state"][k][name], rtol=0, atol=0)
    # each loads the other's state and continues identically
    c = _params()
    fc = Adam([{"params": c[:1], "lr": 0.1}, {"params": c[1:], "lr": 0.01}], **kw)
    with torch.no_grad():
        for p, q in zip(c, a):
            p.copy_(q)
    fc.load_state_dict(copy.deepcopy(sa))  # torch's load_state_dict may share tensors with its input
    for opt, ps in ((ta, a), (fc, c)):
        opt.zero_grad()
        sum((p ** 2).sum() for p in ps).backward()
        opt.step()
    for p, q in zip(a, c):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_differentiable_is_refused():
    with pytest.raises(ValueError, match="differentiable"):
        Adam(_params(), differentiable=True)


def test_a_run_never_imports_dynamo(tmp_path):
    """Build the embedded default, take steps, save and load the optimizer state: torch._dynamo
    stays unimported (it costs seconds at every start)."""
    code = f"""
import sys
sys.path.insert(0, {str(SRC)!r})
from fasttomo.run.build import build, make_trainer
from fasttomo.data.load import load_tiltseries
from fasttomo.cli.reconstruct import compose_config
cfg = compose_config(["logging=quiet", "output.dir={tmp_path}", "data.width=16", "data.height=16",
                      "data.n_tilts=5", "sampler.batch_size=32", "projector.samples_per_ray=8"])
comps = build(cfg, load_tiltseries(cfg.data))
tr = make_trainer(comps, None)
for i in range(3):
    tr._set_lr(i)
    tr.train_step(comps.sampler.next_batch())
comps.optimizer.load_state_dict(comps.optimizer.state_dict())
assert "torch._dynamo" not in sys.modules, "a run imported torch._dynamo"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# --------------------------------------------------------------------------------------- the private trick
# (class, method name, the module torch defines the method in): the methods fasttomo's Adam calls
# through inspect.unwrap. If a test below fails, torch changed the wrappers: read
# fasttomo/train/adam.py again (the trick may be unneeded now, or unwrap may strip something new).
WRAPPED = [(torch.optim.Optimizer, "add_param_group", "torch.optim.optimizer"),
           (torch.optim.Optimizer, "zero_grad", "torch.optim.optimizer"),
           (torch.optim.Optimizer, "state_dict", "torch.optim.optimizer"),
           (torch.optim.Optimizer, "load_state_dict", "torch.optim.optimizer"),
           (torch.optim.Adam, "step", "torch.optim.adam")]


# the wrappers torch puts around them, by (function name, file): torch._disable_dynamo's, the
# differentiable/no_grad switch of step (both import torch._dynamo: what the trick skips), and the
# hook/profiler wrapper Optimizer.__init__ puts on the step of the class it builds (fasttomo's Adam
# gets its own, tested below, so the one on torch.optim.Adam.step must be skipped too)
SKIPPED = {("inner", "torch/_compile.py"), ("_use_grad", "torch/optim/optimizer.py")}
HOOK = ("wrapper", "torch/optim/optimizer.py")


def _wrappers(fn) -> list[tuple[str, str]]:
    chain = []
    while hasattr(fn, "__wrapped__"):
        code = fn.__code__
        chain.append((code.co_name, "torch/" + code.co_filename.replace("\\", "/").split("/torch/", 1)[1]))
        fn = fn.__wrapped__
    return chain


@pytest.mark.parametrize("cls, name, module", WRAPPED, ids=[w[1] for w in WRAPPED])
def test_unwrap_skips_only_the_wrappers_the_trick_means_to_skip(cls, name, module):
    import inspect

    torch.optim.Adam(_params())  # patches torch.optim.Adam.step with the hook wrapper, as any torch Adam does
    wrapped = getattr(cls, name)
    chain = _wrappers(wrapped)
    skipped = [w for w in chain if w != HOOK]
    assert len(skipped) == 1 and set(skipped) <= SKIPPED, (
        f"torch changed the wrappers of {cls.__name__}.{name} ({chain}): read fasttomo/train/adam.py again")
    raw = inspect.unwrap(wrapped)
    assert raw.__qualname__ == f"{cls.__name__}.{name}" and raw.__module__ == module


def test_step_hooks_and_the_profiler_label_still_run_once():
    """Optimizer.__init__ wraps fasttomo's Adam.step itself (hooks, record_function): a step
    pre-hook and post-hook run once per step."""
    calls = []
    opt = Adam(_params(), lr=0.1)
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    assert _wrappers(type(opt).step) == [HOOK]
    for _ in range(2):
        opt.zero_grad()
        sum((p ** 2).sum() for p in opt.param_groups[0]["params"]).backward()
        opt.step()
    assert calls == ["pre", "post", "pre", "post"]


def test_torchs_wrappers_import_dynamo_and_fasttomos_adam_does_not():
    """The reason for the trick, checked in fresh processes: the same calls import torch._dynamo
    through torch.optim.Adam and not through fasttomo's Adam."""
    code = f"""
import sys
sys.path.insert(0, {str(SRC)!r})
import torch
from fasttomo.train.adam import Adam
cls = Adam if sys.argv[1] == "fasttomo" else torch.optim.Adam
p = torch.zeros(3, requires_grad=True)
opt = cls([p], lr=0.1)
opt.zero_grad()
(p - 1).pow(2).sum().backward()
opt.step()
opt.load_state_dict(opt.state_dict())
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo", p.detach().tolist())
"""
    lines = {}
    for which in ("torch", "fasttomo"):
        out = subprocess.run([sys.executable, "-c", code, which], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        lines[which] = out.stdout.strip().splitlines()[-1]
    assert lines["torch"].startswith("dynamo "), "torch.optim no longer imports dynamo here: the trick is not needed"
    assert lines["fasttomo"].startswith("no dynamo ")
    assert lines["torch"].split(" ", 1)[1] == lines["fasttomo"].split(" ", 2)[2]  # the same step
