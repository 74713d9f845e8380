"""Compile a run's fused kernels before its first step, several at a time.

With an empty Triton cache every kernel is compiled at its first launch, one after another on the
main thread: the embedded default run's first step took 7.5 s on an H200 against 0.6 s with a warm
cache. ``start(device, jobs)`` runs what the run will launch ahead: each job calls a launcher
itself (``kplanes_forward``, ``plane_tv_backward`` ...) on meta tensors of the run's shapes while
``launch`` collects instead of launching (milliseconds, in the calling thread), so each kernel is
planned with the arguments and flags the run's own launch will pass (a meta tensor's address, 0,
is aligned like torch's CUDA allocations). The distinct launches are then compiled
(``JITFunction.warmup``) one per task in a pool of threads while the main thread finishes the
build: Triton's compiler releases the GIL in its MLIR and LLVM passes and runs ptxas as a
subprocess. The kernels land in Triton's in-memory and on-disk caches; a launch whose
specialization was not foreseen compiles at its first use, as without this module.

Each task also builds its kernel's C launcher, which Triton otherwise builds with the host's C
compiler at the kernel's first launch. The door (``dispatch``) calls ``wait()`` before its first
fused launch; failures in the pool are ignored (the launch compiles and reports them itself).
``plan_jobs`` says what a field run needs.

With a warm cache the pool only loads, yet its threads hold the GIL long enough to slow the build
beside them (the embedded default on an H200: 2.9-3.2 s from the run's start to training's
against 1.0 s without the pool). So a pool that compiled every launch of a plan leaves a marker
in Triton's cache folder, named by the plan (each kernel's source hash and specialization, the
device, Triton's version); a later run with the same plan finds it and starts no pool: its
kernels load at their first launch, as before this module (0.6 s for the first step). A marker
whose kernels were removed since costs that run their compilation at first use, nothing else.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from fasttomo.kernels.triton import kplanes as kp
from fasttomo.kernels.triton import mlp
from fasttomo.kernels.triton import rays as rp
from fasttomo.kernels.triton import tv
from fasttomo.kernels.triton.key import cache_folder
from fasttomo.kernels.triton.launch import COMPILE_ONLY

log = logging.getLogger("fasttomo.kernels")

MAX_THREADS = 8
"""Compile threads at most (also at most the CPUs this process may use, less one)."""

_pending: dict = {"pool": None, "futures": [], "t0": 0.0, "done_s": None, "waited_s": None, "kernels": 0,
                  "failed": [], "marker": None, "cached": False}
_lock = threading.Lock()


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A stand-in tensor for a compile-only job: shape and dtype, no memory."""
    return torch.empty(shape, dtype=dtype, device="meta")


class _Collector:
    """The launches a plan's launchers make, one per specialization class (Triton's: the dtype of
    each tensor, whether each integer is 1 or divisible by 16, the constexprs and options)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.calls: dict = {}

    def add(self, kernel, grid, args, kwargs) -> None:
        def cls(a):
            if isinstance(a, torch.Tensor):
                return str(a.dtype)
            if isinstance(a, bool) or not isinstance(a, int):
                return type(a).__name__
            return ("1" if a == 1 else "D" if a % 16 == 0 else "")
        key = (kernel, tuple(cls(a) for a in args), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        self.calls.setdefault(key, (kernel, grid, args, kwargs))


def _collect(device: torch.device, jobs: list, classes: list | None = None) -> list:
    """Run the plan's launchers on meta tensors in compile-only mode (milliseconds); their launches
    (and, into ``classes``, each one's (kernel, specialization class))."""
    collector = _Collector(device)
    token = COMPILE_ONLY.set(collector)
    try:
        for job in jobs:
            try:
                job()
            except Exception as exc:  # noqa: BLE001  (that launch compiles at its first use instead)
                log.debug("kernels: planning %s failed: %s: %s", getattr(job, "__name__", job), type(exc).__name__, exc)
    finally:
        COMPILE_ONLY.reset(token)
    if classes is not None:
        classes.extend((key[0], key[1:]) for key in collector.calls)
    return list(collector.calls.values())


def _compile(device: torch.device, call) -> tuple[float, str | None]:
    """(when it ended, None when it compiled, else what failed: the kernel, the error)."""
    kernel, grid, args, kwargs = call
    try:
        with torch.cuda.device(device):
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
    except Exception as exc:  # noqa: BLE001  (the launch compiles it again and reports a real problem)
        why = f"{getattr(kernel, '__name__', kernel)}: {type(exc).__name__}: {str(exc)[:300]}"
        log.debug("kernels: compiling %s ahead failed", why)
        return time.perf_counter(), why
    _build_launcher(compiled)
    return time.perf_counter(), None


def _build_launcher(compiled) -> None:
    """Build the C launcher of a compiled kernel into Triton's cache (Triton 3.x builds it with the
    host's C compiler at the kernel's first launch, 0.1-0.3 s each, on the launching thread; a
    later build of the same source loads the cached library). Nothing is kept: the first launch
    makes its own launcher object from the cache. Best effort: another Triton's layout is left
    to its first launch."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception as exc:  # noqa: BLE001
        log.debug("kernels: building the launcher of %s ahead failed: %s: %s", getattr(compiled, "name", compiled),
                  type(exc).__name__, exc)


def plan_marker(device: torch.device, classes) -> str | None:
    """The path of the marker a complete pool leaves for a plan: ``classes`` are its launches'
    specialization classes ((kernel, class) pairs), keyed with each kernel's source hash, the
    device's name and capability and Triton's version, in Triton's cache folder. None where one of
    them cannot be read (then the pool always runs)."""
    try:
        import triton

        folder = cache_folder()
        parts = [triton.__version__, torch.cuda.get_device_name(device), str(torch.cuda.get_device_capability(device))]
        parts += sorted(f"{kernel.cache_key}:{cls!r}" for kernel, cls in classes)
    except Exception:  # noqa: BLE001  (no marker: compile ahead as if the cache were empty)
        return None
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
    return os.path.join(folder, f"fasttomo-ahead-{digest}.done")


def _leave_marker(path: str | None) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("every kernel of this plan was compiled into this cache by fasttomo's compile-ahead pool\n")
    except OSError:  # a read-only cache: the next run compiles ahead again
        pass


def _threads(n_calls: int) -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(n_calls, MAX_THREADS, cpus - 1))


def _touch(kernels, device: torch.device) -> None:
    """Create each kernel's per-device cache here, before the pool's threads would race to (a
    JITFunction makes it lazily, unguarded: a thread that lost the race would compile into a
    table nobody reads, and the run's launch would load that kernel from the disk again)."""
    try:
        from triton.runtime import driver

        with torch.cuda.device(device):
            index = driver.active.get_current_device()
            for k in kernels:
                k.device_caches[index]
    except Exception:  # noqa: BLE001  (another Triton layout: the race costs a cache read, nothing else)
        pass


def start(device: torch.device, jobs: list, kernels=()) -> int:
    """Collect the launches of ``jobs`` (zero-argument callables running launchers, see
    ``plan_jobs``) and compile them for CUDA ``device`` in a pool of threads, one launch per
    task; ``kernels``: the JITFunctions they launch. Returns the number of kernels being compiled
    (0: nothing to do, or a pool is already running)."""
    with _lock:
        if _pending["pool"] is not None or not jobs:
            return 0
        t0 = time.perf_counter()
        classes = []
        calls = _collect(device, jobs, classes)
        if not calls:
            return 0
        marker = plan_marker(device, classes)
        if marker is not None and os.path.exists(marker):  # compiled by an earlier run: load at first use
            _pending.update(done_s=0.0, waited_s=0.0, kernels=len(calls), marker=marker, cached=True, failed=[])
            return 0
        _touch(kernels, device)
        pool = ThreadPoolExecutor(_threads(len(calls)), thread_name_prefix="fasttomo-compile")
        _pending.update(pool=pool, t0=t0, done_s=None, waited_s=None, kernels=len(calls), marker=marker,
                        cached=False, failed=[])
        _pending["futures"] = [pool.submit(_compile, device, call) for call in calls]
    return len(calls)


def wait() -> None:
    """Join the pool started by ``start`` (no-op when none is running); the door calls it before its
    first fused launch."""
    if _pending["pool"] is None:
        return
    with _lock:
        pool = _pending["pool"]
        if pool is None:
            return
        t = time.perf_counter()
        results = [f.result() for f in _pending["futures"]]
        pool.shutdown(wait=True)
        now = time.perf_counter()
        _pending.update(pool=None, futures=[], done_s=max((e for e, _ in results), default=now) - _pending["t0"],
                        waited_s=now - t, failed=[why for _, why in results if why is not None])
        if results and not _pending["failed"]:
            _leave_marker(_pending["marker"])


def summary() -> dict | None:
    """The last pool's kernels, its seconds from start to its last job's end, how long the main
    thread waited for it and, where some failed (they compile at their first launch instead, and
    no marker is left), what failed (for the run's timeline); None when no pool ran."""
    if _pending["done_s"] is None:
        return None
    out = {"kernels": _pending["kernels"], "seconds": round(_pending["done_s"], 3),
           "waited_s": round(_pending["waited_s"], 3), "cached": _pending["cached"]}
    if _pending["failed"]:
        out["failed"] = list(_pending["failed"])
    return out


def plan_jobs(layout, n_points: int, *, train_out_bf16: bool, need_dq: bool, need_gm: bool,
              plane_tv: bool, volume_tv: tuple | None, planes_bf16: bool = False,
              decoder: tuple | None = None, rays: tuple | None = None) -> list:
    """The compile jobs of a field run whose training batch has ``n_points`` points: the
    interpolation's forward as training calls it (bf16 features under bf16 autocast) and its
    backward (the gradient in the features' dtype; dL/dq when the points need a gradient, dL/dM
    when the frames do), the forward in fp32 for both integer classes of the no-grad callers
    (validation chunks, export slabs, renders: a point count divisible by 16 or not), the plane
    TV's pair when ``plane_tv`` and the volume TV's when ``volume_tv`` = (shape, l1); with
    ``planes_bf16`` the interpolation reads a bf16 copy of the planes (the plane TV the planes);
    given ``decoder`` = (F, H), the fused decoder's pair as bf16 training calls it (the no-grad
    callers run in fp32, where the door takes cuBLAS); given ``rays`` = (rays a step, samples a
    ray), the rays' samples for both integer classes of the point count when the samples are not
    a multiple of 16 (a validation chunk's rays are another count)."""
    T, numel, F = layout.n_rot, layout.numel, layout.n_features
    planes, mats = meta(numel), meta(T, 3, 3)
    sampled = meta(numel, dtype=torch.bfloat16) if planes_bf16 else planes
    jobs = []

    def forward(n: int, bf16: bool):
        return lambda: kp.kplanes_forward(meta(n, 3), mats, sampled, layout, bf16)

    def backward():
        gdt = torch.bfloat16 if train_out_bf16 else torch.float32
        kp.kplanes_backward(meta(n_points, F, dtype=gdt), meta(n_points, 3), mats, sampled, layout,
                            need_dq, need_gm=need_gm)

    other = n_points + 1 if n_points % 16 == 0 else (n_points // 16 + 1) * 16
    for n, bf16 in dict.fromkeys([(n_points, train_out_bf16), (n_points, False), (other, False)]):
        jobs.append(forward(n, bf16))
    jobs.append(backward)
    if plane_tv:
        jobs.append(lambda: tv.plane_tv_forward(planes, layout))
        jobs.append(lambda: tv.plane_tv_backward(meta(), planes, layout))
    if decoder is not None:
        F_in, H = decoder
        x, w1, bias, w2, w3 = (meta(n_points, F_in, dtype=torch.bfloat16), meta(H, F_in), meta(H), meta(H, H),
                               meta(1, H))
        # each job binds its tensors now (a job runs after this function has rebound its names)
        jobs.append(lambda x=x, w1=w1, b=bias, w2=w2, w3=w3: mlp.mlp_forward(x, w1, b, w2, b, w3, meta(1), True))
        jobs.append(lambda x=x, w1=w1, b=bias, w2=w2, w3=w3: mlp.mlp_backward(x, meta(n_points), w1, b, w2, b, w3,
                                                                             True))
    if rays is not None:
        n_rays, S = (int(v) for v in rays)
        counts = [n_rays] if S % 16 == 0 else [n_rays, n_rays + 1 if n_rays * S % 16 == 0 else 16]
        for count in dict.fromkeys(counts):
            jobs.append(lambda c=count: rp.ray_points(meta(c, 3), meta(c, 3), meta(c), meta(c),
                                                      meta(c, dtype=torch.bool), (1.0, 1.0, 1.0), S, 1.0))
    if volume_tv is not None:
        shape, l1 = volume_tv
        jobs.append(lambda: tv.volume_tv_forward(meta(*shape), l1))
        jobs.append(lambda: tv.volume_tv_backward(meta(), meta(*shape), l1))
    return jobs


def kernels() -> tuple:
    """The JITFunctions ``plan_jobs``' jobs launch."""
    return (kp.kplanes_fwd_kernel, kp.kplanes_bwd_kernel, kp.kplanes_bwd_runs_kernel, tv.plane_tv_fwd_kernel,
            tv.plane_tv_bwd_kernel, tv.volume_tv_fwd_kernel, tv.volume_tv_bwd_kernel, mlp.mlp_fwd_kernel,
            mlp.mlp_bwd_kernel, rp.ray_points_kernel)
