"""The CPU allocator settings (fasttomo.run.allocator): real child processes, page faults counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")

CHILD = r"""
import json, resource, sys, torch
from fasttomo.run import allocator
if sys.argv[1] == "build":
    from fasttomo.run.build import build
    from fasttomo.data.load import load_tiltseries
    from fasttomo.cli.reconstruct import compose_config
    cfg = compose_config(["runtime=cpu", "data=phantom_small", "logging=quiet"])
    build(cfg, load_tiltseries(cfg.data))
    applied = allocator._applied
else:
    applied = allocator.tune_cpu_allocator()
torch.set_num_threads(1)
# temporaries of growing size (1 MiB to 9 MiB): glibc's own mmap threshold follows the largest
# freed block, so each new size is mapped afresh and faults in every page without the settings
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for k in range(128):
    torch.ones((1 << 18) + k * (1 << 14)).sum()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0}))
"""


def _child(mode: str, tuning: str) -> dict:
    env = {**os.environ, "FASTTOMO_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuning_keeps_freed_mb_blocks_in_the_heap():
    on, off = _child("direct", "1"), _child("direct", "0")
    assert on["applied"] is True and off["applied"] is False
    # 128 fresh mappings, 164k pages in all, against one heap region grown to 9 MiB (2.3k pages)
    assert off["faults"] > 100_000, off
    assert on["faults"] < 10_000, on


def test_a_cpu_build_applies_it():
    assert _child("build", "1")["applied"] is True
    assert _child("build", "0")["applied"] is False
