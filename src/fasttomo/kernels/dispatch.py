"""The one door to every fused op. Model code calls only these functions.

Each op takes its fast path (a Triton kernel registered as a torch custom op in
``kernels/triton/ops.py``) only when that is valid:

- the backend allows it: ``configure(backend, gpu_decoder)`` is called by the model/trainer
  builder with ``kernels.backend`` (auto | triton | torch) and ``kernels.gpu_decoder`` (cublas |
  fused) from the run's recorded config, after the build-time check (build.py); there is no other
  source (no environment variable);
- Triton imports and the custom ops register (checked once, lazily);
- the tensors are CUDA, fp32, of supported shapes (see each ``_why_not_*``).

On the CPU, ``tilted_kplanes`` has a fast path of its own (``kernels/cpu.py``: the twin's result with
a hand-written backward, path ``'cpu'``), taken under ``backend='auto'`` for float32/float64 inputs of
the layout's shapes outside autocast; ``backend='torch'`` keeps the twin there too. ``plane_tv``
likewise, and ``decoder_mlp`` (the hybrid decoder: native C kernels in ``kernels/cpu_mlp.py`` on
the CPU; on CUDA under bf16 autocast, with ``configure(gpu_decoder='fused')``
(``kernels.gpu_decoder=fused``, the default), fused Triton kernels, ``kernels/triton/mlp.py``, for
widths they hold in registers, and after cuBLAS's first product for wider features; the twin's
cuBLAS GEMMs everywhere else, fp32 among them, where cuBLAS is faster).

Otherwise the pure-torch twin in ``kernels/reference.py`` runs. Under ``backend='triton'`` an input
the fast path cannot take raises ``KernelUnavailableError`` naming the reason. The path taken is
logged once per (op, path, reason) on logger ``fasttomo.kernels`` and counted in ``counters``
(op -> path -> calls; a spy for tests, ``reset_counters()`` clears it; the table lives in
``kernels/counters.py`` so the custom ops count their backward passes without importing this door). Backward passes count as
``'<op>_bwd'``: a ``create_graph=True`` backward runs the twin's formula (path ``'torch'``), so
higher-order autograd is exact. The SIRT projector pair (``ray_project``, ``voxel_backproject``)
and the rays' samples (``ray_samples``) have forward-only fast paths: a call that needs a gradient
(grad mode on and an input requiring it) runs the twin.

Under bf16 autocast (CUDA) the fused interpolation writes bf16 features (fp32 planes and fp32
accumulation inside); the twin keeps fp32 (grid_sample runs in fp32 under autocast). The fused
decoder writes an fp32 output where the twin's (autocast's last Linear) is bf16.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from fasttomo.kernels import counters as _spy
from fasttomo.kernels import cpu as _cpu
from fasttomo.kernels import cpu_mlp as _cpu_mlp
from fasttomo.kernels import reference
from fasttomo.kernels.layout import PlaneLayout

log = logging.getLogger("fasttomo.kernels")

BACKENDS = ("auto", "triton", "torch")
INSTALL_HINT = ("Triton comes with the CUDA builds of torch on Linux (pip install torch); on its own: "
                "pip install triton")

_state = {"backend": "auto", "gpu_decoder": "cublas", "step_fusion": False}
GPU_DECODERS = ("cublas", "fused")
counters = _spy.counters  # the spy's table (kernels/counters.py), same dict object
_logged: set = set()
_ops_module = None
_ahead = {"started": False}  # compile_ahead started a pool the first fast launch waits for
_ops_error: Optional[str] = None
_INT32_MAX = 2**31 - 1


class KernelUnavailableError(RuntimeError):
    """kernels.backend=triton was asked for but the fast path cannot take this input."""


def configure(backend: str = "auto", gpu_decoder: str = "cublas", step_fusion: bool = False) -> str:
    """Set the kernel backend, the GPU decoder and the step's fusions (call when building the
    model/trainer, with ``kernels.backend``, ``kernels.gpu_decoder`` and ``kernels.step_fusion`` of
    the run's config, whose decoder default is ``fused``; this function's own default, ``cublas``,
    is for code that calls the door outside a run, such as the kernel benchmarks). Returns the
    backend in force."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels.backend must be one of {list(BACKENDS)}, got {backend!r}.")
    if gpu_decoder not in GPU_DECODERS:
        raise ValueError(f"kernels.gpu_decoder must be one of {list(GPU_DECODERS)}, got {gpu_decoder!r}.")
    _state["backend"] = backend
    _state["gpu_decoder"] = gpu_decoder
    _state["step_fusion"] = bool(step_fusion)
    _logged.clear()
    if backend == "triton" and _load_ops() is None:
        raise KernelUnavailableError(
            f"kernels.backend=triton but the Triton kernels cannot load ({_ops_error}). "
            f"{INSTALL_HINT}; or set kernels.backend=auto to run the pure-torch twins.")
    log.info("kernels: backend=%s, gpu_decoder=%s, step_fusion=%s", backend, gpu_decoder, bool(step_fusion))
    return backend


def backend() -> str:
    return _state["backend"]


def reset_counters() -> None:
    _spy.reset()


def _count(op: str, path: str) -> None:
    _spy.count(op, path)


def _load_ops():
    global _ops_module, _ops_error
    if _ops_module is None and _ops_error is None:
        try:
            from fasttomo.kernels.triton import ops as m  # imports triton, registers custom ops
            _ops_module = m
        except Exception as e:  # noqa: BLE001 - any import failure means "no fast path"
            _ops_error = f"{type(e).__name__}: {e}"
    return _ops_module


def _common_reason(tensors) -> Optional[str]:
    if _state["backend"] == "torch":
        return "kernels.backend=torch"
    for t in tensors:
        if not t.is_cuda:
            return f"tensor on {t.device.type}, fast path needs CUDA"
        if t.dtype != torch.float32:
            return f"dtype {t.dtype}, fast path needs float32"
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        return "tensors on different devices"
    if _load_ops() is None:  # imported lazily: CPU-only runs never import triton
        return f"triton unavailable ({_ops_error})"
    return None


def _route(op: str, reason: Optional[str]) -> bool:
    """Decide, count and log once. True: take the fast path."""
    if reason is not None and _state["backend"] == "triton":
        raise KernelUnavailableError(
            f"{op}: kernels.backend=triton but the fast path cannot take this input: {reason}. "
            f"Fix the input or set kernels.backend=auto to fall back to the pure-torch twin.")
    _note(op, "triton" if reason is None else "torch", reason)
    if reason is None:
        _wait_ahead()
    return reason is None


def _wait_ahead() -> None:
    """Before a fused launch: join the compile-ahead pool if one runs (its kernels are in Triton's
    caches from here on)."""
    if _ahead["started"]:
        _ahead["started"] = False
        from fasttomo.kernels.triton import ahead

        ahead.wait()


def _note(op: str, path: str, reason: Optional[str]) -> None:
    """Count the path taken and log it once per (op, path, reason)."""
    if not torch.compiler.is_compiling():
        _count(op, path)
        key = (op, path, reason)
        if key not in _logged:
            _logged.add(key)
            log.info("kernels: %s -> %s%s", op, path, "" if reason is None else f" ({reason})")


def _why_not_kplanes(points, matrices, plane_data, layout: PlaneLayout) -> Optional[str]:
    r = _common_reason((points, matrices, plane_data))
    if r:
        return r
    T, C = layout.n_rot, layout.channels
    if points.dim() != 2 or points.shape[1] != 3:
        return f"points shape {tuple(points.shape)}, fast path needs (N, 3)"
    if tuple(matrices.shape) != (T, 3, 3):
        return f"matrices shape {tuple(matrices.shape)}, fast path needs ({T}, 3, 3)"
    if plane_data.dim() != 1 or plane_data.numel() != layout.numel or not plane_data.is_contiguous():
        return f"plane_data must be a contiguous 1-D buffer of {layout.numel} elements"
    if layout.numel > _INT32_MAX:
        return "plane buffer larger than 2**31 elements"
    if points.shape[0] * 3 > 2**62:
        return "too many points"
    return None


def _why_not_cpu_kplanes(points, matrices, plane_data, layout: PlaneLayout) -> Optional[str]:
    """None when the CPU fast path (kernels/cpu.py) can take the input."""
    if _state["backend"] != "auto":
        return f"kernels.backend={_state['backend']}"
    if any(t.device.type != "cpu" for t in (points, matrices, plane_data)):
        return "not all tensors on the CPU"
    if points.dtype not in (torch.float32, torch.float64) or any(
            t.dtype != points.dtype for t in (matrices, plane_data)):
        return f"dtypes {points.dtype}/{matrices.dtype}/{plane_data.dtype}, CPU path needs one of float32, float64"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast on"
    T = layout.n_rot
    if points.dim() != 2 or points.shape[1] != 3 or tuple(matrices.shape) != (T, 3, 3):
        return f"points {tuple(points.shape)}, matrices {tuple(matrices.shape)}; CPU path needs (N, 3), ({T}, 3, 3)"
    if plane_data.dim() != 1 or plane_data.numel() != layout.numel or not plane_data.is_contiguous():
        return f"plane_data must be a contiguous 1-D buffer of {layout.numel} elements"
    return None


def tilted_kplanes(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor,
                   layout: PlaneLayout, planes_bf16: bool = False) -> torch.Tensor:
    """Features of ``points`` (op 1). ``planes_bf16`` (precision.planes=bf16): sample the planes'
    values rounded to bf16 (the fused kernels read a bf16 copy; the CPU path and the twin the
    rounded values, ``reference.bf16_planes``); gradients reach ``plane_data`` in its dtype."""
    reason = _why_not_kplanes(points, matrices, plane_data, layout)
    if reason is not None and _why_not_cpu_kplanes(points, matrices, plane_data, layout) is None:
        _note("tilted_kplanes", "cpu", None)
        return _cpu.tilted_kplanes(points, matrices, reference.bf16_planes(plane_data) if planes_bf16 else plane_data,
                                   layout)
    if _route("tilted_kplanes", reason):
        out_bf16 = (torch.is_autocast_enabled("cuda")
                    and torch.get_autocast_dtype("cuda") == torch.bfloat16)
        return torch.ops.fasttomo.tilted_kplanes(points.contiguous(), matrices.contiguous(),
                                                 plane_data, layout.n_rot, layout.channels,
                                                 layout.flat_resolutions, out_bf16, planes_bf16)
    return reference.tilted_kplanes(points, matrices, reference.bf16_planes(plane_data) if planes_bf16 else plane_data,
                                    layout)


def tilted_kplanes_tv(points: torch.Tensor, matrices: torch.Tensor, plane_data: torch.Tensor,
                      layout: PlaneLayout, planes_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(``tilted_kplanes``, ``plane_tv``) of the same planes: a training step's features and plane
    TV. On the fast path one op, whose backward writes the plane TV's gradient and adds the
    interpolation's to it in place (no zeroed buffer, no second plane-sized gradient for autograd
    to add) when ``configure(step_fusion=True)``; elsewhere, and for calls that need no plane
    gradient, the two ops."""
    reason = _why_not_kplanes(points, matrices, plane_data, layout)
    if reason is None and not _state["step_fusion"]:
        reason = "kernels.step_fusion=false"
    if reason is None and not (torch.is_grad_enabled() and plane_data.requires_grad):
        reason = "no plane gradient wanted"
    if reason is not None:
        return tilted_kplanes(points, matrices, plane_data, layout, planes_bf16), plane_tv(plane_data, layout)
    _route("tilted_kplanes", None)
    _route("plane_tv", None)
    out_bf16 = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    return torch.ops.fasttomo.tilted_kplanes_tv(points.contiguous(), matrices.contiguous(), plane_data, layout.n_rot,
                                                layout.channels, layout.flat_resolutions, out_bf16, planes_bf16)


def _why_not_cpu_plane_tv(plane_data: torch.Tensor, layout: PlaneLayout) -> Optional[str]:
    """None when the CPU path of plane TV (kernels/cpu.py) can take the input."""
    if _state["backend"] != "auto":
        return f"kernels.backend={_state['backend']}"
    if plane_data.device.type != "cpu" or plane_data.dtype not in (torch.float32, torch.float64):
        return f"{plane_data.device.type} {plane_data.dtype}; CPU path needs a CPU float32/float64 buffer"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast on"
    if plane_data.dim() != 1 or plane_data.numel() != layout.numel or not plane_data.is_contiguous():
        return f"plane_data must be a contiguous 1-D buffer of {layout.numel} elements"
    return None


def plane_tv(plane_data: torch.Tensor, layout: PlaneLayout) -> torch.Tensor:
    r = _common_reason((plane_data,))
    if r is None and (plane_data.dim() != 1 or plane_data.numel() != layout.numel
                      or not plane_data.is_contiguous()):
        r = f"plane_data must be a contiguous 1-D buffer of {layout.numel} elements"
    if r is None and layout.numel > _INT32_MAX:
        r = "plane buffer larger than 2**31 elements"
    if r is not None and _why_not_cpu_plane_tv(plane_data, layout) is None:
        _note("plane_tv", "cpu", None)
        return _cpu.plane_tv(plane_data, layout)
    if _route("plane_tv", r):
        return torch.ops.fasttomo.plane_tv(plane_data, layout.n_rot, layout.channels,
                                           layout.flat_resolutions)
    return reference.plane_tv(plane_data, layout)


def _why_not_native_mlp(device: torch.device, dtype: torch.dtype, features: int | None = None,
                        hidden: int | None = None) -> Optional[str]:
    """None when the native CPU decoder (kernels/cpu_mlp.py) takes inputs on ``device`` of ``dtype``
    (and, given the widths, has its kernels: built on first use)."""
    if _state["backend"] != "auto":
        return f"kernels.backend={_state['backend']}"
    if device.type != "cpu":
        return f"tensors on {device.type}, the native decoder is the CPU's"
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype}, CPU path needs float32 or float64"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast on"
    if features is None:
        return None
    if features > _cpu_mlp.MAX_FEATURES or hidden > _cpu_mlp.MAX_HIDDEN:
        return (f"a decoder of {features} features and {hidden} hidden units is wider than the native "
                f"kernels take ({_cpu_mlp.MAX_FEATURES}, {_cpu_mlp.MAX_HIDDEN})")
    if _cpu_mlp.library(dtype, features, hidden) is None:
        return "the native CPU kernels could not be built (see the log)"
    return None


def _why_not_cpu_mlp(x: torch.Tensor, params) -> Optional[str]:
    """None when the CPU path of the decoder can take these tensors."""
    reason = _why_not_native_mlp(x.device, x.dtype) or _cpu_mlp.unsupported(x, params)
    if reason is not None:
        return reason
    return _why_not_native_mlp(x.device, x.dtype, x.shape[1], params[0].shape[0])


def decoder_mlp_native(device: torch.device, dtype: torch.dtype, features: int, hidden: int) -> bool:
    """Whether ``decoder_mlp`` takes its native CPU path for inputs on ``device`` of ``dtype`` and
    these widths, outside autocast."""
    return _why_not_native_mlp(device, dtype, features, hidden) is None


def fused_mlp_fits(features: int, hidden: int) -> bool:
    """Whether a hybrid decoder of these widths is one the fused GPU kernels take whole
    (``kernels/triton/mlp.py``: F up to 64, H 16, 32 or 64)."""
    return 1 <= features <= _FUSED_MLP_FEATURES and hidden in _FUSED_MLP_HIDDEN


def fused_mlp_widths(features: int, hidden: int) -> Optional[tuple]:
    """(F, H) of the fused GPU kernels' launches for a hybrid decoder of these widths: its own
    where they take it whole; (H, H) for a wider first layer (F above 64), which cuBLAS computes
    (x W1^T, without the bias) before the kernels take the rest through an identity first layer
    (``decoder_mlp``); None where H is not one of theirs."""
    if fused_mlp_fits(features, hidden):
        return (features, hidden)
    return (hidden, hidden) if features > _FUSED_MLP_FEATURES and hidden in _FUSED_MLP_HIDDEN else None


_FUSED_MLP_FEATURES, _FUSED_MLP_HIDDEN = 64, (16, 32, 64)  # kernels/triton/mlp.py's MAX_FEATURES, HIDDEN


def _why_not_fused_mlp(x: torch.Tensor, params) -> Optional[str]:
    """None when the fused GPU decoder takes these tensors: CUDA, bf16 autocast (in fp32 cuBLAS runs
    the twin faster, docs/kernels.md; fp16 has no fused kernels), fp32 weights, (N, F) bf16 or
    fp32 features of widths ``fused_mlp_fits``."""
    if _state["backend"] == "torch":
        return "kernels.backend=torch"
    if _state["gpu_decoder"] != "fused":
        return f"kernels.gpu_decoder={_state['gpu_decoder']}"
    if not x.is_cuda:
        return f"tensor on {x.device.type}, fast path needs CUDA"
    if not (torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16):
        return "no bf16 autocast (the fused decoder is bf16's; cuBLAS runs fp32 faster)"
    if any(not isinstance(p, torch.Tensor) or p.device != x.device or p.dtype != torch.float32 for p in params):
        return "weights and biases not all float32 tensors on the features' device"
    w1 = params[0]
    H, F_in = w1.shape if w1.dim() == 2 else (0, 0)
    if [tuple(p.shape) for p in params] != [(H, F_in), (H,), (H, H), (H,), (1, H), (1,)]:
        return f"weights of shapes {[tuple(p.shape) for p in params]}, not a Linear-ReLU-Linear-ReLU-Linear(1)'s"
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or x.shape[1] != F_in:
        return f"features {tuple(x.shape)} {x.dtype}, fast path needs (N, {F_in}) bf16 or float32"
    if fused_mlp_widths(F_in, H) is None:
        return (f"a decoder of {F_in} features and {H} hidden units: the fused kernels take "
                f"{list(_FUSED_MLP_HIDDEN)} hidden units")
    if not 0 < x.shape[0] < _INT32_MAX:
        return f"{x.shape[0]} points"
    if _load_ops() is None:
        return f"triton unavailable ({_ops_error})"
    return None


def decoder_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                w3: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    """The hybrid decoder (Linear-ReLU-Linear-ReLU-Linear; semantics: ``reference.decoder_mlp``):
    the native CPU kernels (path 'cpu') for CPU float32/float64 inputs under ``backend=auto``
    outside autocast; the fused Triton kernels (path 'triton') under CUDA bf16 autocast with
    ``gpu_decoder='fused'`` where ``_why_not_fused_mlp`` allows (their output is fp32, the twin's
    bf16; features wider than the kernels hold go through cuBLAS's x W1^T first, ``fused_mlp_widths``);
    the twin elsewhere (cuBLAS GEMMs, path 'torch'). Under ``backend=triton`` the decoder
    never raises: where the fused kernels do not apply (not chosen, fp32 or fp16, other widths)
    cuBLAS runs it."""
    params = (w1, b1, w2, b2, w3, b3)
    reason = _why_not_cpu_mlp(x, params)
    if reason is None:
        _note("decoder_mlp", "cpu", None)
        return _cpu_mlp.decoder_mlp(x, *params, native=True)
    if x.is_cuda:  # (on the CPU the log keeps the native path's reason)
        reason = _why_not_fused_mlp(x, params)
    if reason is None:
        _note("decoder_mlp", "triton", None)
        _wait_ahead()
        return _fused_decoder(x, params, True)
    _note("decoder_mlp", "torch", reason)
    return reference.decoder_mlp(x, *params)


def _fused_decoder(x: torch.Tensor, params: tuple, bf16: bool) -> torch.Tensor:
    """The fused decoder's op on ``x``; features wider than its kernels hold have their first
    product (x W1^T, the bias left to the kernels) done by cuBLAS (autocast's dtype), which the
    kernels take through an identity first layer (exact: one product of 1 a sum)."""
    if x.shape[1] <= _FUSED_MLP_FEATURES:
        return torch.ops.fasttomo.decoder_mlp(x, *params, bf16)
    w1 = params[0]
    u = torch.nn.functional.linear(x, w1)
    return torch.ops.fasttomo.decoder_mlp(u, _identity(w1.shape[0], x.device), *params[1:], bf16)


_IDENTITIES: dict = {}


def _identity(n: int, device: torch.device) -> torch.Tensor:
    """An (n, n) fp32 identity on ``device``, made once (so a captured step's replays read the
    tensor its capture did): the fused decoder's first layer where cuBLAS has done its product."""
    key = (n, str(device))
    if key not in _IDENTITIES:
        _IDENTITIES[key] = torch.eye(n, device=device, dtype=torch.float32)
    return _IDENTITIES[key]


def volume_tv(volume: torch.Tensor, kind: str = "squared") -> torch.Tensor:
    if kind not in ("squared", "l1"):
        raise ValueError(f"volume_tv: kind must be 'squared' or 'l1', got {kind!r}")
    r = _common_reason((volume,))
    if r is None and (volume.dim() < 3 or min(volume.shape[-3:]) < 2 or volume.numel() == 0):
        r = f"volume shape {tuple(volume.shape)}, fast path needs (..., D, H, W) with D, H, W >= 2"
    if r is None and volume.numel() > _INT32_MAX // 2:
        r = "volume larger than 2**30 elements"
    if _route("volume_tv", r):
        return torch.ops.fasttomo.volume_tv(volume.contiguous(), kind == "l1")
    return reference.volume_tv(volume, kind)


def compile_ahead(field, points_per_step: int, *, out_bf16: bool, need_dq: bool, plane_tv: bool,
                  volume_tv: tuple | None = None, rays: tuple | None = None) -> int:
    """Start compiling, in background threads, the fused kernels a K-Planes ``field``'s run will
    launch (``kernels/triton/ahead.py``): training calls of ``points_per_step`` points (bf16
    features, and the fused decoder if chosen, when ``out_bf16``; dL/dq when ``need_dq``; the
    frames' gradient when they learn), no-grad calls, the plane TV when ``plane_tv`` and, given
    ``volume_tv`` = ((D, H, W), l1), the volume TV and, given ``rays`` = (rays a step, samples a
    ray), the rays' samples. The first fused launch waits for them. Returns the number of kernels being
    compiled: 0 when the fast path is not taken (a CPU field, ``kernels.backend=torch``, no
    Triton) or the field has no plane layout."""
    layout, planes = getattr(field, "layout", None), getattr(field, "plane_data", None)
    if not isinstance(layout, PlaneLayout) or planes is None or _common_reason((planes,)) is not None:
        return 0
    from fasttomo.kernels.triton import ahead

    rot = getattr(field, "rot_params", None)
    jobs = ahead.plan_jobs(layout, int(points_per_step), train_out_bf16=out_bf16, need_dq=need_dq,
                           need_gm=rot is not None and rot.requires_grad, plane_tv=plane_tv, volume_tv=volume_tv,
                           planes_bf16=bool(getattr(field, "planes_bf16", False)),
                           decoder=_fused_decoder_widths(field) if out_bf16 else None,
                           rays=rays if _state["step_fusion"] else None)
    started = ahead.start(planes.device, jobs, ahead.kernels())
    _ahead["started"] = _ahead["started"] or started > 0
    return started


def _fused_decoder_widths(field) -> tuple | None:
    """(F, H) of a field's hybrid decoder when the fused kernels take it under bf16 autocast."""
    decoder = getattr(field, "decoder", None)
    if getattr(decoder, "kind", None) != "hybrid" or _state["backend"] == "torch" or _state["gpu_decoder"] != "fused":
        return None
    w1 = decoder.net[0].weight
    return fused_mlp_widths(w1.shape[1], w1.shape[0])


def compile_ahead_summary() -> dict | None:
    """The last compile-ahead pool's kernels, seconds and the main thread's wait (the run's
    timeline), or None."""
    if _ops_module is None:
        return None
    from fasttomo.kernels.triton import ahead

    return ahead.summary()


# ------------------------------------------------------------------------- SIRT projector pair
def _why_not_tomo(data: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor) -> Optional[str]:
    r = _common_reason((data, rot, shift))
    if r:
        return r
    if torch.is_grad_enabled() and any(t.requires_grad for t in (data, rot, shift)):
        return "an input requires grad and the fast path is forward-only"
    if data.dim() != 3 or rot.dim() != 3 or tuple(rot.shape[1:]) != (3, 3) or tuple(shift.shape) != (rot.shape[0], 2):
        return (f"shapes {tuple(data.shape)}, rot {tuple(rot.shape)}, shift {tuple(shift.shape)}; "
                "fast path needs a 3-D array, rot (V, 3, 3), shift (V, 2)")
    return None  # above 2**31 elements the kernels take int64 offsets (triton/tomo.py: needs_int64)


def ray_project(volume: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor,
                image_hw: tuple[int, int], step: float) -> torch.Tensor:
    """Line integrals (V, H, W) of a (Z, Y, X) volume along every pixel's ray of V views
    (semantics: ``reference.ray_project``). Forward-only fast path."""
    h, w = int(image_hw[0]), int(image_hw[1])
    if _route("ray_project", _why_not_tomo(volume, rot, shift)):
        return torch.ops.fasttomo.ray_project(volume.contiguous(), rot.contiguous(),
                                              shift.contiguous(), h, w, float(step))
    return reference.ray_project(volume, rot, shift, (h, w), step)


def voxel_backproject(images: torch.Tensor, rot: torch.Tensor, shift: torch.Tensor,
                      shape_zyx: tuple[int, int, int]) -> torch.Tensor:
    """Voxel-driven backprojection (Z, Y, X) of images (V, H, W) (semantics:
    ``reference.voxel_backproject``). Forward-only fast path."""
    z, y, x = (int(s) for s in shape_zyx)
    if _route("voxel_backproject", _why_not_tomo(images, rot, shift)):
        return torch.ops.fasttomo.voxel_backproject(images.contiguous(), rot.contiguous(),
                                                    shift.contiguous(), z, y, x)
    return reference.voxel_backproject(images, rot, shift, (z, y, x))


# ------------------------------------------------------------------------- the rays' samples
def ray_samples(segments, box, n_samples: int):
    """The midpoint samples (``geometry.rays.RaySamples``) of ``segments``
    (``geometry.rays.ray_segments`` of a batch's rays): one fused kernel on CUDA, the same bits as
    the twin (``geometry.rays.segment_samples``), when ``configure(step_fusion=True)``.
    Forward-only: while the chords need a gradient (the poses learn) the twin runs, under every
    backend."""
    from fasttomo.geometry.rays import INSIDE_TOL, RaySamples, segment_samples

    seg = segments
    tensors = (seg.origin, seg.direction, seg.t_in, seg.dt)
    why = None if _state["step_fusion"] else "kernels.step_fusion=false"
    if why is None and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        why = "the rays need a gradient (learned poses)"
    if why is not None:
        _note("ray_points", "torch", why)
        return segment_samples(seg, box, n_samples)
    r = _common_reason(tensors)
    if r is None and 3 * seg.origin.shape[0] * int(n_samples) > _INT32_MAX:
        r = "more than 2**31 coordinates in one batch"
    if _route("ray_points", r):
        points, inside = torch.ops.fasttomo.ray_points(seg.origin, seg.direction, seg.t_in, seg.dt, seg.hit,
                                                       list(box.half_extent), int(n_samples), 1.0 + INSIDE_TOL)
        return RaySamples(points=points, dt=seg.dt, inside=inside)
    return segment_samples(seg, box, n_samples)
