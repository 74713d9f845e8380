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
