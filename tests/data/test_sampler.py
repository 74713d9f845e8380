"""RaySampler: device vs DataLoader parity, epoch coverage, split, masks and exact resume (CPU)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from fasttomo.config import ConfigError, SamplerConfig
from fasttomo.data.sampler import (
    Batch,
    DataLoaderSampler,
    DeviceBatchSampler,
    build_sampler,
    robust_scale,
)
from fasttomo.data.tiltseries import TiltSeries
from sampler_helpers import random_series

CPU = torch.device("cpu")


def make_ts(n=3, h=10, w=13, seed=0, valid=False) -> TiltSeries:
    return random_series(n, h, w, seed, valid)


def cfg(**kw) -> SamplerConfig:
    base = dict(batch_size=16, val_fraction=0.1, split_seed=7, drop_last=True)
    base.update(kw)
    return SamplerConfig(**base)


def ids_of(b: Batch, shape) -> torch.Tensor:
    _, h, w = shape
    return b.tilt * h * w + b.row * w + b.col


def snap(b: Batch) -> tuple:
    return tuple(t.clone() for t in (b.tilt, b.row, b.col, b.target, b.weight))


def assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_device_matches_dataloader_across_epochs(drop_last, masked):
    ts = make_ts(valid=masked)
    c = cfg(drop_last=drop_last)
    dev = build_sampler(ts, c, seed=3, device=CPU)
    dl = build_sampler(ts, SamplerConfig(**{**c.__dict__, "kind": "dataloader"}), seed=3, device=CPU)
    assert isinstance(dev, DeviceBatchSampler) and isinstance(dl, DataLoaderSampler)
    assert dev.scale == dl.scale and dev.batches_per_epoch == dl.batches_per_epoch
    n_steps = 2 * dev.batches_per_epoch + 3  # crosses two epoch boundaries
    for _ in range(n_steps):
        a, b = snap(dev.next_batch()), snap(dl.next_batch())
        assert_same(a, b)
    assert dev.epoch == dl.epoch == 2
    for va, vb in zip(dev.val_batches(10), dl.val_batches(10), strict=True):
        assert_same(snap(va), snap(vb))


def test_dataloader_with_workers_matches_device():
    ts = make_ts()
    dev = build_sampler(ts, cfg(), seed=5, device=CPU)
    dl = build_sampler(ts, cfg(kind="dataloader", num_workers=1), seed=5, device=CPU)
    for _ in range(dev.batches_per_epoch + 2):
        assert_same(snap(dev.next_batch()), snap(dl.next_batch()))


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_stack_is_the_host_normalization_bit_for_bit(masked):
    """On a GPU the stack is uploaded as it is and divided there (two upload slabs here): the
    float32 values, bit for bit, of the host's normalization (numpy's division, masked pixels 0)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ts = random_series(5, 1900, 1800, seed=3, valid=masked)  # 17.1 M pixels: more than one slab of 2^24
    s = DeviceBatchSampler(ts, cfg(), seed=0, device=torch.device("cuda"))
    host = s._host_stack()
    assert np.array_equal(s._stack_d.cpu().numpy().view(np.uint32), host.view(np.uint32))
    assert (host == 0).any() == masked


def test_batch_contents_are_the_pixels():
    ts = make_ts(valid=True)
    s = build_sampler(ts, cfg(), seed=1, device=CPU)
    b = s.next_batch()
    stack = torch.from_numpy(ts.stack)
    valid = torch.from_numpy(ts.valid)
    exp_w = valid[b.tilt, b.row, b.col].float()
    assert torch.equal(b.weight, exp_w)
    v = exp_w.bool()
    assert torch.allclose(b.target[v], stack[b.tilt, b.row, b.col][v] / s.scale, rtol=1e-6, atol=0)
    assert torch.all(b.target[~v] == 0)
    assert b.tilt.dtype == torch.int64 and b.target.dtype == torch.float32 and b.weight.dtype == torch.float32


@pytest.mark.parametrize("kind", ["device", "dataloader"])
def test_every_training_pixel_once_per_epoch_and_never_validation(kind):
    ts = make_ts()
    s = build_sampler(ts, cfg(kind=kind, drop_last=False), seed=11, device=CPU)
    train, val = set(s.train_ids.tolist()), set(s.val_ids.tolist())
    n_pix = ts.stack.size
    assert not train & val and len(train | val) == n_pix
    assert s.n_train + s.n_val == n_pix and s.n_val == round(0.1 * n_pix)
    for epoch in range(2):
        seen = []
        for _ in range(s.batches_per_epoch):
            seen += ids_of(s.next_batch(), ts.stack.shape).tolist()
        assert s.epoch == epoch
        assert sorted(seen) == sorted(train)  # each training pixel exactly once
    assert sorted(ids_of(b, ts.stack.shape).tolist()[0] for b in s.val_batches(1)) == sorted(val)


def test_drop_last_drops_ragged_batch_and_epochs_reshuffle():
    ts = make_ts()
    s = build_sampler(ts, cfg(drop_last=True), seed=2, device=CPU)
    assert s.batches_per_epoch == s.n_train // 16
    first = [ids_of(s.next_batch(), ts.stack.shape).clone() for _ in range(s.batches_per_epoch)]
    assert all(len(x) == 16 for x in first)
    assert len(torch.cat(first).unique()) == 16 * s.batches_per_epoch
    second = ids_of(s.next_batch(), ts.stack.shape)
    assert s.epoch == 1 and not torch.equal(second, first[0])
    s.set_epoch(0)
    assert torch.equal(ids_of(s.next_batch(), ts.stack.shape), first[0])


def test_device_buffers_are_persistent():
    ts = make_ts()
    s = build_sampler(ts, cfg(), seed=0, device=CPU)
    b1 = s.next_batch()
    ptrs = [t.data_ptr() for t in (b1.tilt, b1.row, b1.col, b1.target, b1.weight)]
    for _ in range(s.batches_per_epoch + 1):  # across an epoch boundary
        b = s.next_batch()
        assert b is b1
        assert [t.data_ptr() for t in (b.tilt, b.row, b.col, b.target, b.weight)] == ptrs
        assert b.tilt.shape == (16,)


def test_val_set_independent_of_seed_and_rank():
    ts = make_ts()
    ref = build_sampler(ts, cfg(), seed=0, device=CPU)
    ref_val = [snap(b) for b in ref.val_batches()]
    for seed, rank, ws, kind in [(1, 0, 1, "device"), (99, 1, 2, "device"), (5, 2, 3, "dataloader")]:
        s = build_sampler(ts, cfg(kind=kind), seed=seed, device=CPU, rank=rank, world_size=ws)
        assert torch.equal(s.val_ids, ref.val_ids)
        got = [snap(b) for b in s.val_batches()]
        assert len(got) == len(ref_val)
        for a, b in zip(got, ref_val):
            assert_same(a, b)
    other = build_sampler(ts, cfg(split_seed=8), seed=0, device=CPU)
    assert not torch.equal(other.val_ids, ref.val_ids)


def test_shards_disjoint_equal_and_within_train():
    ts = make_ts(n=3, h=7, w=9)  # 189 pixels, 170 train: not divisible by 3
    shards = [build_sampler(ts, cfg(batch_size=8), seed=4, device=CPU, rank=r, world_size=3) for r in range(3)]
    assert shards[0].n_train % 3 != 0
    counts = {s.batches_per_epoch for s in shards}
    assert len(counts) == 1
    ids = [torch.cat([ids_of(s.next_batch(), ts.stack.shape).clone() for _ in range(s.batches_per_epoch)])
           for s in shards]
    assert len({len(x) for x in ids}) == 1
    allids = torch.cat(ids)
    assert len(allids.unique()) == len(allids)
    assert set(allids.tolist()) <= set(shards[0].train_ids.tolist())
    # shard r is the r-th contiguous slice of the permutation every rank draws
    one = build_sampler(ts, cfg(batch_size=8), seed=4, device=CPU)
    def epoch_order(s, epoch):  # a rank's training ids of an epoch, in visiting order
        return s._train_ids_cpu[s._draw_positions(epoch)]

    perm_all = epoch_order(one, 0)
    npr = one.n_train // 3
    for r in range(3):
        assert torch.equal(epoch_order(shards[r], 0), perm_all[r * npr:(r + 1) * npr])


@pytest.mark.parametrize("kind,resume_kind", [("device", "device"), ("dataloader", "dataloader"),
                                              ("device", "dataloader")])
def test_state_dict_resume_mid_epoch_is_exact(kind, resume_kind):
    ts = make_ts()
    a = build_sampler(ts, cfg(kind=kind), seed=21, device=CPU)
    k = a.batches_per_epoch + 2  # mid second epoch
    for _ in range(k):
        a.next_batch()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    expected = [snap(a.next_batch()) for _ in range(a.batches_per_epoch + 1)]  # crosses the next boundary
    b = build_sampler(ts, cfg(kind=resume_kind), seed=21, device=CPU)
    b.next_batch()  # a fresh sampler with some history of its own
    b.load_state_dict(state)
    for e in expected:
        assert_same(snap(b.next_batch()), e)


def test_resume_at_epoch_end_and_mismatch_refused():
    ts = make_ts()
    a = build_sampler(ts, cfg(), seed=3, device=CPU)
    for _ in range(a.batches_per_epoch):
        a.next_batch()
    state = a.state_dict()
    nxt = snap(a.next_batch())
    b = build_sampler(ts, cfg(), seed=3, device=CPU)
    b.load_state_dict(state)
    assert_same(snap(b.next_batch()), nxt)
    assert b.epoch == 1
    with pytest.raises(ValueError, match="seed"):
        build_sampler(ts, cfg(), seed=4, device=CPU).load_state_dict(state)
    with pytest.raises(ValueError, match="world_size"):
        build_sampler(ts, cfg(), seed=3, device=CPU, rank=0, world_size=2).load_state_dict(state)


def test_skip_masked_keeps_split_and_drops_masked():
    ts = make_ts(valid=True)
    keep = build_sampler(ts, cfg(), seed=0, device=CPU)
    skip = build_sampler(ts, cfg(skip_masked=True), seed=0, device=CPU)
    valid = torch.from_numpy(ts.valid.reshape(-1))
    assert torch.equal(skip.train_ids, keep.train_ids[valid[keep.train_ids]])
    assert torch.equal(skip.val_ids, keep.val_ids[valid[keep.val_ids]])
    for _ in range(skip.batches_per_epoch):
        assert torch.all(skip.next_batch().weight == 1)


def test_scale_is_robust_and_guards():
    x = np.ones((2, 50, 50), np.float32)
    x[0, 0, 0] = 1e6  # one hot pixel does not set the scale
    assert robust_scale(x) == 1.0
    assert robust_scale(np.zeros((2, 3, 3), np.float32)) == 1.0
    with pytest.raises(ConfigError, match="batch_size"):
        build_sampler(make_ts(n=2, h=3, w=3), cfg(batch_size=64), seed=0, device=CPU)
    with pytest.raises(ConfigError, match="num_workers"):
        SamplerConfig(kind="dataloader", num_workers=-1)


# --------------------------------------------------------------------------------------- patches
def tiles_of(b: Batch, p: int) -> list[tuple[int, int, int]]:
    """(view, top row, left col) of each P x P tile of a patch batch, checking that each tile's P^2
    consecutive rays are one view's neighbouring pixels in row-major order."""
    out = []
    for k in range(len(b) // (p * p)):
        sl = slice(k * p * p, (k + 1) * p * p)
        t, r, c = b.tilt[sl], b.row[sl], b.col[sl]
        assert torch.all(t == t[0])
        dr, dc = torch.meshgrid(torch.arange(p), torch.arange(p), indexing="ij")
        assert torch.equal(r - r[0], dr.reshape(-1)) and torch.equal(c - c[0], dc.reshape(-1))
        out.append((int(t[0]), int(r[0]), int(c[0])))
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_patch_epoch_covers_every_training_pixel_with_validation_weighted_zero(masked):
    ts = make_ts(n=3, h=10, w=13, valid=masked)  # 3 does not divide 10 or 13: the last tiles overlap
    s = build_sampler(ts, cfg(batch_size=18, patch_size=3, drop_last=False), seed=5, device=CPU)
    _, h, w = ts.stack.shape
    assert s.n_units == 3 * 4 * 5 and s.batches_per_epoch == -(-60 // 2)
    seen, tiles = {}, []
    val = set(s.val_ids.tolist())
    for _ in range(s.batches_per_epoch):
        b = s.next_batch()
        tiles += tiles_of(b, 3)
        for i, wgt, tgt in zip(ids_of(b, ts.stack.shape).tolist(), b.weight.tolist(), b.target.tolist()):
            expect = 0.0 if (i in val or (masked and not ts.valid.reshape(-1)[i])) else 1.0
            assert wgt == expect, i
            assert tgt == pytest.approx(float(ts.stack.reshape(-1)[i]) / s.scale if (not masked or ts.valid.reshape(-1)[i]) else 0.0)
            seen[i] = max(seen.get(i, 0.0), wgt)
    # every tile once, on the fixed grid (corners min(aP, H-P), min(bP, W-P))
    grid = {(v, min(a, h - 3), min(c, w - 3)) for v in range(3) for a in range(0, h, 3) for c in range(0, w, 3)}
    assert sorted(tiles) == sorted(grid)
    # every pixel of the series is in some tile; each training pixel is trained on (weight 1)
    assert set(seen) == set(range(ts.stack.size))
    trainable = {i for i in s.train_ids.tolist() if not masked or ts.valid.reshape(-1)[i]}
    assert {i for i, wgt in seen.items() if wgt == 1.0} == trainable
    assert s.next_batch() is not None and s.epoch == 1  # moves on to the next epoch by itself


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_patch_device_matches_dataloader(drop_last, masked):
    ts = make_ts(n=4, h=12, w=9, valid=masked)
    dev = build_sampler(ts, cfg(batch_size=32, patch_size=4, drop_last=drop_last), seed=2, device=CPU)
    dl = build_sampler(ts, cfg(kind="dataloader", batch_size=32, patch_size=4, drop_last=drop_last), seed=2, device=CPU)
    for _ in range(2 * dev.batches_per_epoch + 1):
        assert_same(snap(dev.next_batch()), snap(dl.next_batch()))
    for a, b in zip(dev.val_batches(), dl.val_batches()):  # validation: the pixel split, valid weights
        assert_same(snap(a), snap(b))
    assert torch.equal(torch.cat([ids_of(b, ts.stack.shape) for b in dev.val_batches()]), dev.val_ids)


def test_patch_order_is_the_tile_permutation_and_reshuffles():
    ts = make_ts(n=2, h=8, w=8)
    s = build_sampler(ts, cfg(batch_size=16, patch_size=4), seed=9, device=CPU)
    e0 = [t for _ in range(s.batches_per_epoch) for t in tiles_of(s.next_batch(), 4)]
    e1 = [t for _ in range(s.batches_per_epoch) for t in tiles_of(s.next_batch(), 4)]
    assert sorted(e0) == sorted(e1) and e0 != e1 and len(e0) == 8


def test_patch_shards_disjoint_and_resume_exact():
    ts = make_ts(n=4, h=12, w=12)
    shards = [build_sampler(ts, cfg(batch_size=9, patch_size=3), seed=1, device=CPU, rank=r, world_size=2)
              for r in range(2)]
    tiles = [[t for _ in range(s.batches_per_epoch) for t in tiles_of(s.next_batch(), 3)] for s in shards]
    assert len(tiles[0]) == len(tiles[1]) == 32 and not set(tiles[0]) & set(tiles[1])
    a = build_sampler(ts, cfg(batch_size=9, patch_size=3), seed=1, device=CPU)
    for _ in range(a.batches_per_epoch + 3):
        a.next_batch()
    state = a.state_dict()
    assert state["patch_size"] == 3
    expected = [snap(a.next_batch()) for _ in range(a.batches_per_epoch)]
    b = build_sampler(ts, cfg(kind="dataloader", batch_size=9, patch_size=3), seed=1, device=CPU)
    b.load_state_dict(state)
    for e in expected:
        assert_same(snap(b.next_batch()), e)
    with pytest.raises(ValueError, match="patch_size"):
        build_sampler(ts, cfg(batch_size=9), seed=1, device=CPU).load_state_dict(state)


def test_state_saved_before_patches_resumes_single_pixels():
    ts = make_ts()
    a = build_sampler(ts, cfg(), seed=3, device=CPU)
    a.next_batch()
    state = a.state_dict()
    del state["patch_size"]  # what a checkpoint written before sampler.patch_size holds
    nxt = snap(a.next_batch())
    b = build_sampler(ts, cfg(), seed=3, device=CPU)
    b.load_state_dict(state)
    assert_same(snap(b.next_batch()), nxt)
    with pytest.raises(ValueError, match="patch_size"):
        build_sampler(ts, cfg(batch_size=16, patch_size=2), seed=3, device=CPU).load_state_dict(state)


def test_patch_skip_masked_drops_tiles_without_training_pixels():
    ts = make_ts(n=2, h=8, w=8)
    ts.valid = np.ones(ts.stack.shape, bool)
    ts.valid[0, :4, :4] = False  # one whole tile of view 0 masked
    keep = build_sampler(ts, cfg(batch_size=16, patch_size=4, drop_last=False), seed=0, device=CPU)
    skip = build_sampler(ts, cfg(batch_size=16, patch_size=4, drop_last=False, skip_masked=True), seed=0, device=CPU)
    assert keep.n_units == 8 and skip.n_units == 7
    tiles = [t for _ in range(skip.batches_per_epoch) for t in tiles_of(skip.next_batch(), 4)]
    assert (0, 0, 0) not in tiles and len(tiles) == 7


def test_patch_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match=r"sampler.batch_size: 1000 rays is not a whole number of 8 x 8 .* multiple of 64"):
        SamplerConfig(batch_size=1000, patch_size=8)
    for bad in (0, 65, 2.0, True):
        with pytest.raises(ConfigError, match="sampler.patch_size"):
            SamplerConfig(patch_size=bad)
    with pytest.raises(ConfigError, match=r"sampler.patch_size: 16 x 16 patches do not fit in the 10 x 13 images"):
        build_sampler(make_ts(), cfg(batch_size=256, patch_size=16), seed=0, device=CPU)
    from fasttomo.run.build import auto_batch_size

    big = make_ts(n=61, h=64, w=64)
    auto = SamplerConfig()
    assert auto_batch_size(big, auto) == 1024 and auto_batch_size(big, SamplerConfig(patch_size=8)) == 1024
    assert auto_batch_size(big, SamplerConfig(patch_size=3)) == 1026 and auto_batch_size(big, SamplerConfig(patch_size=64)) == 4096


def test_automatic_batch_of_a_tiny_series_is_its_training_pixels():
    """A series smaller than one automatic batch (11 views of 3 x 3: 99 pixels, 2 held out) trains
    on all its training pixels a step (per rank; whole patches) instead of being refused."""
    from fasttomo.run.build import auto_batch_size

    tiny = make_ts(n=11, h=3, w=3)
    assert auto_batch_size(tiny, SamplerConfig()) == 97
    assert auto_batch_size(tiny, SamplerConfig(), world_size=2) == 48
    assert auto_batch_size(tiny, SamplerConfig(patch_size=2)) == 96
    s = build_sampler(tiny, SamplerConfig(batch_size=auto_batch_size(tiny, SamplerConfig())), seed=0, device=CPU)
    assert s.next_batch().tilt.numel() == 97


def test_the_dry_runs_batch_of_a_tiny_series_is_one_ranks_under_torchrun(monkeypatch):
    """The plan (dry run, memory check) sizes the batch of a tiny series as the run does: one
    rank's training pixels, the ranks read from torchrun's WORLD_SIZE before any process group."""
    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.run.preflight import planned_shape

    tiny = make_ts(n=11, h=3, w=3)
    cfg = compose_config(["runtime=cpu"])
    assert planned_shape(cfg, tiny).batch == 97
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert planned_shape(cfg, tiny).batch == 48


@pytest.mark.parametrize("kind", ["device", "dataloader"])
def test_validation_sample_is_even_bounded_and_whole_when_small(kind):
    """A validation set larger than the budget is evaluated on every k-th id (the smallest k that
    fits), spread over every view; one within the budget is evaluated whole (issue 26)."""
    from fasttomo.config import DataLoaderSamplerConfig
    from fasttomo.data.sampler import build_sampler

    rng = np.random.default_rng(0)
    ts = TiltSeries(stack=rng.random((9, 16, 20)).astype(np.float32), angles=np.linspace(-60, 60, 9), pixel_size=1.0,
                    source="test")
    cfg_cls = SamplerConfig if kind == "device" else DataLoaderSamplerConfig
    s = build_sampler(ts, cfg_cls(batch_size=64, val_fraction=0.2), seed=0,
                      device=torch.device("cpu"))
    whole = torch.cat([b.tilt * 320 + b.row * 20 + b.col for b in s.val_batches(50)])
    assert torch.equal(whole, s.val_ids) and s.n_val == 576
    sample = torch.cat([b.tilt * 320 + b.row * 20 + b.col for b in s.val_batches(50, max_rays=100)])
    assert torch.equal(sample, s.val_ids[::6]) and sample.numel() == 96   # k = ceil(576 / 100) = 6
    assert set(torch.div(sample, 320, rounding_mode="floor").tolist()) == set(range(9))  # every view
    assert torch.equal(torch.cat([b.tilt * 320 + b.row * 20 + b.col for b in s.val_batches(50, 576)]), s.val_ids)
