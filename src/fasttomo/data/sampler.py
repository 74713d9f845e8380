"""Ray (pixel) batch sampling: the device-resident sampler and the per-pixel DataLoader twin.

Every measured pixel of the tilt series is one ray. A pixel is named by its flat id

    p = tilt * H * W + row * W + col          (row along the tilt axis, col along X)

and a :class:`Batch` carries, for B rays, the view index, row, column, the measured value divided
by the sampler's :attr:`RaySampler.scale` and a weight (1 valid, 0 masked).

Order of the pixels (identical for both samplers, every rank, and across save/resume):

1. **Split.** A CPU ``torch.Generator`` seeded with ``cfg.split_seed`` (independent of the run seed)
   permutes all ``N = n*H*W`` ids; the first ``n_val`` become the validation set, the rest the
   training set (both kept sorted). ``n_val = round(N * val_fraction)`` (at least 1 when the
   fraction is > 0). Masked pixels stay in both sets with weight 0 unless ``cfg.skip_masked``.
2. **Epoch permutation.** A CPU generator seeded from ``(seed, epoch)`` (SplitMix64 mix) permutes
   the training ids, identically on every rank.
3. **Shard.** Rank ``r`` of ``world_size`` takes the contiguous slice
   ``[r * n_per_rank, (r + 1) * n_per_rank)`` with ``n_per_rank = n_train // world_size`` (the ragged
   tail is dropped, so every rank makes the same number of batches and gradient sync cannot hang).
4. **Batches** of ``batch_size`` in that order; ``drop_last`` drops the short last batch, otherwise
   it is yielded. After the last batch of an epoch the sampler moves to the next epoch by itself
   (``set_epoch`` may also be called, e.g. by a trainer that counts epochs).

**Hashed order** (``cfg.order``; null: above :data:`HASHED_MIN_PIXELS` pixels). Steps 1-2 without
any list of all pixels: the split is a keyed permutation sigma of the ids
(:class:`~fasttomo.data.permutation.FeistelPermutation`, keys from ``split_seed``), validation
pixels being those with ``sigma(p) < n_val`` and training pixel ``j`` being ``sigma^-1(n_val + j)``;
the epoch order is a second keyed permutation of ``[0, n_train)`` (keys from ``(seed, epoch)``),
evaluated :data:`HASHED_CHUNK_BATCHES` batches at a time (the next chunk in a background thread).
Sharding and batching are as above. Masked pixels stay in with weight 0 (with ``skip_masked`` on a
masked series the stored order is used).

**Patches** (``cfg.patch_size = P > 1``): the unit of steps 2-4 is a P x P tile of one view instead
of a pixel. Each view is cut into a fixed grid of ``ceil(H/P) x ceil(W/P)`` tiles whose top-left
corners are ``(min(a P, H - P), min(b P, W - P))`` (the last row and column overlap their
neighbours where P does not divide the image); the tiles of all views, ordered by (view, a, b), are
permuted, sharded and batched like pixels above, ``batch_size / P^2`` tiles a batch, and a tile is
P^2 consecutive rays in row-major order. The split of step 1 is unchanged: a validation pixel inside
a tile comes with weight 0 (as does a masked one), so the validation set is the same as with single
pixels. With ``skip_masked``, tiles holding no valid training pixel are left out.

:class:`DeviceBatchSampler` keeps the normalized stack, the training ids and the current epoch's
shard on the device and builds a batch with a few index-arithmetic kernels and two gathers into
persistent buffers; :class:`DataLoaderSampler` is the classic per-pixel ``torch.utils.data``
pipeline (``__getitem__`` per pixel, collate, host-to-device copy), kept for comparison. For the
same seed both yield bit-identical batches.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fasttomo.config import ConfigError, SamplerConfig
from fasttomo.data.permutation import FeistelPermutation, round_keys, splitmix64 as _splitmix64
from fasttomo.data.tiltseries import TiltSeries

__all__ = [
    "Batch",
    "RaySampler",
    "DeviceBatchSampler",
    "DataLoaderSampler",
    "PixelDataset",
    "build_sampler",
    "robust_scale",
    "split_pixels",
    "epoch_generator",
    "order_of",
]

_STATE_VERSION = 1
_SCALE_QUANTILE = 99.9
_SCALE_MAX_VALUES = 1 << 22  # subsample (deterministic stride) above this many valid pixels
HASHED_MIN_PIXELS = 1 << 24
"""sampler.order=null: the hashed order above this many pixels (a 1024^2 x 61 series has 64 M)."""
HASHED_CHUNK_BATCHES = 256
"""order=hashed: the epoch's order is computed this many batches at a time (on the CPU, the next
chunk in a background thread)."""
_ID_CHUNK = 1 << 22  # ids a pass of the split permutation maps at a time


@dataclasses.dataclass
class Batch:
    """B rays. For the device sampler the tensors are persistent buffers (see DeviceBatchSampler)."""

    tilt: torch.Tensor
    """(B,) int64 view index."""
    row: torch.Tensor
    """(B,) int64 pixel row i (along the tilt axis)."""
    col: torch.Tensor
    """(B,) int64 pixel column j."""
    target: torch.Tensor
    """(B,) float32 measured value divided by the sampler's scale."""
    weight: torch.Tensor
    """(B,) float32: 1 for valid pixels, 0 for masked ones (ts.valid False)."""

    def __len__(self) -> int:
        return int(self.tilt.shape[0])


# --------------------------------------------------------------------------------------- helpers
def order_of(cfg: SamplerConfig, n_pixels: int, masked: bool) -> str:
    """sampler.order resolved: stored or hashed (see SamplerConfig.order)."""
    if cfg.patch_size > 1 or (masked and cfg.skip_masked):
        return "stored"
    if cfg.order is not None:
        return cfg.order
    return "hashed" if n_pixels > HASHED_MIN_PIXELS else "stored"


def _valid_mask(ts: TiltSeries) -> np.ndarray | None:
    valid = getattr(ts, "valid", None)
    if valid is None:
        return None
    valid = np.asarray(valid, dtype=bool)
    if valid.shape != ts.stack.shape:
        raise ValueError(
            f"tilt series from {ts.source}: validity mask shape {valid.shape} != stack shape "
            f"{ts.stack.shape}; the mask must flag every pixel."
        )
    return None if valid.all() else np.ascontiguousarray(valid)


def robust_scale(stack: np.ndarray, valid: np.ndarray | None = None, offset: float = 0.0) -> float:
    """The sampler's target scale: the 99.9th percentile of |value - offset| over the valid pixels
    (``offset``: the background the intensity model adds, so a camera pedestal does not shrink
    the field's units).

    Robust to a few hot pixels, deterministic (a fixed-stride subsample of at most 2**22 values
    for large stacks), hence identical on every rank that holds the same data. Falls back to the
    largest |value|, then to 1.0 for an all-zero stack. Returned as a float32-representable float.
    """
    values = stack[valid] if valid is not None else stack.reshape(-1)
    if values.size == 0:
        return 1.0
    if values.size > _SCALE_MAX_VALUES:
        values = values[:: math.ceil(values.size / _SCALE_MAX_VALUES)]
    mags = np.abs(values.astype(np.float64) - float(offset))
    scale = float(np.percentile(mags, _SCALE_QUANTILE))
    if not (math.isfinite(scale) and scale > 0):
        scale = float(mags.max())
    if not (math.isfinite(scale) and scale > 0):
        scale = 1.0
    return float(np.float32(scale))


def split_size(n_pixels: int, val_fraction: float) -> int:
    """Validation pixels of :func:`split_pixels`."""
    if val_fraction > 0:
        return min(n_pixels - 1, max(1, int(math.floor(n_pixels * val_fraction + 0.5))))
    return 0


def split_pixels(n_pixels: int, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_ids, val_ids), both sorted int64 CPU tensors, from a generator seeded with split_seed."""
    n_val = split_size(n_pixels, val_fraction)
    g = torch.Generator(device="cpu")
    g.manual_seed(int(split_seed) & 0xFFFF_FFFF_FFFF_FFFF)
    perm = torch.randperm(n_pixels, generator=g, dtype=torch.int64)
    val_ids = perm[:n_val].sort().values
    train_ids = perm[n_val:].sort().values
    return train_ids, val_ids


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """CPU generator of the epoch permutation, a pure function of (seed, epoch)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(_splitmix64(_splitmix64(int(seed) & 0xFFFF_FFFF_FFFF_FFFF) ^ (int(epoch) & 0xFFFF_FFFF_FFFF_FFFF)))
    return g


# --------------------------------------------------------------------------------------- base
class RaySampler:
    """Shared bookkeeping of both samplers: split, scale, epoch order, sharding and state.

    Attributes:
        scale: targets are ``stack / scale`` (see :func:`robust_scale`); identical on all ranks.
        n_train, n_val: sizes of the global training and validation sets (pixels).
        n_per_rank: training pixels this rank visits per epoch (``n_train // world_size``).
        batches_per_epoch: batches per epoch on every rank.
        epoch: current epoch; ``position`` is the number of batches of it already produced.
    """

    kind = "base"

    def __init__(self, ts: TiltSeries, cfg: SamplerConfig, *, seed: int, device: torch.device,
                 rank: int = 0, world_size: int = 1, offset: float = 0.0) -> None:
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}.")
        self.cfg = cfg
        self.seed = int(seed)
        self.device = torch.device(device)
        self.rank = rank
        self.world_size = world_size
        self.batch_size = int(cfg.batch_size)
        self.drop_last = bool(cfg.drop_last)
        n, h, w = ts.stack.shape
        self.shape = (int(n), int(h), int(w))
        self._hw = int(h) * int(w)
        self._w = int(w)

        valid = _valid_mask(ts)
        self.scale = robust_scale(ts.stack, valid, offset)
        self.data_digest = data_digest(ts)
        self._stack = ts.stack  # normalized by _host_stack (numpy) or on the device
        self._valid = None if valid is None else valid.reshape(-1)
        self.has_mask = valid is not None
        n_pixels = int(ts.stack.size)
        self.order = order_of(cfg, n_pixels, self.has_mask)
        if self.order == "hashed":
            self._hashed_split(n_pixels)
        else:
            train_ids, val_ids = split_pixels(n_pixels, float(cfg.val_fraction), int(cfg.split_seed))
            if self._valid is not None and cfg.skip_masked:
                vt = torch.from_numpy(self._valid)
                train_ids = train_ids[vt[train_ids]]
                val_ids = val_ids[vt[val_ids]]
            self._train_ids_cpu = train_ids
            self._val_ids_cpu = val_ids
            self.n_train = int(train_ids.numel())
            self.n_val = int(val_ids.numel())

        # The unit the epoch permutes: a training pixel id, or (patches) a tile's top-left pixel id.
        self.patch_size = int(cfg.patch_size)
        p = self.patch_size
        self._patch_offsets = None
        self._train_weight = None
        if self.order == "hashed":
            self._units_cpu = None  # the training ids are the split's tail: see _hashed_ids
            self.n_units = self.n_train
        else:
            self._units_cpu = self._patch_units(self._train_ids_cpu) if p > 1 else self._train_ids_cpu
            self.n_units = int(self._units_cpu.numel())
        self._units_per_batch = self.batch_size // (p * p)
        units_per_rank = self.n_units // world_size
        self.n_per_rank = units_per_rank * p * p
        """Rays (pixel slots) this rank visits per epoch."""
        if self.drop_last:
            self.batches_per_epoch = units_per_rank // self._units_per_batch
        else:
            self.batches_per_epoch = -(-units_per_rank // self._units_per_batch)
        self._units_per_rank = units_per_rank
        if self.batches_per_epoch < 1:
            what = "training pixels" if p == 1 else f"{p} x {p} tiles ({self.n_per_rank} rays)"
            raise ConfigError(
                f"sampler.batch_size: {units_per_rank} {what} per rank (n_train={self.n_train}, "
                f"world_size={world_size}) cannot fill one batch of {self.batch_size} with drop_last=true; "
                "lower sampler.batch_size or set sampler.drop_last=false."
            )
        self.epoch = 0
        self.position = 0
        self._ready_epoch: int | None = None  # epoch whose order is materialized
        # The next epoch's permutation is drawn in a background thread (randperm releases the
        # GIL), so the once-per-epoch reshuffle (~50 ms for 2.4 M pixels on one core) does not
        # stall the step loop; short epochs under DDP would otherwise feel it.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[int, concurrent.futures.Future] = {}

    def _normalized(self, lo: int, hi: int) -> np.ndarray:
        """Flat pixels [lo, hi) of the normalized stack, float32 on the host; masked pixels 0 so
        targets are always finite."""
        seg = self._stack.reshape(-1)[lo:hi] / np.float32(self.scale)
        if self._valid is not None:
            seg = np.where(self._valid[lo:hi], seg, np.float32(0))
        return np.ascontiguousarray(seg, dtype=np.float32)

    def _host_stack(self) -> np.ndarray:
        """The whole normalized stack, flat float32 on the host (:meth:`_normalized`)."""
        return self._normalized(0, int(self._stack.size))

    # -- order=hashed --------------------------------------------------------------------------
    def _hashed_split(self, n_pixels: int) -> None:
        """The split as a keyed permutation sigma of the pixel ids: validation pixels are those
        with sigma(id) < n_val, training pixel j (in [0, n_train)) is sigma^-1(n_val + j). Only the
        (sorted) validation ids are listed, computed on the sampler's device."""
        self.n_val = split_size(n_pixels, float(self.cfg.val_fraction))
        self.n_train = n_pixels - self.n_val
        self._split_perm = FeistelPermutation(n_pixels, round_keys(int(self.cfg.split_seed), 0x5EED))
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        parts = [self._split_perm(torch.arange(lo, min(lo + _ID_CHUNK, self.n_val), device=dev), inverse=True)
                 for lo in range(0, self.n_val, _ID_CHUNK)]
        val = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=dev)
        self._val_ids_cpu = val.sort().values.cpu()
        self._train_ids_cpu = None  # listed only when asked for (train_ids)

    def _hashed_ids(self, epoch: int, lo: int, hi: int) -> torch.Tensor:
        """Pixel ids (CPU int64) at positions [lo, hi) of this rank's shard of ``epoch``: the
        epoch's permutation of the training positions, then the split's inverse."""
        pos = torch.arange(self.rank * self._units_per_rank + lo, self.rank * self._units_per_rank + hi)
        j = FeistelPermutation(self.n_train, round_keys(self.seed, epoch, 0xE90C))(pos)
        return self._split_perm(j + self.n_val, inverse=True)

    def _chunk_ids(self, epoch: int, chunk: int) -> torch.Tensor:
        """The ids of chunk ``chunk`` (HASHED_CHUNK_BATCHES batches) of ``epoch``, the next chunk's
        computation started in a background thread (pure CPU work, no CUDA call)."""
        size = HASHED_CHUNK_BATCHES * self._units_per_batch
        key = (epoch, chunk)
        fut = self._pending.pop(key, None)
        ids = fut.result() if fut is not None else self._hashed_ids(epoch, chunk * size,
                                                                    min((chunk + 1) * size, self._units_per_rank))
        for stale in list(self._pending):
            self._pending.pop(stale).cancel()
        nxt = (epoch, chunk + 1) if (chunk + 1) * size < self._units_per_rank else (epoch + 1, 0)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fasttomo-perm")
        lo = nxt[1] * size
        self._pending[nxt] = self._executor.submit(self._hashed_ids, nxt[0], lo, min(lo + size, self._units_per_rank))
        return ids

    def _patch_units(self, train_ids: torch.Tensor) -> torch.Tensor:
        """The tiles the epoch permutes (their top-left pixel ids) with sampler.patch_size = p > 1;
        sets the pixel offsets inside a tile and the per-pixel training weight."""
        cfg, p = self.cfg, self.patch_size
        n, h, w = self.shape
        if p > min(h, w):
            raise ConfigError(
                f"sampler.patch_size: {p} x {p} patches do not fit in the {h} x {w} images; "
                f"use sampler.patch_size <= {min(h, w)}."
            )
        rows = torch.minimum(torch.arange(0, h, p), torch.tensor(h - p))
        cols = torch.minimum(torch.arange(0, w, p), torch.tensor(w - p))
        corners = (rows[:, None] * w + cols[None, :]).reshape(-1)
        units = (torch.arange(n, dtype=torch.int64)[:, None] * self._hw + corners[None, :]).reshape(-1)
        dr, dc = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
        self._patch_offsets = (dr * w + dc).reshape(-1).to(torch.int64)
        # Per-pixel training weight: 1 for a training pixel (valid, if there is a mask), else 0.
        train_w = torch.zeros(n * self._hw, dtype=torch.uint8)
        train_w[train_ids] = 1
        if self._valid is not None:
            train_w &= torch.from_numpy(self._valid.view(np.uint8))
        self._train_weight = train_w
        if self._valid is not None and cfg.skip_masked:
            has = train_w[(units[:, None] + self._patch_offsets[None, :])].amax(dim=1) > 0
            units = units[has]
        return units

    # -- order ---------------------------------------------------------------------------------
    def _draw_positions(self, epoch: int) -> torch.Tensor:
        """Positions (into the units: sorted train ids, or tiles) of this rank's shard of ``epoch``."""
        perm = torch.randperm(self.n_units, generator=epoch_generator(self.seed, epoch), dtype=torch.int64)
        lo = self.rank * self._units_per_rank
        return perm[lo:lo + self._units_per_rank].clone()  # pure CPU work: no CUDA call off the main thread

    def _shard_positions(self, epoch: int, prefetch_next: bool = False) -> torch.Tensor:
        """Positions (into the units: sorted train ids, or tiles) of this rank's shard of ``epoch``,
        in order."""
        fut = self._pending.pop(epoch, None)
        pos = fut.result() if fut is not None else self._draw_positions(epoch)
        for stale in [e for e in self._pending if e != epoch + 1]:
            self._pending.pop(stale).cancel()
        if prefetch_next and (epoch + 1) not in self._pending:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fasttomo-perm")
            self._pending[epoch + 1] = self._executor.submit(self._draw_positions, epoch + 1)
        return pos

    def _batch_bounds(self, position: int) -> tuple[int, int]:
        """[lo, hi) of the units (pixels or tiles) of batch ``position`` in the epoch's order."""
        lo = position * self._units_per_batch
        return lo, min(lo + self._units_per_batch, self._units_per_rank)

    def _expand(self, units: torch.Tensor) -> torch.Tensor:
        """Pixel ids of ``units`` (tiles -> their P^2 pixels, row-major; pixels unchanged), CPU."""
        if self._patch_offsets is None:
            return units
        return (units[:, None] + self._patch_offsets[None, :]).reshape(-1)

    def _prepare(self) -> None:
        """Advance to the next epoch if this one is used up, and materialize the epoch's order."""
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        if self._ready_epoch != self.epoch:
            self._materialize(self.epoch)
            self._ready_epoch = self.epoch

    def _materialize(self, epoch: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- public API ------------------------------------------------------------------------------
    def next_batch(self) -> Batch:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (same on every rank; reshuffles)."""
        if not (isinstance(epoch, int) and epoch >= 0):
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epoch = epoch
        self.position = 0

    def val_batches(self, batch_size: int | None = None, max_rays: int | None = None) -> Iterator[Batch]:
        """The validation set (or, when it holds more than ``max_rays``, an even sample of it) in
        batches of ``batch_size``."""
        raise NotImplementedError

    def val_sample(self, max_rays: int | None) -> torch.Tensor:
        """Sorted validation ids to evaluate (CPU): all of them, or every k-th with the smallest k
        that leaves at most ``max_rays`` (spread evenly over every view; the same on every rank,
        every check and after a resume)."""
        ids = self._val_ids_cpu
        if max_rays is None or self.n_val <= max_rays:
            return ids
        return ids[:: -(-self.n_val // max(1, int(max_rays)))]

    @property
    def val_ids(self) -> torch.Tensor:
        """Sorted validation pixel ids (CPU int64), identical on all ranks."""
        return self._val_ids_cpu

    @property
    def train_ids(self) -> torch.Tensor:
        """Sorted training pixel ids (CPU int64), identical on all ranks (order=hashed: listed on
        this call, n_train ids)."""
        if self._train_ids_cpu is None:
            return self._split_perm(torch.arange(self.n_val, self.n_val + self.n_train), inverse=True).sort().values
        return self._train_ids_cpu

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "split_seed": int(self.cfg.split_seed),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "drop_last": int(self.drop_last),
            "n_train": self.n_train,
            "n_val": self.n_val,
            "shape": list(self.shape),
            "patch_size": self.patch_size,
            "order": self.order,
        }

    def state_dict(self) -> dict:
        """Plain ints/floats/strings/lists only (``torch.load(weights_only=True)`` safe).

        ``epoch`` and ``position`` are the same on every rank, so rank 0's state resumes all ranks.
        """
        return {
            "version": _STATE_VERSION,
            "kind": self.kind,
            "epoch": int(self.epoch),
            "position": int(self.position),
            "scale": float(self.scale),
            "data": self.data_digest,
            **self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly: the next batch is the one the saved sampler would have produced next.

        A state of either kind loads into either sampler (same order). Refuses states made with a
        different seed, split, data shape, batch size, drop_last or world size (the order differs).
        """
        if int(state.get("version", -1)) != _STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} != {_STATE_VERSION}.")
        mine = self._fingerprint()
        # states saved before patches (or the hashed order) existed were of single pixels, stored order
        state = {"patch_size": 1, "order": "stored", **state}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            details = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            hint = f" (here: sampler.order={state['order']})" if "order" in diff else ""
            raise ValueError(
                f"sampler state does not match this run ({details}); resume with the same seed, "
                f"sampler settings{hint}, data and number of processes as the saved run."
            )
        if state.get("data", self.data_digest) != self.data_digest:  # states before the digest: not checked
            raise ValueError(
                "the tilt series (its pixels or its angles) differs from the saved run's; resume on the same data "
                "(a moved or converted copy of the file is fine), or start a new run without resume=."
            )
        if abs(float(state["scale"]) - self.scale) > 1e-6 * max(1.0, abs(self.scale)):
            raise ValueError(
                f"sampler state scale {state['scale']!r} != {self.scale!r}: the tilt-series values "
                "differ from the saved run's; resume on the same data."
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if not (epoch >= 0 and 0 <= position <= self.batches_per_epoch):
            raise ValueError(f"sampler state epoch/position {epoch}/{position} out of range.")
        self.epoch = epoch
        self.position = position


DIGEST_SAMPLES = 4096
"""Pixels of the stack (evenly spaced over it) that :func:`data_digest` hashes."""


def data_digest(ts: TiltSeries) -> str:
    """A short hash of the prepared tilt series: 4096 pixels evenly spaced over the stack, its
    shape and its angles. A resume compares it with the saved run's, so a continuation is refused
    on other data (a flipped stack, another angle file), not only on another shape or scale; a
    mapped stack is read at those pixels only."""
    import hashlib

    flat = ts.stack.reshape(-1)
    step = max(1, flat.size // DIGEST_SAMPLES)
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(tuple(ts.stack.shape)).encode())
    h.update(np.ascontiguousarray(flat[::step][:DIGEST_SAMPLES], dtype=np.float32).tobytes())
    h.update(np.ascontiguousarray(ts.angles, dtype=np.float64).tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------- device
class DeviceBatchSampler(RaySampler):
    """Device-resident sampler: batches by index arithmetic and gathers, no host work per step.

    The normalized stack (float32), the validity mask (uint8, if any) and this rank's epoch order
    live on ``device``. ``next_batch`` copies the next ``batch_size`` ids into a persistent buffer,
    splits them into (tilt, row, col) with integer arithmetic and gathers targets and weights,
    all with ``out=`` into buffers allocated once. The returned :class:`Batch` therefore holds the
    **same tensor objects at the same addresses on every call** (fixed shapes: the step can be
    captured in a CUDA graph that reads them). Consumers must not keep references across steps:
    the next call overwrites them (``clone()`` what must survive). With ``drop_last=false`` the
    short last batch of an epoch is returned as views of the first rows of those buffers (a
    different shape, so CUDA-graph capture needs ``drop_last=true``). Once per epoch the order is
    drawn on the CPU (``torch.randperm``, the same on every rank; the next epoch's is prefetched
    in a background thread that makes no CUDA call), uploaded from pinned memory without a host
    sync and applied to the device-resident train ids (order=hashed: a chunk of batches' ids at a
    time, computed on the CPU and uploaded the same way). ``next_batch`` never synchronizes.
    """

    kind = "device"

    def __init__(self, ts: TiltSeries, cfg: SamplerConfig, *, seed: int, device: torch.device,
                 rank: int = 0, world_size: int = 1, offset: float = 0.0) -> None:
        super().__init__(ts, cfg, seed=seed, device=device, rank=rank, world_size=world_size, offset=offset)
        dev = self.device
        self._valid_d = None if self._valid is None else torch.from_numpy(self._valid.view(np.uint8)).to(dev)
        self._stack_d = self._device_stack()
        self._units_d = None if self._units_cpu is None else self._units_cpu.to(dev)
        self._order_d: torch.Tensor | None = None
        self._chunk: tuple[int, int] | None = None  # order=hashed: (epoch, chunk) held in _order_d
        if self._patch_offsets is not None:  # tiles: pixel offsets inside one, per-pixel training weight
            self._offsets_d = self._patch_offsets.to(dev)
            self._weight_src_d: torch.Tensor | None = self._train_weight.to(dev)
        else:
            self._weight_src_d = self._valid_d
        b = self.batch_size
        self._ids = torch.empty(b, dtype=torch.int64, device=dev)
        self._tmp = torch.empty(b, dtype=torch.int64, device=dev)
        self._mask_buf = None if self._weight_src_d is None else torch.empty(b, dtype=torch.uint8, device=dev)
        self._batch = Batch(
            tilt=torch.empty(b, dtype=torch.int64, device=dev),
            row=torch.empty(b, dtype=torch.int64, device=dev),
            col=torch.empty(b, dtype=torch.int64, device=dev),
            target=torch.empty(b, dtype=torch.float32, device=dev),
            weight=torch.ones(b, dtype=torch.float32, device=dev),
        )

    def _device_stack(self) -> torch.Tensor:
        """The normalized stack on the device: the same float32 values as :meth:`_host_stack`,
        without a second whole copy in host memory. On a GPU the stack's own values are uploaded a
        slab at a time and divided there (by the scale as a device tensor, which divides exactly as
        numpy does; a CPU scalar would multiply by its reciprocal); elsewhere each slab is
        normalized on the host."""
        n = int(self._stack.size)
        out = torch.empty(n, dtype=torch.float32, device=self.device)
        step = 1 << 24
        if self.device.type != "cuda" or self._stack.dtype != np.float32:
            for lo in range(0, n, step):
                out[lo:lo + step].copy_(torch.from_numpy(self._normalized(lo, min(n, lo + step))))
            return out
        flat = self._stack.reshape(-1)
        for lo in range(0, n, step):
            out[lo:lo + step].copy_(torch.from_numpy(np.ascontiguousarray(flat[lo:lo + step])))
        out.div_(torch.tensor(np.float32(self.scale), device=self.device))
        if self._valid_d is not None:
            out.masked_fill_(self._valid_d == 0, 0.0)
        return out

    def _materialize(self, epoch: int) -> None:
        if self.order == "hashed":  # computed a chunk of batches at a time in next_batch
            self._chunk = None
            return
        # Once per epoch: the permutation is drawn on the CPU (identical on all ranks, the next
        # one prefetched in a thread), sent over and applied to the device-resident train ids.
        pos = self._shard_positions(epoch, prefetch_next=True)
        if self.device.type == "cuda":  # pinned + non_blocking: the upload needs no host sync
            pos = pos.pin_memory().to(self.device, non_blocking=True)
        else:
            pos = pos.to(self.device)
        self._order_d = self._units_d[pos]

    def _fill(self, units: torch.Tensor) -> Batch:
        """Decode ``units`` (pixel ids, or tile corners of P x P patches, on the device) into the
        persistent buffers."""
        bt = self._batch
        if self._patch_offsets is None:
            n = units.shape[0]
            ids = self._ids[:n]
            ids.copy_(units)
        else:
            n = units.shape[0] * self._offsets_d.shape[0]
            ids = self._ids[:n]
            torch.add(units[:, None], self._offsets_d[None, :], out=ids.view(units.shape[0], -1))
        tmp = self._tmp[:n]
        tilt, row, col = bt.tilt[:n], bt.row[:n], bt.col[:n]
        torch.div(ids, self._hw, rounding_mode="floor", out=tilt)
        torch.mul(tilt, self._hw, out=tmp)
        torch.sub(ids, tmp, out=tmp)                       # offset inside the view
        torch.div(tmp, self._w, rounding_mode="floor", out=row)
        torch.mul(row, self._w, out=col)
        torch.sub(tmp, col, out=col)
        target = bt.target[:n]
        torch.index_select(self._stack_d, 0, ids, out=target)
        weight = bt.weight[:n]
        if self._weight_src_d is not None:
            m = self._mask_buf[:n]
            torch.index_select(self._weight_src_d, 0, ids, out=m)
            weight.copy_(m)
        if n == self.batch_size:
            return bt
        return Batch(tilt=tilt, row=row, col=col, target=target, weight=weight)

    def next_batch(self) -> Batch:
        self._prepare()
        lo, hi = self._batch_bounds(self.position)
        self.position += 1
        if self.order == "hashed":
            size = HASHED_CHUNK_BATCHES * self._units_per_batch
            chunk = lo // size
            if self._chunk != (self.epoch, chunk):
                ids = self._chunk_ids(self.epoch, chunk)
                if self.device.type == "cuda":
                    ids = ids.pin_memory()
                self._order_d = ids.to(self.device, non_blocking=True)
                self._chunk = (self.epoch, chunk)
            lo, hi = lo - chunk * size, hi - chunk * size
        return self._fill(self._order_d[lo:hi])

    def val_batches(self, batch_size: int | None = None, max_rays: int | None = None) -> Iterator[Batch]:
        """The validation set (:meth:`val_sample`) in sorted id order, fresh tensors (not the
        training buffers)."""
        bs = int(batch_size or self.batch_size)
        ids_all = self.val_sample(max_rays).to(self.device)
        for lo in range(0, ids_all.numel(), bs):
            ids = ids_all[lo:lo + bs]
            tilt = torch.div(ids, self._hw, rounding_mode="floor")
            rem = ids - tilt * self._hw
            row = torch.div(rem, self._w, rounding_mode="floor")
            col = rem - row * self._w
            target = self._stack_d[ids]
            if self._valid_d is None:
                weight = torch.ones(ids.shape[0], dtype=torch.float32, device=self.device)
            else:
                weight = self._valid_d[ids].to(torch.float32)
            yield Batch(tilt=tilt, row=row, col=col, target=target, weight=weight)


# --------------------------------------------------------------------------------------- dataloader
class PixelDataset(Dataset):
    """One item per pixel id: (tilt, row, col, target, weight) as Python numbers."""

    def __init__(self, stack_n: np.ndarray, valid: np.ndarray | None, shape: tuple[int, int, int]) -> None:
        self.stack_n = stack_n  # flat float32, already divided by the scale
        self.valid = valid      # flat bool or None
        self.hw = shape[1] * shape[2]
        self.w = shape[2]

    def __len__(self) -> int:
        return int(self.stack_n.size)

    def __getitem__(self, p: int) -> tuple[int, int, int, float, float]:
        p = int(p)
        tilt, rem = divmod(p, self.hw)
        row, col = divmod(rem, self.w)
        weight = 1.0 if self.valid is None else float(self.valid[p])
        return tilt, row, col, float(self.stack_n[p]), weight


def collate_pixels(items: list[tuple[int, int, int, float, float]]) -> Batch:
    tilt, row, col, target, weight = zip(*items)
    return Batch(
        tilt=torch.tensor(tilt, dtype=torch.int64),
        row=torch.tensor(row, dtype=torch.int64),
        col=torch.tensor(col, dtype=torch.int64),
        target=torch.tensor(target, dtype=torch.float32),  # float32 -> float -> float32 is exact
        weight=torch.tensor(weight, dtype=torch.float32),
    )


class _IdSequence(Sampler):
    """Yields a fixed sequence of pixel ids (an epoch shard from some position, or the val set)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return int(self.ids.numel())

    def __iter__(self):
        return iter(self.ids.tolist())


class DataLoaderSampler(RaySampler):
    """The per-pixel ``torch.utils.data.DataLoader`` path (``sampler=dataloader``), for comparison.

    Same order and contents as :class:`DeviceBatchSampler`; each batch costs ``batch_size``
    ``__getitem__`` calls, a collate and a host-to-device copy. Returns fresh tensors.
    """

    kind = "dataloader"

    def __init__(self, ts: TiltSeries, cfg: SamplerConfig, *, seed: int, device: torch.device,
                 rank: int = 0, world_size: int = 1, offset: float = 0.0) -> None:
        super().__init__(ts, cfg, seed=seed, device=device, rank=rank, world_size=world_size, offset=offset)
        stack_n = self._host_stack()
        self.dataset = PixelDataset(stack_n, self._valid, self.shape)
        # Patches carry validation (and masked) pixels with weight 0: their own weights in training.
        self._train_dataset = (self.dataset if self._train_weight is None else
                               PixelDataset(stack_n, self._train_weight.numpy().astype(bool), self.shape))
        self._iter = None
        self._iter_key: tuple[int, int] | None = None  # (epoch, position) the iterator is at
        self._pin = self.device.type == "cuda"

    def _loader(self, ids: torch.Tensor, batch_size: int, drop_last: bool, train: bool = False) -> DataLoader:
        nw = int(self.cfg.num_workers)
        dataset = self._train_dataset if train else self.dataset
        return DataLoader(dataset, batch_size=batch_size, sampler=_IdSequence(ids), drop_last=drop_last,
                          num_workers=nw, collate_fn=collate_pixels, pin_memory=self._pin,
                          persistent_workers=False)

    def _materialize(self, epoch: int) -> None:
        self._iter = None  # built lazily in next_batch from (epoch, position)
        # No prefetch thread when worker processes are forked (fork + threads can deadlock).
        if self.order == "hashed":
            self._order_cpu = self._hashed_ids(epoch, 0, self._units_per_rank)
            return
        pos = self._shard_positions(epoch, prefetch_next=int(self.cfg.num_workers) == 0)
        self._order_cpu = self._expand(self._units_cpu[pos])  # pixel ids in visiting order

    def _to_device(self, b: Batch) -> Batch:
        nb = self._pin
        return Batch(*(t.to(self.device, non_blocking=nb) for t in (b.tilt, b.row, b.col, b.target, b.weight)))

    def next_batch(self) -> Batch:
        self._prepare()
        if self._iter is None or self._iter_key != (self.epoch, self.position):
            lo = self.position * self.batch_size
            order = self._order_cpu[lo:]
            self._iter = iter(self._loader(order, self.batch_size, self.drop_last, train=True))
        batch = next(self._iter)
        self.position += 1
        self._iter_key = (self.epoch, self.position)
        return self._to_device(batch)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self._iter = None

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._iter = None

    def val_batches(self, batch_size: int | None = None, max_rays: int | None = None) -> Iterator[Batch]:
        bs = int(batch_size or self.batch_size)
        for b in self._loader(self.val_sample(max_rays), bs, False):
            yield self._to_device(b)


# --------------------------------------------------------------------------------------- factory
def build_sampler(ts: TiltSeries, cfg: SamplerConfig, *, seed: int, device: torch.device,
                  rank: int = 0, world_size: int = 1, offset: float = 0.0) -> RaySampler:
    """The sampler named by ``cfg.kind`` (device or dataloader) for this rank's shard; ``offset``
    is the background taken out of the scale (see :func:`robust_scale`)."""
    cls = {"device": DeviceBatchSampler, "dataloader": DataLoaderSampler}.get(cfg.kind)
    if cls is None:
        raise ConfigError(f"sampler.kind: must be device or dataloader, got {cfg.kind!r}.")
    return cls(ts, cfg, seed=seed, device=torch.device(device), rank=rank, world_size=world_size, offset=offset)
