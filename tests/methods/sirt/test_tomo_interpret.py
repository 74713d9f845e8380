"""The SIRT projector kernels (kernels/triton/tomo.py) on the CPU through Triton's interpreter
(TRITON_INTERPRET=1), tiny inputs, against the pure-torch twins.

As in tests/kernels/test_kernels_interpret.py, the checks run in ONE child process (this file
executed as a script, with TRITON_INTERPRET set before triton is imported) and pytest
parametrizes over their results. opcheck belongs to the GPU suite (the interpreter touches data
pointers, which fake tensors do not have).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
TOL = 2e-5


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _poses(angles, z1, z3, shifts):
    import torch

    from fasttomo.geometry.so3 import rot_y, rot_z
    th = torch.tensor(angles, dtype=torch.float32).deg2rad()
    R = rot_z(torch.tensor(z3, dtype=torch.float32)) @ rot_y(th) @ rot_z(torch.tensor(z1, dtype=torch.float32))
    return R.contiguous(), torch.tensor(shifts, dtype=torch.float32).reshape(-1, 2)


def _checks():
    import numpy as np
    import torch

    from fasttomo.kernels import dispatch, reference
    from fasttomo.kernels.triton import ops  # noqa: F401  (registers torch.ops.fasttomo.*)
    from fasttomo.kernels.triton import tomo

    torch.manual_seed(0)
    out = {}
    # (name, volume (Z, Y, X), image (H, W), angles, z1, z3, shifts, step, block (v, u), bp block)
    # The interpreter pays per operation, not per lane: blocks are large (few programs) except
    # where a case checks partial tiles.
    cases = [
        ("pure_tilt_aligned", (6, 7, 9), (7, 9), [-60.0, 0.0, 35.0], [0, 0, 0], [0, 0, 0], [0] * 6, 1.0, (8, 16), 128),
        ("inplane_shifts_misses", (5, 6, 7), (8, 10), [-50.0, 10.0, 40.0], [0.3, -0.5, 0.2], [-0.4, 0.1, 0.6],
         [1.5, -2.0, 0.3, 4.5, -3.0, 0.7], 0.61, (8, 8), 64),
        ("flat_y1_slice", (8, 1, 9), (1, 9), [-45.0, 0.0, 30.0, 60.0], [0] * 4, [0] * 4, [0.2, 0, 0, 0, -0.6, 0, 0, 0], 0.8, (1, 16), 32),
        ("single_z_and_odd_blocks", (1, 4, 5), (3, 6), [-20.0, 70.0], [0.1, 0.0], [0.0, -0.2], [0, 0.5, -0.5, 0], 1.0, (2, 4), 64),
    ]
    for name, (Z, Y, X), (H, W), ang, z1, z3, sh, step, (bv, bu), bpb in cases:
        R, s = _poses(ang, z1, z3, sh)
        vol = torch.rand(Z, Y, X)
        img = torch.rand(len(ang), H, W)
        ref_f = reference.ray_project(vol, R, s, (H, W), step)
        got_f = tomo.ray_project(vol, R, s, H, W, step, block_v=bv, block_u=bu, warps=1)
        ref_b = reference.voxel_backproject(img, R, s, (Z, Y, X))
        got_b = tomo.voxel_backproject(img, R, s, Z, Y, X, block=bpb, warps=1)
        errs = {"ray_project": _rel(got_f, ref_f), "voxel_backproject": _rel(got_b, ref_b)}
        ok = bool(torch.isfinite(got_f).all() and torch.isfinite(got_b).all())
        if name == "single_z_and_odd_blocks":  # the registered ops (default blocks) once
            op_f = torch.ops.fasttomo.ray_project(vol, R, s, H, W, step)
            op_b = torch.ops.fasttomo.voxel_backproject(img, R, s, Z, Y, X)
            errs.update(ray_project_op=_rel(op_f, ref_f), voxel_backproject_op=_rel(op_b, ref_b))
            ok &= tuple(op_f.shape) == (len(ang), H, W) and tuple(op_b.shape) == (Z, Y, X)
        ok &= max(errs.values()) < TOL
        if name == "inplane_shifts_misses":  # the case must contain rays that miss the box
            ok &= bool((ref_f == 0).any()) and bool((got_f[ref_f == 0] == 0).all())
        out[f"tomo[{name}]"] = {"ok": bool(ok), "errors": errs}

    # SIRT through the fused ops (the dispatch functions pointed at them) against the twins
    from fasttomo.methods.sirt import sirt
    from fasttomo.data import phantom as P
    from fasttomo.geometry.poses import Poses
    from fasttomo.geometry.rays import Box

    ph = P.Phantom((6, 8, 10), [P.Ellipsoid((0, 0, 0), (3.5, 2.5, 1.8), (20, 0, 0), 0.5),
                                P.Ellipsoid((1.5, -1, 0.5), (1.2, 1.2, 1.0), None, 1.0)])
    angles = np.linspace(-60, 60, 5)
    stack = torch.from_numpy(P.project(ph, angles))
    poses = Poses(angles, 2, learn_rotations=True, learn_shifts=True)
    with torch.no_grad():
        poses.z1.copy_(torch.tensor([0.2, -0.1, 0.0, 0.3, -0.2]))
        poses.shifts.copy_(torch.tensor([[0.4, -0.3], [0.0, 0.2], [0, 0], [-0.5, 0.1], [0.3, 0.3]]))
    box = Box(ph.shape_zyx)
    x_twin = sirt(stack, poses, box, 2, step=1.0)
    dispatch.ray_project = lambda v, r, s, hw, step: tomo.ray_project(v, r, s, hw[0], hw[1], step,
                                                                      block_v=8, block_u=16)
    dispatch.voxel_backproject = lambda i, r, s, shp: tomo.voxel_backproject(i, r, s, *shp, block=512)
    x_fused = sirt(stack, poses, box, 2, step=1.0)
    out["tomo[sirt_2_iterations]"] = {"ok": bool(_rel(x_fused, x_twin) < 1e-5 and float(x_twin.norm()) > 0),
                                      "errors": {"volume": _rel(x_fused, x_twin)}}
    return out


NAMES = [f"tomo[{n}]" for n in ("pure_tilt_aligned", "inplane_shifts_misses", "flat_y1_slice",
                                "single_z_and_odd_blocks", "sirt_2_iterations")]


@pytest.fixture(scope="module")
def interp_results():
    from cli_helpers import run_interpreted  # tests/ is on sys.path under pytest (not when run as a script)

    return run_interpreted(HERE, omp_threads=1)


@pytest.mark.parametrize("name", NAMES)
def test_interpreted_tomo_kernel_matches_twin(interp_results, name):
    assert name in interp_results, f"check {name} did not run; got {sorted(interp_results)}"
    r = interp_results[name]
    assert r["ok"], f"{name}: relative errors {r['errors']}"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through pytest (it sets TRITON_INTERPRET=1)"
    print("RESULTS " + json.dumps(_checks()), flush=True)
