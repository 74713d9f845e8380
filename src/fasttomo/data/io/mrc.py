"""MRC/ST/ALI stacks and volumes through mrcfile (MRC2014 modes 0, 1, 2, 6, 12).

Reading (:func:`read_mrc`):
  * The file size is checked against the header first: an empty, truncated or corrupt file is an
    error giving the expected and actual byte counts (never a silent None).
  * Strict parsing first; a file that strict parsing rejects only for a header quirk (missing map
    ID, wrong machine stamp, ...) is reopened permissively, with a warning, and the data must then
    be present with the shape the header announces.
  * Mode 0 is signed (MRC2014) unless the file carries IMOD's stamp without its "signed bytes" flag
    (older IMOD files), in which case it is unsigned -- read from the header, never guessed.
  * Extended headers: FEI1/FEI2 (mrcfile's indexed header: 'Alpha tilt' in degrees, 'Pixel size X'
    in metres, 'Tilt axis angle'), legacy FEI (no exttyp, nint=0, nreal=32: 32 floats per section,
    tilt angle first, tilt axis 11th, pixel size in metres 12th) and SerialEM 'SERI' (nint bytes per
    section, nreal bit flags; bit 1 = tilt angle * 100 as the first int16).
  * The voxel size comes from the header (cella / mx). fasttomo's own writer also stores the exact
    value in a label (``fasttomo voxel_size_A=...``) so round trips are exact beyond float32.

Writing (:func:`write_mrc`, :func:`write_mrc_slabs`): float32 (mode 2), voxel size in Angstrom,
origin 0, labels naming fasttomo; the array (Z, Y, X) goes unchanged to (nz, ny, nx); always
through :func:`atomic_write`. A volume can be written slab by slab (``pwrite`` into the file), never
whole in memory, with the same bytes as the one-shot write; :func:`mrc_memmap` maps a float32
file back read-only.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field

import mrcfile
import mrcfile.utils
import numpy as np

from fasttomo.data.io.common import DataFileError, file_size
from fasttomo.data.io.atomic import atomic_write, start_writeback

SUPPORTED_MODES = (0, 1, 2, 6, 12)
HEADER_BYTES = 1024
IMOD_STAMP = 1146047817
_STRUCTURED_EXTTYPES = (b"SERI", b"FEI1", b"FEI2", b"AGAR", b"CCP4", b"HDF5")
_SERI_SIZES = {1: 2, 2: 6, 4: 4, 8: 2, 16: 2, 32: 4, 64: 2, 128: 4, 256: 2, 512: 4, 1024: 2}
_EXACT_LABEL = re.compile(r"fasttomo voxel_size_A=(\S+)")


@dataclass
class MrcData:
    """Raw content of an MRC file (data in its stored dtype)."""

    path: str
    data: np.ndarray
    """(nz, ny, nx) as stored (mode 0 as int8 or uint8, see module doc)."""
    voxel_size: tuple[float, float, float] | None
    """(x, y, z) in Angstrom from the header; None when the header has no cell size."""
    labels: list[str]
    mode: int
    ext_type: str | None = None
    """Extended header understood: FEI1, FEI2, FEI (legacy) or SERI; None otherwise."""
    ext_angles: np.ndarray | None = None
    """Per-section tilt angles (degrees) from the extended header."""
    ext_pixel_size: float | None = None
    """Pixel size (Angstrom) from the extended header."""
    ext_tilt_axis: float | None = None
    """Tilt-axis angle (degrees) from the extended header."""
    notes: list[str] = field(default_factory=list)
    """Things worth logging (permissive open, quirks)."""


def _raw_header(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEADER_BYTES)


def _looks_like(path: str) -> str:
    """What the first bytes of a file that is not MRC suggest ("it looks like text", ...)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return "its start cannot be read"
    known = {b"\x89PNG": "a PNG image", b"II*\x00": "a TIFF", b"MM\x00*": "a TIFF", b"\x89HDF": "an HDF5 file",
             b"PK\x03\x04": "a zip archive (a PyTorch checkpoint?)", b"\xff\xd8\xff": "a JPEG image"}
    for magic, name in known.items():
        if head.startswith(magic):
            return f"it looks like {name}"
    text = sum(32 <= b < 127 or b in (9, 10, 13) for b in head)
    return "it looks like a text file" if head and text >= 0.95 * len(head) else "its first bytes are no MRC header"


def _check_size(path: str, key: str) -> None:
    """Empty/short/truncated/corrupt files: errors with expected and actual sizes (naming ``key``,
    the setting that gave the file, where it cannot be opened)."""
    actual = file_size(path, "MRC", key)
    if actual < HEADER_BYTES:
        raise DataFileError(f"{path}: truncated MRC file: {actual} bytes, less than the {HEADER_BYTES}-byte "
                            "header. Re-export or re-copy the stack.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with mrcfile.open(path, header_only=True, permissive=True) as m:
                h = m.header
                nx, ny, nz = int(h.nx), int(h.ny), int(h.nz)
                mode, nsymbt = int(h.mode), int(h.nsymbt)
                map_ok = bytes(h.map)[:3] == b"MAP"
        except Exception as err:  # noqa: BLE001 - anything here means a corrupt header
            raise DataFileError(f"{path}: corrupt MRC header ({err}); this is not a readable MRC file.") from None
    if not map_ok and (mode not in SUPPORTED_MODES or min(nx, ny, nz) <= 0 or nsymbt < 0):
        raise DataFileError(f"{path}: not an MRC file ({_looks_like(path)}; its header has no 'MAP ' id and no valid "
                            f"MRC mode or size); it is of another type or corrupt. Give the tilt-series stack itself "
                            "(data.path), or rename the file to its real type.")
    if mode not in SUPPORTED_MODES:
        what = "complex data (mode 4) cannot be reconstructed" if mode == 4 else f"mode {mode} is not supported"
        raise DataFileError(f"{path}: {what}; fasttomo reads MRC modes {list(SUPPORTED_MODES)}. Convert the file "
                            "(e.g. IMOD newstack -mode 2).")
    if min(nx, ny, nz) <= 0 or nsymbt < 0:
        raise DataFileError(f"{path}: corrupt MRC header: nx, ny, nz = {nx}, {ny}, {nz}, extended header "
                            f"{nsymbt} bytes. Re-export the stack.")
    itemsize = np.dtype(mrcfile.utils.dtype_from_mode(mode)).itemsize
    expected = HEADER_BYTES + nsymbt + nx * ny * nz * itemsize
    if actual < expected:
        raise DataFileError(
            f"{path}: truncated MRC file: the header announces {nx} x {ny} x {nz} mode-{mode} values after "
            f"{HEADER_BYTES + nsymbt} header bytes = {expected} bytes, but the file has {actual} bytes "
            f"({expected - actual} missing). The copy or export was interrupted; copy the file again."
        )


def _open(path: str) -> tuple[mrcfile.mrcfile.MrcFile, list[str]]:
    """The file opened through a read-only memory map (mrcfile.mmap): the data block is paged in
    as :func:`read_mrc` copies it out, so a stack is held in memory once, not twice."""
    notes: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            return mrcfile.mmap(path, mode="r", permissive=False), notes
    except (ValueError, RuntimeWarning) as err:
        notes.append(f"strict MRC parsing failed ({err}); opened permissively for this header quirk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = mrcfile.mmap(path, mode="r", permissive=True)
    notes += [str(w.message) for w in caught]
    return m, notes


READ_CHUNK_BYTES = 1 << 26
"""Bytes per read call when :func:`_read_block` copies a data block out of the file."""


def _read_block(path: str, mapped: np.ndarray) -> np.ndarray:
    """An in-memory copy (stored dtype) of the data block ``mapped`` maps: read from the file
    with ``readinto`` in chunks of :data:`READ_CHUNK_BYTES` when it is a file-backed memory map, so
    the process never holds the file's pages mapped beside the copy (a 4096^2 x 121 float32 stack is
    8 GB, once), else a plain copy."""
    offset = getattr(mapped, "offset", None)
    if not isinstance(mapped, np.memmap) or offset is None or not mapped.flags.c_contiguous:
        return np.array(mapped)
    out = np.empty(mapped.shape, dtype=mapped.dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(path, "rb") as f:
        f.seek(int(offset))
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + READ_CHUNK_BYTES])
            if not n:
                raise DataFileError(f"{path}: the file ended {len(view) - done} bytes before its data block did; "
                                    "copy the file again.")
            done += n
    return out


def _wrapped_bytes(data: np.ndarray, rows: int = 256) -> bool:
    """Whether signed bytes look like unsigned ones read as signed: neighbouring pixels differ by
    more than 192 (a value crossing 127/128 of a 0..255 image) at least 10x as often as they do when
    the bytes are read unsigned, and in at least 1 of 1000 pairs. A measured test, used to warn only."""
    flat = data.reshape(-1, data.shape[-1])
    sample = flat[:: max(1, flat.shape[0] // rows)].astype(np.int16)
    signed = np.count_nonzero(np.abs(np.diff(sample, axis=1)) > 192)
    unsigned = np.count_nonzero(np.abs(np.diff(sample & 0xFF, axis=1)) > 192)
    return signed >= 0.001 * sample[:, 1:].size and signed >= 10 * unsigned


def _trailing_bytes_note(path: str, data: np.ndarray, nsymbt: int, notes: list[str]) -> list[str]:
    """``notes`` with mrcfile's 'N bytes larger than expected' said once: as whole sections the
    header's nz leaves out, when the extra bytes are that (a stack whose nz was not updated)."""
    extra = os.path.getsize(path) - HEADER_BYTES - nsymbt - data.nbytes
    if extra <= 0:
        return notes
    said = [i for i, n in enumerate(notes) if "larger than expected" in n]  # the strict and the permissive open
    section = data[0].nbytes if data.ndim == 3 and len(data) else 0
    if not (section and extra % section == 0):
        return [n for i, n in enumerate(notes) if i not in said[1:]]
    more = extra // section
    return [n for i, n in enumerate(notes) if i not in said] + [
        f"the header says {len(data)} section{'s' * (len(data) != 1)} (nz), but {more} more whole section(s) follow "
        f"them in the file ({extra} bytes); only the first {len(data)} are read. If the stack has {len(data) + more} "
        "views, fix nz in the header (IMOD: alterheader -size) and give an angle for each"]


def read_mrc(path: str | os.PathLike, key: str = "data.path") -> MrcData:
    """Read an MRC file (stack or volume) given as ``key`` with all checks; see the module docstring."""
    path = os.fspath(path)
    _check_size(path, key)
    mrc, notes = _open(path)
    with mrc:
        h = mrc.header
        expected = mrcfile.utils.data_shape_from_header(h)
        if mrc.data is None or mrc.data.shape != expected:
            got = None if mrc.data is None else mrc.data.shape
            raise DataFileError(f"{path}: the data block could not be read (header shape {expected}, got {got}); "
                                f"notes: {'; '.join(notes) or 'none'}. The file is corrupt; re-export it.")
        data = _read_block(path, mrc.data)
        mode = int(h.mode)
        notes = _trailing_bytes_note(path, data, int(h.nsymbt), notes)
        raw = _raw_header(path)
        order = h.mode.dtype.byteorder if h.mode.dtype.byteorder in "<>" else "="
        if mode == 0:
            stamp = int(np.frombuffer(raw[152:156], dtype=order + "i4")[0])
            flags = int(np.frombuffer(raw[156:160], dtype=order + "i4")[0])
            if stamp == IMOD_STAMP and not flags & 1:
                data = data.view(np.uint8)
                notes.append("mode 0 read as unsigned bytes (IMOD stamp without the signed-bytes flag)")
            elif _wrapped_bytes(data):
                notes.append("mode 0 is read as signed bytes (MRC2014; the file has no IMOD stamp saying otherwise), "
                             "but its values jump between 127 and -128 from pixel to pixel as unsigned bytes read "
                             "as signed do; if the writer meant 0..255, convert the stack to 16-bit or float MRC "
                             "(e.g. with the software that wrote it) and give that file")
        with np.errstate(divide="ignore", invalid="ignore"):  # a grid of 0 (mx = 0): inf or NaN, judged below
            vs = mrc.voxel_size
        voxel = (float(vs.x), float(vs.y), float(vs.z))
        labels = [lab for lab in (mrcfile.utils.printable_string_from_bytes(b).strip() for b in h.label[: int(h.nlabl)])
                  if lab]
        if not all(math.isfinite(v) and v > 0 for v in voxel[:2]):  # unset (0) or a broken cell / grid (mx = 0)
            if voxel[0] != 0 or voxel[1] != 0:
                notes.append(f"the header's pixel size ({voxel[0]:g}, {voxel[1]:g}) A is not finite and positive "
                             "on both axes; ignored")
            voxel = None
        else:
            voxel = _exact_voxel(voxel, labels)
        out = MrcData(path=path, data=data, voxel_size=voxel, labels=labels, mode=mode, notes=notes)
        _read_extended(mrc, raw, order, out)
    return out


def mrc_memmap(path: str | os.PathLike, key: str = "the path") -> np.ndarray | None:
    """The data of a float32 (mode 2) MRC file as a read-only memory map (nz, ny, nx), after the
    same size checks as :func:`read_mrc`: pages are read as they are used, nothing is copied.
    None for any other mode (read those with :func:`read_mrc`). ``key`` names the file's setting in errors."""
    path = os.fspath(path)
    _check_size(path, key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mrcfile.open(path, header_only=True, permissive=True) as m:
            h = m.header
            if int(h.mode) != 2:
                return None
            order = h.mode.dtype.byteorder if h.mode.dtype.byteorder in "<>" else "="
            shape = (int(h.nz), int(h.ny), int(h.nx))
            offset = HEADER_BYTES + int(h.nsymbt)
    return np.memmap(path, dtype=np.dtype(order + "f4"), mode="r", offset=offset, shape=shape)


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def drop_mapped_pages(view: np.ndarray) -> None:
    """Unmap from this process the pages of a memory-mapped file that ``view`` (a slice of a
    np.memmap, e.g. a slab just read) spans (madvise MADV_DONTNEED; Linux): they stop counting in
    its resident memory and stay in the page cache, so a later read costs no disk. Reading a 17 GB
    volume through its map otherwise leaves all of it resident. A no-op for any other array."""
    if (not isinstance(view, np.memmap) or view.size == 0 or getattr(view, "mode", None) == "c"
            or not sys.platform.startswith("linux")):
        return  # (a copy-on-write map would lose its changes)
    import ctypes
    import mmap

    lo = hi = int(view.ctypes.data)
    for n, st in zip(view.shape, view.strides):
        lo, hi = lo + min(0, (n - 1) * st), hi + max(0, (n - 1) * st)
    start = lo - lo % mmap.PAGESIZE
    libc = _libc()
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(hi + view.itemsize - start), ctypes.c_int(mmap.MADV_DONTNEED))


def _exact_voxel(voxel: tuple[float, float, float], labels: list[str]) -> tuple[float, float, float]:
    for lab in labels:
        m = _EXACT_LABEL.search(lab)
        if m:
            try:
                exact = float(m.group(1))
            except ValueError:
                continue
            return tuple(exact if math.isclose(v, exact, rel_tol=1e-5) else v for v in voxel)
    return voxel


def _read_extended(mrc, raw: bytes, order: str, out: MrcData) -> None:
    h = mrc.header
    nz = out.data.shape[0]
    nsymbt = int(h.nsymbt)
    if nsymbt <= 0:
        return
    exttyp = bytes(h.exttyp)
    nint = int(np.frombuffer(raw[128:130], dtype=order + "i2")[0])
    nreal = int(np.frombuffer(raw[130:132], dtype=order + "i2")[0])
    ext = mrc.extended_header
    ext_bytes = b"" if ext is None else ext.tobytes()
    if exttyp in (b"FEI1", b"FEI2"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rec = mrc.indexed_extended_header
        out.notes += [str(w.message) for w in caught]
        if rec is None or len(rec) < nz:
            out.notes.append(f"{exttyp.decode()} extended header holds {0 if rec is None else len(rec)} records "
                             f"for {nz} sections; ignored")
            return
        rec = rec[:nz]
        out.ext_type = exttyp.decode()
        out.ext_angles = np.asarray(rec["Alpha tilt"], dtype=np.float64)
        out.ext_pixel_size = _metres_to_A(np.asarray(rec["Pixel size X"], dtype=np.float64), out)
        out.ext_tilt_axis = float(rec["Tilt axis angle"][0])
    elif exttyp == b"SERI":
        sizes = sum(s for bit, s in _SERI_SIZES.items() if nreal & bit)
        if nint <= 0 or nint * nz > len(ext_bytes) or not nreal & 1 or sizes > nint:
            out.notes.append(f"SERI extended header without tilt angles (nint={nint}, nreal flags={nreal}); ignored")
            return
        recs = np.frombuffer(ext_bytes[: nint * nz], dtype=np.uint8).reshape(nz, nint)
        angles = np.ascontiguousarray(recs[:, :2]).view(order + "i2")[:, 0].astype(np.float64) / 100.0
        out.ext_type = "SERI"
        out.ext_angles = angles
    elif exttyp not in _STRUCTURED_EXTTYPES and nint == 0 and nreal == 32 and len(ext_bytes) >= 128 * nz:
        recs = np.frombuffer(ext_bytes[: 128 * nz], dtype=order + "f4").reshape(nz, 32).astype(np.float64)
        out.ext_type = "FEI (legacy)"
        out.ext_angles = recs[:, 0].copy()
        out.ext_tilt_axis = float(recs[0, 10])
        out.ext_pixel_size = _metres_to_A(recs[:, 11], out)
    if out.ext_angles is not None and np.ptp(out.ext_angles) == 0:
        out.notes.append(f"{out.ext_type} extended header gives the same tilt angle {out.ext_angles[0]} for every "
                         "section; its angles are ignored")
        out.ext_angles = None


def _metres_to_A(values: np.ndarray, out: MrcData) -> float | None:
    values = values[np.isfinite(values) & (values > 0)]
    if values.size == 0:
        return None
    if np.ptp(values) > 1e-6 * values.max():
        out.notes.append(f"extended header pixel sizes differ between sections ({values.min()}..{values.max()} m); "
                         "using the first")
    return float(values[0]) * 1e10


def write_mrc(path: str | os.PathLike, data: np.ndarray, voxel_size: float, *, labels: list[str] | tuple = (),
              overwrite: bool = False, image_stack: bool = False, extra_labels: list[str] | tuple = ()) -> str:
    """Write ``data`` (Z, Y, X) unchanged as float32 MRC (nx = X, ny = Y, nz = Z), atomically.

    ``image_stack`` marks a tilt series (ispg 0) instead of a volume (ispg 1). The voxel size
    (Angstrom) goes to the header and, exactly, to a label; origin is 0. The file is the one
    :func:`write_mrc_slabs` writes from the same values in any slabs (one writer, per-plane
    statistics).
    """
    arr = np.asarray(data)
    if arr.ndim != 3:
        raise DataFileError(f"{path}: can only write 3-D arrays to MRC, got shape {arr.shape}.")
    header = MrcHeader(voxel_size, tuple(labels), image_stack, tuple(extra_labels))
    return write_mrc_slabs(path, arr.shape, [(0, arr)], header, overwrite=overwrite)


@dataclass(frozen=True)
class MrcHeader:
    """What :func:`write_mrc_slabs` puts in the header besides the shape and the statistics."""

    voxel_size: float
    """Angstrom per voxel (header cell and an exact label)."""
    labels: tuple = ()
    image_stack: bool = False
    """A tilt series (ispg 0) instead of a volume (ispg 1)."""
    extra_labels: tuple = ()


class NonFiniteSlab(ValueError):
    """A slab handed to :func:`write_mrc_slabs` held NaN or Inf; no file was written."""


@dataclass
class _PlaneStats:
    """Running min, max, mean and sum of squared deviations, combined plane by plane in Z order
    (Chan et al.'s pairwise update in float64), so the result depends on the values alone, never
    on how the planes were grouped into slabs."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add_plane(self, plane: np.ndarray) -> None:
        if plane.size == 0:
            return
        mean = float(plane.mean(dtype=np.float64))
        m2 = float(np.square(plane - np.float32(mean), dtype=np.float64).sum())
        self.add(plane.size, mean, m2, float(plane.min()), float(plane.max()))

    def add(self, k: int, mean: float, m2: float, lo: float, hi: float) -> None:
        """One plane of ``k`` values given by its mean, sum of squared deviations, min and max."""
        delta, total = mean - self.mean, self.n + k
        self.mean += delta * k / total
        self.m2 += m2 + delta * delta * self.n * k / total
        self.n = total
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)

    def write_to(self, header) -> None:
        header.dmin, header.dmax = np.float32(self.lo), np.float32(self.hi)
        header.dmean = np.float32(self.mean)
        header.rms = np.float32(math.sqrt(max(self.m2, 0.0) / max(self.n, 1)))


def _device_slab(slab, buffers: "_HostBuffers"):
    """(host float32 array, finite, per-plane (mean, m2, min, max) or None, release or None) of a
    slab that is a torch tensor on a GPU: :func:`_device_checks`, then one copy into a reused host
    buffer of ``buffers`` (``release`` hands it back once written); None for anything else (numpy
    does all of it on the host)."""
    checked = _device_checks(slab)
    if checked is None:
        return None
    t, finite, moments = checked
    if not finite:
        return None, False, None, None
    host, release = buffers.copy(t)
    return host, True, moments, release


def _device_checks(slab):
    """(float32 tensor, finite, per-plane (mean, m2, min, max) or None) of a slab that is a torch
    tensor on a GPU: the finiteness test and the plane statistics run there (float64, one plane at
    a time, so they depend on the plane's values alone); None for anything else."""
    if type(slab).__module__.split(".")[0] != "torch" or slab.device.type == "cpu":
        return None
    import torch

    t = slab.detach().to(torch.float32)
    if not bool(torch.isfinite(t).all()):
        return t, False, None
    rows = []
    for p in t:
        mean = p.mean(dtype=torch.float64)
        m2 = (p - mean.to(torch.float32)).to(torch.float64).square().sum()
        rows.append(torch.stack([mean, m2, p.min().to(torch.float64), p.max().to(torch.float64)]))
    moments = torch.stack(rows).cpu().numpy() if rows else np.zeros((0, 4))
    return t, True, moments


class _HostBuffers:
    """Host buffers that GPU slabs are copied into, reused (at most ``count``: one being filled,
    one being written; :meth:`copy` waits for the writer to hand one back) and page-locked
    (``cudaHostRegister``) where the driver allows, so the copy runs at the bus's speed: a fresh
    array per slab paid for its page faults (1.25 GB/s on the H200's host for a 2048^2 x 512
    volume). :meth:`close` unlocks them; they are freed with the last slab written from them."""

    def __init__(self, count: int = 2, pin: bool = True):
        import queue

        self.count, self.made, self.pin = count, 0, pin
        self._free, self._pinned = queue.Queue(), []

    def copy(self, t) -> tuple[np.ndarray, object]:
        """(float32 array holding the tensor ``t``'s values, release): ``release()`` returns the
        buffer for reuse; the array must not be read after it."""
        import torch

        n = t.numel()
        buf = self._take(n)
        torch.from_numpy(buf[:n]).view(t.shape).copy_(t)
        return buf[:n].reshape(t.shape), lambda: self._free.put(buf)

    def _take(self, n: int) -> np.ndarray:
        """A free buffer of at least ``n`` floats: a returned one, a new one while fewer than
        ``count`` exist, else the next one the writer returns."""
        import queue

        while True:
            try:
                buf = self._free.get_nowait() if self.made < self.count else self._free.get()
            except queue.Empty:
                buf = None
            if buf is not None and buf.size >= n:
                return buf
            if buf is not None:  # too small for this slab: dropped, made again at its size
                self.made -= 1
                continue
            self.made += 1
            return self._new(n)

    def _new(self, n: int) -> np.ndarray:
        buf = np.empty(n, dtype=np.float32)
        if self.pin:
            try:
                import torch

                self.pin = int(torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)) == 0
            except Exception:  # noqa: BLE001 - no driver, no runtime binding: pageable copies
                self.pin = False
            if self.pin:
                self._pinned.append(buf)
        return buf

    def close(self) -> None:
        """Unlock the page-locked buffers (each stays valid memory until its last user drops it)."""
        while self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._pinned.pop().ctypes.data)


class SlabWriter:
    """Writes slabs into an open file (``pwrite`` at their offsets) on a background thread, one slab
    queued at most, so the next slab is evaluated (on a GPU) while this one goes to the file; each
    written range is handed to the kernel's writeback at once (Linux ``sync_file_range``), so the
    final fsync of a camera-sized volume finds little left to write (``writeback(offset, nbytes)``
    does it instead where given: ``PublishLater.written`` does it on its own thread, so this one
    never waits for the device's queue). A failed write (a full disk)
    is raised by the next :meth:`put` or by :meth:`close`; :meth:`abort` (the caller's own error)
    stops the thread without writing what is still queued. ``seconds``: the thread's time writing
    (and copying to the host), and the caller's waiting for the queue.

    With ``buffers`` (:class:`_HostBuffers`) the queue has no bound and a GPU tensor may be queued:
    the thread copies it to the host itself (so it must stay unchanged until written), and
    :meth:`detach` lets the caller go on while the thread finishes."""

    def __init__(self, fd: int, writeback=None, buffers: "_HostBuffers | None" = None):
        import queue
        import threading

        self.fd, self.error, self._buffers, self._done = fd, None, buffers, None
        self._writeback = writeback or functools.partial(start_writeback, fd)
        self.seconds = {"write": 0.0, "queue_wait": 0.0}
        self._queue = queue.Queue(maxsize=0 if buffers is not None else 1)
        self._thread = threading.Thread(target=self._run, name="fasttomo-slab-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                if self._done is not None:
                    self._done(self.error, self.seconds["write"])
                return
            data, offset, release = item
            try:
                if self.error is None:
                    t0 = time.perf_counter()
                    if not isinstance(data, np.ndarray):  # a device tensor (``buffers``): its host copy
                        data, release = self._buffers.copy(data)
                    _pwrite_all(self.fd, data, offset)
                    self._writeback(offset, data.nbytes)
                    self.seconds["write"] += time.perf_counter() - t0
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                self.error = exc
            finally:
                if release is not None:
                    release()

    def put(self, data, offset: int, release=None) -> None:
        """Queue ``data`` (an array; with ``buffers`` also a GPU tensor) for the file at byte
        ``offset``; ``release()`` is called once it is written (or skipped after an error)."""
        self._raise()
        t0 = time.perf_counter()
        self._queue.put((np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data, offset, release))
        self.seconds["queue_wait"] += time.perf_counter() - t0

    def detach(self, done) -> None:
        """The caller goes on: the thread writes what is queued, then calls ``done(error or None,
        its seconds writing)`` (and only then may the file be closed)."""
        self._done = done
        self._queue.put(None)

    def close(self) -> None:
        if self._thread.is_alive():
            t0 = time.perf_counter()
            self._queue.put(None)
            self._thread.join()
            self.seconds["queue_wait"] += time.perf_counter() - t0
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def abort(self, exc: BaseException) -> None:
        """The caller failed with ``exc``: the thread skips what is still queued and stops."""
        self.error = self.error or exc
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:done + (1 << 30)], offset + done)
        if n <= 0:  # a full disk raises ENOSPC; no progress is the same failure
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def _new_file(tmp: str, shape: tuple[int, int, int], header: MrcHeader):
    """A float32 MRC file of ``shape`` at ``tmp`` at its full size, its header written but for the
    statistics: (that header record, the data's byte offset, the data's dtype)."""
    vx = float(header.voxel_size)
    with mrcfile.new_mmap(tmp, shape, mrc_mode=2, overwrite=True) as m:
        m.set_image_stack() if header.image_stack else m.set_volume()
        m.voxel_size = vx
        m.header.origin = (0.0, 0.0, 0.0)
        m.header.nxstart = m.header.nystart = m.header.nzstart = 0
        for lab in [*header.labels, f"fasttomo voxel_size_A={vx!r}", *header.extra_labels]:
            m.add_label(_ascii80(lab))
        return m.header.copy(), int(m.data.offset), m.data.dtype


def _checked_slabs(path, shape: tuple[int, int, int], slabs, buffers: "_HostBuffers | None", seconds: dict):
    """(z0, part, per-plane moments or None, release or None) of each of ``slabs``, refused where
    it does not continue the volume of ``shape`` or holds non-finite values. A GPU slab is checked
    and counted there (:func:`_device_checks`), then copied into ``buffers`` (:func:`_device_slab`),
    or, without ``buffers``, passed on as the device tensor (the writer copies it); the seconds go
    to ``seconds["copy_to_host"]``."""
    nxt = 0
    for z0, slab in slabs:
        t0 = time.perf_counter()
        if buffers is None:
            checked = _device_checks(slab)
            on_device = None if checked is None else (*checked, None)
        else:
            on_device = _device_slab(slab, buffers)
        seconds["copy_to_host"] = seconds.get("copy_to_host", 0.0) + time.perf_counter() - t0
        part, finite, moments, release = on_device or (np.asarray(slab, dtype=np.float32), None, None, None)
        if finite is False:
            raise NonFiniteSlab(f"{path}: planes from {z0} on hold non-finite values.")
        if z0 != nxt or part.ndim != 3 or tuple(part.shape[1:]) != shape[1:] or z0 + part.shape[0] > shape[0]:
            raise DataFileError(f"{path}: slab at z={z0} of shape {tuple(part.shape)} does not continue the "
                                f"volume {shape} at plane {nxt}.")
        if not (np.isfinite(part).all() if finite is None else finite):
            raise NonFiniteSlab(f"{path}: planes {z0}..{z0 + part.shape[0] - 1} hold non-finite values.")
        nxt = z0 + part.shape[0]
        yield z0, part, moments, release


def write_mrc_slabs(path: str | os.PathLike, shape_zyx: tuple[int, int, int], slabs, header: MrcHeader, *,
                    overwrite: bool = False, timings: dict | None = None, later: list | None = None,
                    kept: bool = False) -> str:
    """Write a float32 MRC (Z, Y, X) = ``shape_zyx`` from ``slabs``, an iterable of
    ``(z0, array (dz, Y, X))`` that covers the planes 0..Z-1 once each, in order, holding at most
    three slabs in memory (one being made, one queued, one being written): the file is created at
    its full size (header first), each slab is written into its planes with ``pwrite`` on a
    background thread while the next is made (:class:`SlabWriter`; no page of the file is mapped
    into the process; a slab handed over must not change afterwards), and the header statistics are
    combined plane by plane (:class:`_PlaneStats`), so any
    slab partition gives the same bytes. A slab may be a torch tensor on a GPU: its finiteness and
    plane statistics are then computed there (float64; they agree with numpy's to float64
    rounding). Atomic (a temporary name, renamed when complete). A slab with NaN/Inf raises
    :class:`NonFiniteSlab` and leaves no file. ``timings`` (a dict) receives the seconds of the
    whole write (``total``, the fsync included), of the GPU slabs' statistics and copies to the
    host (``copy_to_host``), of the writer thread's writes and of waiting for its queue
    (:class:`SlabWriter`). The header is written first (all but the statistics) and the
    statistics last, by ``pwrite`` too, so no map of the file is flushed over its data.

    Returns the path. With ``later`` (a list; ``data.io.atomic.atomic_write``), the volume goes to
    the disk and is renamed onto ``path`` on a thread, a ``PublishLater`` appended to ``later``
    for the caller to join, and what is returned is a read-only map of the file
    (:func:`mrc_memmap`, made before the rename and valid after it). With ``kept`` too (the slabs
    are views of a volume the caller keeps unchanged until that join), the return comes once every
    slab is checked and counted in the statistics: the copies to the host and the writes go on
    on the writer thread, and the map may be read only after the ``PublishLater``'s
    ``wait_written()``."""
    shape = tuple(int(n) for n in shape_zyx)
    if len(shape) != 3 or min(shape) <= 0:
        raise DataFileError(f"{path}: an MRC volume needs a 3-D shape with every side > 0, got {shape}.")

    def _write(tmp: str) -> None:
        stats = _PlaneStats()
        buffers = _HostBuffers()
        detached = False
        try:
            detached = _write_slab_file(tmp, (path, shape, header), slabs, later, kept, (buffers, stats, seconds))
        finally:
            if not detached:
                buffers.close()
        if later is not None:  # mapped before the publishing thread may rename it
            mapped.append(mrc_memmap(tmp))

    t0, seconds, mapped = time.perf_counter(), {}, []
    out = atomic_write(path, _write, overwrite=overwrite, later=later)
    out = mapped[0] if mapped else out
    if timings is not None:
        timings.update({k: round(v, 3) for k, v in seconds.items()}, total=round(time.perf_counter() - t0, 3))
    return out


def _write_slab_file(tmp: str, volume, slabs, later: list | None, kept: bool, state) -> bool:
    """:func:`write_mrc_slabs`'s writer into ``tmp``: ``volume`` = (path, shape, header), ``state`` =
    (host buffers, plane statistics, seconds). True when the writer thread goes on after the return
    (``kept``)."""
    path, shape, header = volume
    buffers, stats, seconds = state
    plane_bytes, nxt = 4 * shape[1] * shape[2], 0
    publish = later[-1] if later else None
    detach = kept and publish is not None
    head, offset, dtype = _new_file(tmp, shape, header)
    fd = os.open(tmp, os.O_RDWR)
    writer = SlabWriter(fd, publish.written if publish else None, buffers if detach else None)
    try:
        for z0, part, moments, release in _checked_slabs(path, shape, slabs, None if detach else buffers, seconds):
            writer.put(part.astype(dtype, copy=False) if isinstance(part, np.ndarray) else part,
                       offset + z0 * plane_bytes, release)
            if moments is None:
                for plane in part:
                    stats.add_plane(plane)
            else:
                for mean, m2, lo, hi in moments.tolist():
                    stats.add(shape[1] * shape[2], mean, m2, lo, hi)
            nxt = z0 + part.shape[0]
        if nxt != shape[0]:
            raise DataFileError(f"{path}: the slabs ended at plane {nxt} of {shape[0]}.")
        if not detach:
            writer.close()  # every slab in the file (a write's error raised here)
            seconds.update(writer.seconds)
        stats.write_to(head)
        _pwrite_all(fd, np.frombuffer(head.tobytes(), dtype=np.uint8), 0)
    except BaseException as exc:
        writer.abort(exc)
        os.close(fd)
        raise
    if not detach:
        os.close(fd)
        return False

    finished = publish.defer()

    def done(error, write_s):
        buffers.close()
        os.close(fd)
        finished(error, write_s)

    writer.detach(done)
    return True


def _ascii80(text: str) -> str:
    return text.encode("ascii", "replace").decode("ascii")[:80]
