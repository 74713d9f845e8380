"""sampler.order=hashed (the order of series above 2^24 pixels): keyed permutations, split, epoch
coverage, shards, parity of the two samplers, resume across chunk boundaries (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fasttomo.config import ConfigError, SamplerConfig
from fasttomo.data.permutation import FeistelPermutation, round_keys
from fasttomo.data.sampler import (
    HASHED_CHUNK_BATCHES,
    HASHED_MIN_PIXELS,
    DataLoaderSampler,
    DeviceBatchSampler,
    order_of,
    split_size,
)
from fasttomo.data.tiltseries import TiltSeries
from sampler_helpers import random_series

CPU = torch.device("cpu")


def make_ts(n=5, h=24, w=28, seed=0, valid=False) -> TiltSeries:
    return random_series(n, h, w, seed, valid)


def cfg(**kw) -> SamplerConfig:
    base = dict(batch_size=8, val_fraction=0.1, split_seed=7, drop_last=True, order="hashed")
    base.update(kw)
    return SamplerConfig(**base)


def ids(b) -> torch.Tensor:
    return b.tilt * 24 * 28 + b.row * 28 + b.col


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 4097, 65536])
def test_feistel_is_a_bijection_with_its_inverse(n):
    perm = FeistelPermutation(n, round_keys(3, n))
    x = torch.arange(n)
    y = perm(x.clone())
    assert torch.equal(y.sort().values, x)                        # every value once, all inside [0, n)
    assert torch.equal(perm(y.clone(), inverse=True), x)
    if n >= 1000:  # a shuffle, not a shift: positions move far, and another key gives another order
        assert (y - x).abs().float().mean() > n / 5
        assert not torch.equal(FeistelPermutation(n, round_keys(4, n))(x.clone()), y)


def test_round_keys_are_a_pure_function_of_their_words():
    assert round_keys(1, 2) == round_keys(1, 2) != round_keys(2, 1)
    assert all(0 <= k < 2**31 for k in round_keys(123456789, 2**40))


def test_order_is_chosen_by_size_and_falls_back_where_hashed_cannot_serve():
    c = SamplerConfig()
    assert order_of(c, HASHED_MIN_PIXELS, False) == "stored"
    assert order_of(c, HASHED_MIN_PIXELS + 1, False) == "hashed"
    assert order_of(SamplerConfig(order="stored"), 2**30, False) == "stored"
    assert order_of(SamplerConfig(order="hashed"), 100, False) == "hashed"
    assert order_of(SamplerConfig(order="hashed", skip_masked=True), 100, True) == "stored"
    with pytest.raises(ConfigError, match="sampler.order"):
        SamplerConfig(order="hashed", patch_size=2, batch_size=16)
    with pytest.raises(ConfigError, match="stored, hashed or null"):
        SamplerConfig(order="random")


def test_split_partitions_the_pixels_and_an_epoch_visits_each_training_pixel_once():
    ts = make_ts()
    s = DeviceBatchSampler(ts, cfg(drop_last=False), seed=0, device=CPU)
    n = ts.stack.size
    assert s.order == "hashed" and s.n_val == split_size(n, 0.1) and s.n_train == n - s.n_val
    train, val = s.train_ids, s.val_ids
    assert torch.equal(torch.cat([train, val]).sort().values, torch.arange(n))
    seen = torch.cat([ids(s.next_batch()).clone() for _ in range(s.batches_per_epoch)])
    assert torch.equal(seen.sort().values, train)                  # every training pixel once, no validation one
    assert s.batches_per_epoch > HASHED_CHUNK_BATCHES             # the epoch crossed chunk boundaries
    again = torch.cat([ids(s.next_batch()).clone() for _ in range(3)])
    assert not torch.equal(again, seen[:24])                       # the next epoch has its own order


def test_targets_are_the_normalized_pixels_and_masks_weigh_zero():
    ts = make_ts(valid=True)
    s = DeviceBatchSampler(ts, cfg(), seed=1, device=CPU)
    b = s.next_batch()
    flat, valid = ts.stack.reshape(-1), ts.valid.reshape(-1)
    p = ids(b).numpy()
    want = np.where(valid[p], flat[p] / np.float32(s.scale), np.float32(0))
    assert np.array_equal(b.target.numpy(), want.astype(np.float32))
    assert np.array_equal(b.weight.numpy(), valid[p].astype(np.float32))


def test_device_and_dataloader_agree_and_the_split_ignores_the_run_seed():
    ts = make_ts()
    dev = DeviceBatchSampler(ts, cfg(), seed=5, device=CPU)
    dl = DataLoaderSampler(ts, _dl_cfg(), seed=5, device=CPU)
    for _ in range(HASHED_CHUNK_BATCHES + 5):
        a, b = dev.next_batch(), dl.next_batch()
        for x, y in zip((a.tilt, a.row, a.col, a.target, a.weight), (b.tilt, b.row, b.col, b.target, b.weight)):
            assert torch.equal(x, y)
    other = DeviceBatchSampler(ts, cfg(), seed=6, device=CPU)
    assert torch.equal(other.val_ids, dev.val_ids)
    assert not torch.equal(ids(other.next_batch()), ids(DeviceBatchSampler(ts, cfg(), seed=5, device=CPU).next_batch()))
    assert not torch.equal(DeviceBatchSampler(ts, cfg(split_seed=8), seed=5, device=CPU).val_ids, dev.val_ids)


def _dl_cfg():
    from fasttomo.config import DataLoaderSamplerConfig

    return DataLoaderSamplerConfig(batch_size=8, val_fraction=0.1, split_seed=7, drop_last=True, order="hashed")


def test_shards_are_disjoint_and_within_training():
    ts = make_ts()
    shards = [DeviceBatchSampler(ts, cfg(), seed=2, device=CPU, rank=r, world_size=3) for r in range(3)]
    got = [torch.cat([ids(s.next_batch()).clone() for _ in range(s.batches_per_epoch)]) for s in shards]
    allids = torch.cat(got)
    assert allids.unique().numel() == allids.numel()
    assert set(allids.tolist()) <= set(shards[0].train_ids.tolist())


def test_resume_inside_and_across_chunks_is_exact_and_the_order_is_in_the_state():
    ts = make_ts()
    ref = DeviceBatchSampler(ts, cfg(), seed=3, device=CPU)
    for stop in (7, HASHED_CHUNK_BATCHES - 1, HASHED_CHUNK_BATCHES + 2):
        a = DeviceBatchSampler(ts, cfg(), seed=3, device=CPU)
        for _ in range(stop):
            a.next_batch()
        b = DeviceBatchSampler(ts, cfg(), seed=3, device=CPU)
        b.load_state_dict(a.state_dict())
        for _ in range(4):
            assert torch.equal(ids(a.next_batch()), ids(b.next_batch()))
    state = ref.state_dict()
    assert state["order"] == "hashed"
    with pytest.raises(ValueError, match=r"order: saved 'hashed' vs now 'stored'.*sampler.order=hashed"):
        DeviceBatchSampler(ts, cfg(order="stored"), seed=3, device=CPU).load_state_dict(state)


def test_validation_sample_is_every_kth_sorted_validation_pixel():
    ts = make_ts()
    s = DeviceBatchSampler(ts, cfg(), seed=0, device=CPU)
    k = -(-s.n_val // 50)
    got = torch.cat([ids(b) for b in s.val_batches(16, 50)])
    assert torch.equal(got, s.val_ids[::k])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampler_draws_the_cpu_samplers_batches():
    ts = make_ts(valid=True)
    cpu = DeviceBatchSampler(ts, cfg(), seed=4, device=CPU)
    gpu = DeviceBatchSampler(ts, cfg(), seed=4, device=torch.device("cuda"))
    assert torch.equal(cpu.val_ids, gpu.val_ids)  # the split's inverse computed on the GPU
    for _ in range(HASHED_CHUNK_BATCHES + 3):
        a, b = cpu.next_batch(), gpu.next_batch()
        for x, y in zip((a.tilt, a.row, a.col, a.target, a.weight), (b.tilt, b.row, b.col, b.target, b.weight)):
            assert torch.equal(x, y.cpu())
