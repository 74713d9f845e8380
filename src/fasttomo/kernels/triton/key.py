"""Triton's cache folder, and Triton's own cache key kept there between processes.

Every kernel Triton loads from its on-disk cache is looked up under a key that starts with
``triton.runtime.cache.triton_key()``: a hash of Triton's installation (its compiler, backend and
language sources, and the whole libtriton shared library, hundreds of MB), computed once per
process. On an H200 it took about 0.4 s of every GPU run's start, and the run's build waited for
it. ``remember_triton_key`` keeps the key in Triton's cache folder, in a file named by the sizes
and modification times of the files Triton hashes (and Triton's version and folder), so a later
process reads it instead of hashing: a reinstalled or changed Triton has other stamps, hence
another file, and computes the key again. Newer Tritons make the same substitution themselves for
their warm-up worker processes (``triton.runtime.cache.triton_key = lambda: key``); here it is
done once in the background load (``kernels/prewarm.py``), before any kernel is looked up
(modules that imported the function by name, Triton's autotuner among them, keep hashing once).
An empty cache folder (a fresh ``TRITON_CACHE_DIR``) has no key file: that run hashes, as it
compiles.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import re
import tempfile

HASHED = ("compiler", "backends", "language")
"""The folders of Triton's package whose modules its key hashes (besides runtime/cache.py and
_C/libtriton)."""


def cache_folder() -> str:
    """Triton's on-disk cache folder (``TRITON_CACHE_DIR``, else Triton's default)."""
    try:
        from triton import knobs

        return knobs.cache.dir
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def stamped_files(root: str) -> list[str]:
    """The files under Triton's package folder ``root`` whose stamps make the key file's name:
    runtime/cache.py, every module file (any of Python's module suffixes) under the folders the key
    hashes, symbolic links followed (a source build links its backends in), and _C/libtriton."""
    suffixes = tuple(importlib.machinery.all_suffixes())
    files = [os.path.join(root, "runtime", "cache.py")]
    for sub in HASHED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, sub), followlinks=True):
            dirnames.sort()
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(suffixes)]
    lib = os.path.join(root, "_C")
    if os.path.isdir(lib):
        files += [os.path.join(lib, f) for f in sorted(os.listdir(lib)) if f.startswith("libtriton.")]
    return files


def install_stamp(root: str, version: str) -> str:
    """A digest of the path, size and modification time of each of :func:`stamped_files`, with
    Triton's ``version`` and folder: it changes whenever one of the hashed files may have."""
    parts = [version, os.path.abspath(root)]
    for path in stamped_files(root):
        try:
            st = os.stat(path)
            parts.append(f"{os.path.relpath(path, root)}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{os.path.relpath(path, root)}:missing")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def well_formed(key: str, version: str) -> bool:
    """Whether ``key`` has the shape of a key Triton 3.x makes: its version, then sha256 digests
    joined by '-' (a truncated or foreign file is hashed again)."""
    return re.fullmatch(re.escape(version) + r"[0-9a-f]{64}(-[0-9a-f]{64})*", key) is not None


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
    if not well_formed(key, triton.__version__):  # absent, or not a key this Triton wrote
        key = original()
        tmp = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fasttomo-triton-key-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(key)
            os.replace(tmp, path)  # whole or absent for a process reading it beside us
        except OSError:  # a read-only cache: the next process hashes again
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def triton_key() -> str:
        return key

    tc.triton_key = triton_key  # cache.get_cache_key calls the module's name at each lookup
    return key
