"""Triton's cache folder, and Triton's own cache key kept there between processes.

Every kernel Triton loads from its on-disk cache is looked up under a key that starts with
``triton.runtime.cache.triton_key()``: a hash of Triton's installation (its compiler, backend and
language sources, and the whole libtriton shared library, hundreds of MB), computed once per
process. On an H200 it took about 0.4 s of every GPU run's start, and the run's build waited for
it. ``remember_triton_key`` keeps the key in Triton's cache folder, in a file named by the sizes
and modification times of the files Triton hashes (and Triton's version and folder), so a later
process reads it instead of hashing: a reinstalled or changed Triton has other stamps, hence
another file, and computes the key again. Triton does the same substitution itself for its warm-up
worker processes (``triton.runtime.cache.triton_key = lambda: key``); here it is done once in the
background load (``kernels/prewarm.py``), before any kernel is looked up. An empty cache folder
(a fresh ``TRITON_CACHE_DIR``) has no key file: that run hashes, as it compiles.
"""

from __future__ import annotations

import hashlib
import os

HASHED = ("compiler", "backends", "language")
"""The folders of Triton's package whose Python files its key hashes (besides runtime/cache.py
and _C/libtriton)."""


def cache_folder() -> str:
    """Triton's on-disk cache folder (``TRITON_CACHE_DIR``, else Triton's default)."""
    try:
        from triton import knobs

        return knobs.cache.dir
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def install_stamp(root: str, version: str) -> str:
    """A digest of the path, size and modification time of every file Triton's key hashes under
    its package folder ``root``, with its ``version``: it changes whenever one of them may have."""
    parts = [version, os.path.abspath(root)]
    files = [os.path.join(root, "runtime", "cache.py")]
    for sub in HASHED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, sub)):
            dirnames.sort()
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    lib = os.path.join(root, "_C")
    if os.path.isdir(lib):
        files += [os.path.join(lib, f) for f in sorted(os.listdir(lib)) if f.startswith("libtriton.")]
    for path in files:
        try:
            st = os.stat(path)
            parts.append(f"{os.path.relpath(path, root)}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{os.path.relpath(path, root)}:missing")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def remember_triton_key() -> str | None:
    """Make ``triton.runtime.cache.triton_key()`` this process's key without hashing where an
    earlier process left it in the cache folder (else compute it and leave it there); returns the
    key, or None where this Triton has no such function (nothing changed then)."""
    try:
        import triton
        import triton.runtime.cache as tc
    except ImportError:
        return None
    original = getattr(tc, "triton_key", None)
    if original is None:
        return None
    root = os.path.dirname(os.path.dirname(os.path.abspath(tc.__file__)))
    path = os.path.join(cache_folder(), f"fasttomo-triton-key-{install_stamp(root, triton.__version__)}.txt")
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read()
    except OSError:
        key = ""
    if not key.startswith(triton.__version__):  # absent, or not a key this Triton wrote
        key = original()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(key)
            os.replace(tmp, path)  # whole or absent for a process reading it beside us
        except OSError:  # a read-only cache: the next process hashes again
            pass

    def triton_key() -> str:
        return key

    tc.triton_key = triton_key  # cache.get_cache_key calls the module's name at each lookup
    return key
