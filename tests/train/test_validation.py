"""Validation chunks: bigger than the training batch where the field's decoder inputs allow it,
bounded by trainer.VAL_CHUNK_FLOATS, and the same validation loss whatever the chunking."""

from __future__ import annotations

import pytest
import torch

from fasttomo.run.build import build, make_trainer
from fasttomo.data.load import load_tiltseries
from fasttomo.cli.reconstruct import compose_config
from fasttomo.train import trainer as trainer_mod

TINY = ["experiment=quick", "logging=quiet", "runtime=cpu", "runtime.threads=1", "data.width=24", "data.height=24",
        "data.n_tilts=9", "model.resolutions=[8]", "sampler.batch_size=128", "projector.samples_per_ray=16",
        "sampler.val_fraction=0.15"]  # 777 pixels: 6 batches, within the budget of VAL_BUDGET_BATCHES


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = compose_config(TINY + [f"output.dir={tmp_path_factory.mktemp('val')}"])
    ts = load_tiltseries(cfg.data)
    tr = make_trainer(build(cfg, ts), None)
    tr.fit(steps=5)
    return tr


def _manual_mean(tr, rays: int) -> tuple[float, int]:
    """The per-pixel validation loss averaged by hand over chunks of ``rays``, and the chunk count."""
    total, weight, chunks = 0.0, 0.0, 0
    with torch.no_grad():
        for b in tr.sampler.val_batches(rays):
            total += float(tr.projector.pixel_errors(tr.projector(b.tilt, b.row, b.col), b).double().sum())
            weight += float(b.weight.double().sum())
            chunks += 1
    return total / weight, chunks


def test_small_fields_validate_in_chunks_of_sixteen_batches(trainer):
    tr = trainer
    feats = tr.projector.field.n_features
    assert tr.sampler.batch_size * 16 * tr.projector.samples_per_ray * feats <= trainer_mod.VAL_CHUNK_FLOATS
    assert tr.val_chunk_rays() == 16 * tr.sampler.batch_size
    n_val = tr.sampler.n_val
    assert tr.sampler.batch_size < n_val <= 16 * tr.sampler.batch_size  # one chunk instead of several
    ref, chunks = _manual_mean(tr, tr.sampler.batch_size)
    assert chunks == -(-n_val // tr.sampler.batch_size) > 1
    assert tr.validate() == pytest.approx(ref, rel=1e-6)


def test_the_chunk_shrinks_to_the_budget_and_never_below_one_batch(trainer, monkeypatch):
    tr = trainer
    per_batch = tr.sampler.batch_size * tr.projector.samples_per_ray * tr.projector.field.n_features
    monkeypatch.setattr(trainer_mod, "VAL_CHUNK_FLOATS", 3 * per_batch + 1)
    assert tr.val_chunk_rays() == 3 * tr.sampler.batch_size
    monkeypatch.setattr(trainer_mod, "VAL_CHUNK_FLOATS", per_batch // 2)  # a field too wide for one batch
    assert tr.val_chunk_rays() == tr.sampler.batch_size
    ref, _ = _manual_mean(tr, 16 * tr.sampler.batch_size)
    assert tr.validate() == pytest.approx(ref, rel=1e-6)
