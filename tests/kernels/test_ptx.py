"""What the GPU compiler makes of a kernel whose bits must be the twin's, checked on the CPU: the
rays' samples kernel compiled for sm_90 (Hopper) with its launch's options."""

from __future__ import annotations

import pytest


def _ptx_sm90(kernel, signature: dict, constexprs: dict, options: dict) -> str:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:  # noqa: BLE001 - a Triton without its CUDA backend or ptxas
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {str(e)[:200]}")
    return compiled.asm["ptx"]


def test_the_rays_kernel_rounds_as_the_twin():
    """Every product and sum rounded on its own (no fma: the twin's elementwise kernels round
    each) and the normalization an IEEE division (div.rn, not Triton's approximate fp32 '/')."""
    from fasttomo.kernels.triton.rays import RAY_POINTS_BLOCK, RAY_POINTS_OPTIONS, ray_points_kernel

    sig = {name: "*fp32" for name in ("o_ptr", "d_ptr", "tin_ptr", "dt_ptr", "pts_ptr")}
    sig.update({"hit_ptr": "*i8", "inside_ptr": "*i8", "n": "i32", "S": "i32", "hx": "fp32", "hy": "fp32",
                "hz": "fp32", "bound": "fp32", "BLOCK": "constexpr"})
    ptx = _ptx_sm90(ray_points_kernel, sig, {"BLOCK": RAY_POINTS_BLOCK}, RAY_POINTS_OPTIONS)
    assert "fma.rn.f32" not in ptx
    assert ptx.count("div.rn.f32") > 0 and "div.full" not in ptx and "div.approx" not in ptx
    assert ptx.count("mul.rn.f32") + ptx.count("mul.f32") > 0  # the products are there, each on its own


def test_every_launch_says_whether_it_fuses_multiply_adds():
    """Triton 3.9 warns at a process's first compile that does not say (3.10 stops fusing by
    default): every launch of a run's plan passes ``enable_fp_fusion``, True as the kernels were
    measured, except the rays' samples kernel (False: the twin's roundings); the interpolation's
    forward compiled with its launch's options keeps its fma."""
    import torch

    from fasttomo.kernels.layout import PlaneLayout
    from fasttomo.kernels.triton import ahead
    from fasttomo.kernels.triton import kplanes as kp

    lay = PlaneLayout(2, 8, ((8, 8, 8), (16, 16, 16)))
    jobs = ahead.plan_jobs(lay, 4096, train_out_bf16=True, need_dq=True, need_gm=True, plane_tv=True,
                           volume_tv=((8, 16, 16), False), decoder=(32, 32), rays=(256, 16))
    calls = ahead._collect(torch.device("cpu"), jobs)
    assert len({kernel.__name__ for kernel, *_ in calls}) == 9
    for kernel, _, _, kwargs in calls:
        assert kwargs.get("enable_fp_fusion") is (kernel.__name__ != "ray_points_kernel"), (kernel.__name__, kwargs)
    fwd = next(c for c in calls if c[0] is kp.kplanes_fwd_kernel)
    sig = {"pts_ptr": "*fp32", "mat_ptr": "*fp32", "planes_ptr": "*fp32", "out_ptr": "*fp32"}
    names = fwd[0].arg_names
    sig.update({n: "i32" for n in names[4:len(fwd[2])]})
    constexprs = {n: v for n, v in fwd[3].items() if n in names}
    sig.update({n: "constexpr" for n in constexprs})
    options = {k: v for k, v in fwd[3].items() if k not in names}
    assert "fma.rn.f32" in _ptx_sm90(kp.kplanes_fwd_kernel, sig, constexprs, options)
    assert "fma.rn.f32" not in _ptx_sm90(kp.kplanes_fwd_kernel, sig, constexprs, dict(options, enable_fp_fusion=False))
