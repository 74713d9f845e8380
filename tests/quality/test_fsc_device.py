"""The FSC's transforms and shell sums in torch (on the GPU when the run has one) give numpy's
curves to float32 rounding, for the whole-volume, the sector and the chunked FSC."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fasttomo.quality.metrics as metrics

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _pair(shape=(24, 32, 28)):
    rng = np.random.default_rng(5)
    truth = np.zeros(shape, dtype=np.float32)
    truth[6:18, 8:24, 5:20] = 1.0
    truth += rng.normal(0, 0.05, shape).astype(np.float32)
    return truth + 0.3 * rng.normal(0, 1, shape).astype(np.float32), truth


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fsc", "sector", "chunked"])
def test_fsc_in_torch_matches_numpy(kind, device, monkeypatch):
    a, b = _pair()

    def curves():
        if kind == "fsc":
            return {"all": metrics.fsc(a, b, 3.0)}
        if kind == "sector":
            return metrics.sector_fsc(a, b, 3.0, (-60.0, 60.0))
        return metrics.chunked_fsc(a, b, 3.0, (-60.0, 60.0), crop=16, max_crops=8)

    monkeypatch.setattr(metrics, "scoring_device", lambda: None)
    ref = curves()
    monkeypatch.setattr(metrics, "scoring_device", lambda: device)
    got = curves()
    assert ref.keys() == got.keys()
    for r in ref:
        finite = np.isfinite(ref[r].fsc)
        assert finite.sum() >= 5 and np.array_equal(finite, np.isfinite(got[r].fsc))
        np.testing.assert_array_equal(got[r].n_voxels, ref[r].n_voxels)
        np.testing.assert_allclose(got[r].fsc[finite], ref[r].fsc[finite], rtol=0, atol=1e-5)
        np.testing.assert_allclose(got[r].power_a, ref[r].power_a, rtol=1e-5)
    assert 0.2 < np.nanmin(ref["all"].fsc) < 0.99  # a curve that falls: the comparison sees the shells


def test_scoring_runs_on_the_gpu_only_where_there_is_one():
    assert metrics.scoring_device() == ("cuda" if torch.cuda.is_available() else None)


@pytest.mark.parametrize("kind", ["sector", "chunked"])
def test_a_gpu_too_full_for_the_transforms_falls_back_to_numpy(kind, monkeypatch):
    a, b = _pair()

    def curves():
        if kind == "sector":
            return metrics.sector_fsc(a, b, 3.0, (-60.0, 60.0))
        return metrics.chunked_fsc(a, b, 3.0, (-60.0, 60.0), crop=16, max_crops=8)

    monkeypatch.setattr(metrics, "scoring_device", lambda: None)
    ref = curves()

    def full(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(metrics, "scoring_device", lambda: "cpu")
    monkeypatch.setattr(metrics, "_shell_sums_torch", full)
    got = curves()
    for r in ref:
        np.testing.assert_array_equal(got[r].fsc, ref[r].fsc)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["fsc", "chunked"])
def test_the_fsc_on_a_device_refuses_non_finite_volumes(kind, device, monkeypatch):
    a, b = _pair()
    a[3, 4, 5] = np.inf
    monkeypatch.setattr(metrics, "scoring_device", lambda: device)
    with pytest.raises(ValueError, match=f"^{kind}.*NaN or Inf"):
        if kind == "fsc":
            metrics.fsc(a, b, 3.0)
        else:
            metrics.chunked_fsc(a, b, 3.0, crop=16, max_crops=8)


@pytest.mark.parametrize("device", DEVICES)
def test_a_masked_fsc_on_a_device_matches_numpy_and_leaves_the_inputs_alone(device, monkeypatch):
    a, b = _pair()
    mask = np.zeros(a.shape, dtype=np.float32)
    mask[4:20, 6:26, 4:22] = 1.0
    mask[4:20, 6:26, 4:8] = 0.5  # a soft edge: the mask-weighted mean is not the plain one
    a0, b0 = a.copy(), b.copy()
    monkeypatch.setattr(metrics, "scoring_device", lambda: None)
    ref = metrics.fsc(a, b, 3.0, mask=mask)
    monkeypatch.setattr(metrics, "scoring_device", lambda: device)
    got = metrics.fsc(a, b, 3.0, mask=mask)
    np.testing.assert_allclose(got.fsc, ref.fsc, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.power_a, ref.power_a, rtol=1e-5)
    np.testing.assert_array_equal(a, a0)  # centred on a copy, even where the device is the host's
    np.testing.assert_array_equal(b, b0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("large", [False, True])
def test_the_half_set_fsc_of_tensors_is_that_of_their_arrays(large, device, monkeypatch, caplog):
    """pair_fsc takes half volumes held as torch tensors (on the run's GPU) as it takes arrays:
    whole below WHOLE_VOLUME_MAX_VOXELS (copied to the host), from crops above it (lowered here)."""
    import fasttomo.quality.scoring as scoring

    a, b = _pair()
    if large:
        monkeypatch.setattr(scoring, "WHOLE_VOLUME_MAX_VOXELS", 1000)
    monkeypatch.setattr(metrics, "scoring_device", lambda: device)
    with caplog.at_level("INFO", logger="fasttomo"):
        ref, _ = scoring.pair_fsc(a, b, 3.0, (-60.0, 60.0))
        got, _ = scoring.pair_fsc(torch.from_numpy(a).to(device), torch.from_numpy(b).to(device), 3.0,
                                  (-60.0, 60.0))
    assert got == ref and ref["fsc"]["fsc05_status"] == "crossed"
    assert sum("from crops" in r.getMessage() for r in caplog.records) == (2 if large else 0)
