"""kernels.prewarm: the background load of the fused kernels at a GPU run's start (fresh processes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHILD = r"""
import json, sys
from fasttomo.kernels import prewarm
started = prewarm.start()
again = prewarm.start()
prewarm.wait()
out = {"started": started, "again": again, "ops_loaded": "fasttomo.kernels.triton.ops" in sys.modules}
if started:
    import triton.runtime.cache as tc
    from triton.runtime import driver
    out["key_remembered"] = tc.triton_key.__module__ == "fasttomo.kernels.triton.key"
    out["gluon_loaded"] = "triton.experimental.gluon" in sys.modules
    out["driver_before_device"] = driver._active is not None
    import torch
    out["context_before_device"] = torch.cuda.is_initialized()  # start() makes none (a dry run, a CPU run)
out["device_started"] = prewarm.warm_device(0) if started else None
prewarm.wait()
if started:
    import torch
    out["context"] = torch.cuda.is_initialized()
    out["driver_made"] = driver._active is not None
print(json.dumps(out))
"""


def _child() -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU case (this machine has a GPU)")
def test_without_a_gpu_nothing_is_loaded():
    assert _child() == {"started": False, "again": False, "ops_loaded": False, "device_started": None}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("triton")),
                    reason="needs a CUDA GPU and triton")
def test_on_a_gpu_the_kernels_the_cache_key_and_the_device_are_ready_after_wait():
    assert _child() == {"started": True, "again": False, "ops_loaded": True, "key_remembered": True,
                        "gluon_loaded": True, "driver_before_device": False, "context_before_device": False,
                        "device_started": True, "context": True, "driver_made": True}


# --------------------------------------------------------------------------------------- what it relies on
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _run(code: str, cache: Path) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_triton
def test_the_thread_leaves_triton_its_own_key_from_the_cache_folder(tmp_path):
    """The thread's work (run here without a GPU, in a fresh process): it imports the op module and
    puts a function returning Triton's own key in ``triton.runtime.cache.triton_key`` (the private
    name a kernel lookup calls), leaving the key in Triton's cache folder; if Triton renames it,
    this fails and key.py needs a look."""
    code = r"""
import json, os, sys
import triton.runtime.cache as tc
original = tc.triton_key
from fasttomo.kernels import prewarm
prewarm._work()
files = [f for f in os.listdir(os.environ["TRITON_CACHE_DIR"]) if f.startswith("fasttomo-triton-key-")]
kept = open(os.path.join(os.environ["TRITON_CACHE_DIR"], files[0])).read() if len(files) == 1 else None
print(json.dumps({"replaced": tc.triton_key is not original, "same_key": tc.triton_key() == original(),
                  "kept": kept == original(), "files": len(files),
                  "ops": "fasttomo.kernels.triton.ops" in sys.modules}))
"""
    assert _run(code, tmp_path) == {"replaced": True, "same_key": True, "kept": True, "files": 1, "ops": True}


READ_BACK = r"""
import json
import triton, triton.runtime.cache as tc
from fasttomo.kernels.triton.key import remember_triton_key
key = remember_triton_key()
print(json.dumps({"returned": key, "module": tc.triton_key(), "version": triton.__version__}))
"""


@needs_triton
def test_a_later_process_reads_the_kept_key_instead_of_hashing(tmp_path):
    first = _run(READ_BACK, tmp_path)
    (kept,) = tmp_path.glob("fasttomo-triton-key-*.txt")
    assert kept.read_text() == first["returned"] == first["module"]
    planted = first["version"] + "f" * 64 + "-" + "e" * 64  # well formed: only a read of the file returns it
    kept.write_text(planted)
    assert _run(READ_BACK, tmp_path) == {"returned": planted, "module": planted, "version": first["version"]}
    for bad in ("not a key", first["returned"][:40]):  # foreign or truncated: hashed again and replaced
        kept.write_text(bad)
        assert _run(READ_BACK, tmp_path)["module"] == first["returned"]
        assert kept.read_text() == first["returned"]
    assert [f.name for f in tmp_path.iterdir()] == [kept.name]  # no temporary file left beside it


@needs_triton
def test_the_stamp_covers_every_file_tritons_own_key_reads():
    """The key file's name follows the files ``triton_key`` itself opens (the installed Triton's,
    recorded in a fresh process): a change to any of them names another file."""
    code = r"""
import builtins, json, os
import triton, triton.runtime.cache as tc
from fasttomo.kernels.triton.key import stamped_files
opened, real_open = [], builtins.open
def spy(file, *a, **k):
    opened.append(os.path.realpath(os.fspath(file)))
    return real_open(file, *a, **k)
builtins.open = spy
tc.triton_key.cache_clear()
tc.triton_key()
builtins.open = real_open
root = os.path.dirname(os.path.dirname(os.path.abspath(tc.__file__)))
stamped = {os.path.realpath(f) for f in stamped_files(root)}
print(json.dumps({"opened": len(opened), "missing": sorted(set(opened) - stamped)}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["opened"] > 10 and got["missing"] == [], got


def test_the_stamp_changes_with_each_file_triton_hashes_and_its_version(tmp_path):
    from fasttomo.kernels.triton.key import install_stamp

    root = tmp_path / "triton"
    files = {name: root / name for name in ("runtime/cache.py", "compiler/compiler.py",
                                            "backends/nvidia/driver.py", "language/core.py",
                                            "_C/libtriton.so", "tools/other.py")}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
        os.utime(path, ns=(10**18, 10**18))
    linked = tmp_path / "elsewhere" / "amd"  # a source build links a backend in
    linked.mkdir(parents=True)
    (linked / "driver.py").write_text("x")
    os.utime(linked / "driver.py", ns=(10**18, 10**18))
    (root / "backends" / "amd").symlink_to(linked, target_is_directory=True)
    base = install_stamp(str(root), "3.6.0")
    assert install_stamp(str(root), "3.6.0") == base
    assert install_stamp(str(root), "3.6.1") != base
    for name, path in files.items():
        os.utime(path, ns=(10**18, 10**18 + 1))
        assert (install_stamp(str(root), "3.6.0") != base) == (name != "tools/other.py"), name
        os.utime(path, ns=(10**18, 10**18))
        path.write_text("xy")  # the same time, another size
        assert (install_stamp(str(root), "3.6.0") != base) == (name != "tools/other.py"), name
        path.write_text("x")
        os.utime(path, ns=(10**18, 10**18))
    assert install_stamp(str(root), "3.6.0") == base
    os.utime(linked / "driver.py", ns=(10**18, 10**18 + 1))
    assert install_stamp(str(root), "3.6.0") != base
