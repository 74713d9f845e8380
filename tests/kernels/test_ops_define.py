"""Why kernels/triton/ops.py registers its ops with ``torch.library.define`` / ``impl`` and not
``torch.library.custom_op``: an op made by custom_op imports torch._dynamo (seconds) at its first
call, one made the way ops.py does it does not. Checked in fresh processes; if torch stops
importing dynamo there, the first test fails and ops.py can use custom_op again."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

CHILD = r"""
import sys
import torch
x = torch.arange(4.0)
if sys.argv[1] == "custom_op":
    @torch.library.custom_op("fasttomo_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2
    y = twice(x)
else:
    from fasttomo.kernels.triton import ops  # the module's own registration helper
    assert "torch._dynamo" not in sys.modules, "importing the op module imported torch._dynamo"

    @ops._op("test_twice(Tensor x) -> Tensor")
    def twice(x):
        return x * 2

    @ops._fake("test_twice")
    def _(x):
        return torch.empty_like(x)

    y = torch.ops.fasttomo.test_twice(x)
assert y.tolist() == [0.0, 2.0, 4.0, 6.0]
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""


def _run(how: str) -> str:
    out = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_custom_op_still_imports_dynamo_at_its_first_call():
    assert _run("custom_op") == "dynamo", "custom_op no longer imports torch._dynamo: ops.py may use it again"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the op module imports triton")
def test_ops_defined_as_ops_py_does_are_called_without_dynamo():
    assert _run("define") == "no dynamo"
