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
