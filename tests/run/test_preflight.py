"""The dry run and the checks before training (run/preflight.py): data without signal is refused
in the dry run as in a run; the memory estimate matches what a CPU run really uses."""

from __future__ import annotations

import mrcfile
import numpy as np
from cli_helpers import TINY_RUN, cli


def test_the_dry_run_refuses_an_all_zero_stack_with_one_line(tmp_path):
    stack = tmp_path / "zeros.mrc"
    with mrcfile.new(stack) as m:
        m.set_data(np.zeros((8, 20, 24), dtype=np.float32))
        m.voxel_size = 10.0
    angles = tmp_path / "zeros.tlt"
    angles.write_text("\n".join(str(a) for a in np.linspace(-60, 60, 8)) + "\n")
    res = cli([*TINY_RUN, "data=mrc", f"data.path={stack}", f"data.angles={angles}", "dry_run=true"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    errors = [ln for ln in text.splitlines() if "[ERROR]" in ln]
    assert "Traceback" not in text and len(errors) == 1, text
    assert "every pixel of the stack holds the value 0; a constant stack carries no signal" in errors[0]
    assert "config and data are valid" not in text and not (tmp_path / "outputs").exists()
