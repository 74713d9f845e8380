"""The native CPU kernels at the edges of the machine: worker threads that cannot be created, many
threads against large planes, a cache shared between CPUs of other instruction sets."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from fasttomo.kernels import cpu, cpu_mlp, cpu_native
from fasttomo.kernels.layout import PlaneLayout

_LIMITED = textwrap.dedent("""
    import json, resource, threading, torch
    from fasttomo.kernels import cpu, cpu_mlp
    from fasttomo.kernels.layout import PlaneLayout

    g = torch.Generator().manual_seed(0)
    lay = PlaneLayout(2, 8, ((9, 9, 9), (17, 17, 17)))
    pts = torch.rand(5000, 3, generator=g) * 2 - 1
    M = torch.linalg.qr(torch.randn(2, 3, 3, generator=g))[0]
    planes = torch.randn(lay.numel, generator=g)
    w = [torch.randn(32, 32, generator=g) / 6, torch.randn(32, generator=g), torch.randn(32, 32, generator=g) / 6,
         torch.randn(32, generator=g), torch.randn(1, 32, generator=g), torch.randn(1, generator=g)]

    def step():
        leaves = [t.clone().requires_grad_() for t in (pts, M, planes, *w)]
        feats = cpu.tilted_kplanes(*leaves[:3], lay, native=True)
        out = cpu_mlp.decoder_mlp(feats, *leaves[3:], native=True)
        return [out.detach(), *torch.autograd.grad(out.square().sum(), leaves)]

    torch.set_num_threads(64)
    before = step()  # the libraries built and torch's own thread pool started, before the limit
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
    done, threads = threading.Event(), []
    try:  # the limit bites: room for a few thread stacks, not 63
        for _ in range(63):
            t = threading.Thread(target=done.wait)
            t.start()
            threads.append(t)
    except RuntimeError:
        pass
    done.set()
    for t in threads:
        t.join()
    after = step()
    print(json.dumps({"threads_started": len(threads), "equal": [bool(torch.equal(a, b)) for a, b in zip(before, after)]}))
""")


@pytest.mark.skipif(platform.system() != "Linux", reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_workers_that_cannot_start_run_on_the_calling_thread():
    """With no address space left for 63 thread stacks, both native kernels run the shares of the
    threads they could not create on the calling thread: the same bits as with all threads (the
    launcher ignored pthread_create's failure: a hang or a crash, reproduced before the fix)."""
    if cpu_native.library(torch.float32, 8) is None or cpu_mlp.library(torch.float32, 32, 32) is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler)")
    env = dict(os.environ, OMP_NUM_THREADS="64")
    proc = subprocess.run([sys.executable, "-c", _LIMITED], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["threads_started"] < 63  # the limit did stop thread creation
    assert res["equal"] == [True] * 10  # output and the gradients of points, frames, planes, 6 weights


def test_the_backward_holds_at_most_private_grad_bytes_of_extra_plane_buffers(monkeypatch):
    """Each backward worker scatters into its own copy of the plane gradient: past
    PRIVATE_GRAD_BYTES of extra copies the backward runs on fewer threads, with the same results as
    a run on that many threads; the dry run's training step counts the copies."""
    if cpu_native.library(torch.float64, 4) is None:
        pytest.skip("the native CPU kernels cannot be built here (no C compiler)")
    lay = PlaneLayout(2, 4, ((6, 5, 7),))
    g = torch.Generator().manual_seed(3)
    pts, planes = torch.rand(301, 3, generator=g, dtype=torch.float64) * 2 - 1, torch.randn(lay.numel, generator=g,
                                                                                              dtype=torch.float64)
    M = torch.linalg.qr(torch.randn(2, 3, 3, generator=g, dtype=torch.float64))[0]
    gout = torch.randn(301, lay.n_features, generator=g, dtype=torch.float64)
    plane_bytes = planes.numel() * 8
    before = torch.get_num_threads()

    def grads(threads):
        torch.set_num_threads(threads)
        leaves = [t.clone().requires_grad_() for t in (pts, M, planes)]
        return torch.autograd.grad(cpu.tilted_kplanes(*leaves, lay, native=True), leaves, gout)

    try:
        two = grads(2)
        monkeypatch.setattr(cpu_native, "PRIVATE_GRAD_BYTES", plane_bytes)  # room for one extra copy
        assert cpu_native.backward_threads(plane_bytes) == 2
        capped = grads(3)
        assert cpu_native.backward_threads(plane_bytes // 2) == 3 and cpu_native.backward_threads(10 ** 12) == 1
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(two, capped))  # 3 asked, 2 ran: the 2-thread bits

    from fasttomo.run import preflight

    monkeypatch.setattr(preflight, "_fused", lambda device: True)
    monkeypatch.setattr(cpu_native, "PRIVATE_GRAD_BYTES", 2 << 30)
    shape = preflight.RunShape(torch.device("cpu"), batch=1024, samples_per_ray=48, n_features=32, hidden=32,
                               n_val=1000, pixels=10 ** 6, stack_bytes=4 * 10 ** 6, parameters=10 ** 6, voxels=64 ** 3)
    steps = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            steps.append(preflight.pass_bytes(shape)["training step"])
    finally:
        torch.set_num_threads(before)
    assert steps[1] - steps[0] == 2 * 4 * shape.parameters


_X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse avx2\n\n" \
       "processor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse avx2\n"
_ARM = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd {extra}\nCPU implementer\t: 0x41\n" \
       "CPU architecture: 8\nCPU variant\t: 0x{variant}\nCPU part\t: 0x{part}\nCPU revision\t: 1\n"


def test_the_cache_key_tells_cpu_models_apart(tmp_path):
    """The libraries are built with -march=native, so the cache key names the CPU: on x86 its model
    name and flags (the lines it always used: caches stay valid), on ARM its Features and part
    numbers (an SVE build must not load on a Graviton2)."""
    files = {"x86": _X86, "graviton2": _ARM.format(extra="atomics", variant="3", part="d0c"),
             "graviton3": _ARM.format(extra="atomics sve", variant="1", part="d40")}
    tags = {}
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        tags[name] = cpu_native._cpu_tag(str(path))
    assert tags["x86"] == platform.machine() + "model name\t: AMD EPYC 9654\n" + "flags\t\t: fpu sse avx2\n"
    assert tags["graviton2"] != tags["graviton3"] and "sve" in tags["graviton3"] and "0xd40" in tags["graviton3"]
    assert cpu_native._cpu_tag(str(tmp_path / "missing")) == platform.machine()
