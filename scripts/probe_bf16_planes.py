#!/usr/bin/env python
"""probe_bf16_planes: what sampling the planes in bf16 does to a reconstruction's quality (any device).

The fused kernels can sample a bf16 copy of the planes (half the gathered bytes; docs/kernels.md,
"bf16 planes"); runs do not use it yet. This probe runs ``scripts/bench_quality.py`` with every
field run's planes rounded to bf16 where the interpolation reads them: a ``sitecustomize`` module
(written to a temporary folder put first on PYTHONPATH) wraps ``fasttomo.kernels.dispatch.tilted_kplanes``
so that it samples ``planes + (round_bf16(planes) - planes).detach()``. The values are exactly the
bf16 copy's, the gradients flow to the fp32 planes unchanged, and dL/dq, dL/dframes come from the
rounded values, as in the kernels. Compare its record with a plain bench_quality run of the same
cases (and with the seed spread: ``--variant seed1="runtime.seed=1"``).

    python scripts/probe_bf16_planes.py --cases default64 noise5_64 --size 64 --methods field-default

Every argument goes to bench_quality unchanged; the record is named ``bench_quality-bf16-planes-...``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = '''import os
if os.environ.get("FASTTOMO_PROBE_BF16_PLANES") == "1":
    import torch
    import fasttomo.kernels.dispatch as _d

    _orig = _d.tilted_kplanes

    def _bf16_planes(points, matrices, plane_data, layout, *args, **kwargs):
        pd = plane_data.detach()
        return _orig(points, matrices, plane_data + (pd.to(torch.bfloat16).to(pd.dtype) - pd), layout, *args, **kwargs)

    _d.tilted_kplanes = _bf16_planes
'''


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    argv = sys.argv[1:]
    out_dir = root / "benchmarks" / "results"
    if "--out-dir" in argv:
        i = argv.index("--out-dir")
        out_dir = Path(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    with tempfile.TemporaryDirectory(prefix="fasttomo-bf16-probe-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(HOOK)
        env = dict(os.environ, FASTTOMO_PROBE_BF16_PLANES="1",
                   PYTHONPATH=os.pathsep.join([tmp, str(root / "src"), os.environ.get("PYTHONPATH", "")]))
        rc = subprocess.call([sys.executable, str(root / "scripts" / "bench_quality.py"), *argv,
                              "--out-dir", str(Path(tmp, "records"))], env=env)
        for path in sorted(Path(tmp, "records").glob("bench_quality-*.json")):
            record = json.loads(path.read_text())
            record["command"] = " ".join(["python scripts/probe_bf16_planes.py", *sys.argv[1:]])
            record["probe"] = "every field run sampled its planes rounded to bf16 (gradients straight through)"
            out_dir.mkdir(parents=True, exist_ok=True)
            dest = out_dir / path.name.replace("bench_quality-", "bench_quality-bf16-planes-", 1)
            dest.write_text(json.dumps(record, indent=2) + "\n")
            print(f"wrote {dest}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
