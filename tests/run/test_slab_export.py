"""Slab-wise export (issue 26): the volume evaluated and written slab by slab (pwrite into the
file) gives the same file, byte for byte, as the one-shot export, whatever the slab size (also one
that does not divide Z); the header statistics are those of the whole volume."""

from __future__ import annotations

import os
from pathlib import Path

import mrcfile
import numpy as np
import pytest
from cli_helpers import TINY

from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.data.io.mrc import MrcHeader, NonFiniteSlab, mrc_memmap, write_mrc, write_mrc_slabs
from fasttomo.data.io.volume import write_volume
from fasttomo.run.build import build, make_trainer
from fasttomo.run.outputs import VolumeFiles, field_slabs, slab_planes, write_volume_slabs

def _bytes(path) -> bytes:
    """The file's bytes with mrcfile's own first label ("Created by mrcfile.py <date time>")
    blanked: it carries the second the file was written."""
    data = bytearray(Path(path).read_bytes())
    assert data[224:245] == b"Created by mrcfile.py"
    data[224:304] = b" " * 80
    return bytes(data)


RNG = np.random.default_rng(3)
VOL = (RNG.normal(size=(11, 6, 7)) * 100 + 5).astype(np.float32)


@pytest.mark.parametrize("planes", [1, 2, 3, 4, 10, 11])
def test_mrc_slabs_equal_the_one_shot_file(tmp_path, planes):
    one = write_mrc(tmp_path / "one.mrc", VOL, 1.5, labels=["x"])
    slabs = ((z, VOL[z:z + planes]) for z in range(0, VOL.shape[0], planes))
    many = write_mrc_slabs(tmp_path / "many.mrc", VOL.shape, slabs, MrcHeader(1.5, ("x",)))
    assert _bytes(one) == _bytes(many)
    with mrcfile.open(many, permissive=False) as m:  # strict parsing accepts the header
        np.testing.assert_array_equal(m.data, VOL)
        h = m.header
        assert (float(h.dmin), float(h.dmax)) == (VOL.min(), VOL.max())
        assert float(h.dmean) == pytest.approx(VOL.mean(dtype=np.float64), rel=1e-6)
        assert float(h.rms) == pytest.approx(VOL.std(dtype=np.float64), rel=1e-6)
        assert m.voxel_size.x == pytest.approx(1.5)
    mapped = mrc_memmap(many)
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
    np.testing.assert_array_equal(mapped, VOL)


def test_mrc_slabs_refuse_gaps_and_non_finite_values_and_leave_no_file(tmp_path):
    bad = VOL.copy()
    bad[7, 1, 2] = np.nan
    with pytest.raises(NonFiniteSlab, match="planes 6..8"):
        write_mrc_slabs(tmp_path / "v.mrc", VOL.shape, ((z, bad[z:z + 3]) for z in range(0, 11, 3)), MrcHeader(1.0))
    with pytest.raises(Exception, match="does not continue the volume"):
        write_mrc_slabs(tmp_path / "v.mrc", VOL.shape, [(0, VOL[:4]), (5, VOL[5:])], MrcHeader(1.0))
    with pytest.raises(Exception, match="ended at plane 4 of 11"):
        write_mrc_slabs(tmp_path / "v.mrc", VOL.shape, [(0, VOL[:4])], MrcHeader(1.0))
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left


def test_torch_slabs_write_the_numpy_slabs_file(tmp_path):
    """Slabs given as CPU tensors write the file numpy slabs write, byte for byte."""
    import torch

    one = write_mrc(tmp_path / "one.mrc", VOL, 1.5, labels=["x"])
    slabs = ((z, torch.from_numpy(VOL[z:z + 4])) for z in range(0, VOL.shape[0], 4))
    assert _bytes(one) == _bytes(write_mrc_slabs(tmp_path / "t.mrc", VOL.shape, slabs, MrcHeader(1.5, ("x",))))


@pytest.mark.gpu
@pytest.mark.parametrize("planes", [1, 4])
def test_gpu_slabs_keep_the_data_and_the_header_statistics(tmp_path, planes):
    """Slabs on a GPU (finiteness and plane statistics computed there, copied into reused pinned
    buffers: nine slabs through three) write the same data bytes; the header's min, max and mean
    are the numpy ones and its rms agrees to one float32 ulp; a non-finite GPU slab still leaves
    no file."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    big = (RNG.normal(size=(9, 300, 200)) * 40 + 3).astype(np.float32)
    one = write_mrc(tmp_path / "one.mrc", big, 1.5, labels=["x"])
    slabs = ((z, torch.from_numpy(big[z:z + planes]).cuda()) for z in range(0, big.shape[0], planes))
    gpu = write_mrc_slabs(tmp_path / "gpu.mrc", big.shape, slabs, MrcHeader(1.5, ("x",)))
    a, b = _bytes(one), _bytes(gpu)
    assert a[1024:] == b[1024:]
    with mrcfile.open(one) as m1, mrcfile.open(gpu) as m2:
        for key in ("dmin", "dmax", "dmean"):
            assert m1.header[key] == m2.header[key], key
        assert abs(float(m1.header.rms) - float(m2.header.rms)) <= float(np.spacing(m1.header.rms))
    bad = torch.from_numpy(big).cuda()
    bad[5, 7, 7] = float("nan")
    with pytest.raises(NonFiniteSlab):
        write_mrc_slabs(tmp_path / "bad.mrc", big.shape, [(0, bad)], MrcHeader(1.5, ("x",)))
    assert not (tmp_path / "bad.mrc").exists()


def test_xzy_volume_written_in_slabs_is_the_rotated_volume(tmp_path):
    from fasttomo.data.io.volume import read_volume, to_imod_xzy

    p = write_volume(tmp_path / "r.mrc", VOL, 2.0, label="r", attrs={}, fmt="mrc", imod_xzy=True)
    with mrcfile.open(p) as m:
        np.testing.assert_array_equal(m.data, to_imod_xzy(VOL))
    np.testing.assert_array_equal(read_volume(p)[0], VOL)


def test_slab_planes_follow_the_free_memory():
    shape = (100, 64, 32)  # 24 bytes a voxel: 49152 bytes a plane
    assert slab_planes(shape, 4 * 49152 * 7) == 7
    assert slab_planes(shape, 10) == 1
    assert slab_planes(shape, 1 << 40) == 100


@pytest.mark.parametrize("planes", [1, 7, 41])
def test_field_export_in_slabs_equals_the_one_shot_export(tmp_path, planes):
    """A trained field's volume (a phantom run's parts, a few steps), resampled to 41 x 80 x 96
    voxels (more than one evaluation chunk of 2^18 points) and exported in slabs of 1, 7 and all
    41 planes, is the one-shot export bit for bit, and the file is the one write_volume writes
    from the one-shot array."""
    cfg = compose_config([*TINY, "optim.steps=3", f"output.dir={tmp_path / 'unused'}"])
    from fasttomo.data.load import load_tiltseries

    comps = build(cfg, load_tiltseries(cfg.data))
    trainer = make_trainer(comps)
    trainer.fit()
    shape = (41, 80, 96)
    whole = trainer.export_volume(shape)
    parts = list(field_slabs(comps.projector, comps.sampler.scale, shape, planes))
    np.testing.assert_array_equal(np.concatenate([p.cpu().numpy() for _, p in parts]), whole)
    one = write_volume(tmp_path / "one.mrc", whole, 2.0, label=f"fasttomo run {cfg.name}", attrs={}, fmt="mrc")
    many = write_volume_slabs(tmp_path / "many.mrc", shape, iter(parts), VolumeFiles(2.0, {}), cfg.name)[0]
    assert _bytes(one) == _bytes(many)


def test_run_writes_one_mrc_by_default_and_h5_on_request(tmp_path, caplog):
    """The default formats are [mrc]; a run given slab_planes that does not divide Z writes the
    volume the one-shot array would give (the HDF5 file asked for beside it holds the same); the
    log splits the export's time between evaluating the slabs and the rest, and the timeline keeps the peak host memory at the phase borders."""
    import re

    from fasttomo.data.io.volume import read_volume

    with caplog.at_level("INFO", logger="fasttomo"):
        run(compose_config([*TINY, "optim.steps=3", f"output.dir={tmp_path / 'a'}"]))
    assert sorted(p.name for p in (tmp_path / "a").glob("volume*")) == ["volume.mrc"]
    split = re.search(r"volume.mrc evaluated and written in ([0-9.]+) s: waiting for the slabs' evaluation ([0-9.]+) "
                      r"s, their statistics and copies to the host ([0-9.]+) s, the writer's queue ([0-9.]+) s, "
                      r"closing the file (-?[0-9.]+) s \(the writer thread's writes [0-9.]+ s\)", caplog.text)
    assert split and abs(float(split[1]) - sum(float(split[i]) for i in (2, 3, 4, 5))) <= 0.21, caplog.text[-2000:]
    import json

    tl = json.loads((tmp_path / "a" / "metrics.json").read_text())["timeline"]  # the host's peak by phase
    at = tl["peak_host_bytes_at"]
    assert list(at) == ["training_start", "export_start", "export_end"]
    assert 0 < at["training_start"] <= at["export_start"] <= at["export_end"] <= tl["peak_host_bytes"]
    assert set(tl["volume_publish_s"]) == {"wait", "fsync_rename"}  # volume.mrc went to the disk on a thread
    assert not list((tmp_path / "a").glob(".volume.mrc.*"))  # ... and took its name: no temporary file is left
    run(compose_config([*TINY, "optim.steps=3", "output.formats=[mrc,h5]", "output.slab_planes=3",
                        f"output.dir={tmp_path / 'b'}"]))
    mrc, (h5, _, attrs) = read_volume(tmp_path / "b" / "volume.mrc")[0], read_volume(tmp_path / "b" / "volume.h5")
    np.testing.assert_array_equal(mrc, h5)
    assert attrs["config"]["output"]["slab_planes"] == 3
    np.testing.assert_array_equal(mrc, read_volume(tmp_path / "a" / "volume.mrc")[0])  # same seed, same run


def test_host_buffers_are_reused_only_after_they_are_released():
    """The GPU slabs' host buffers (here pageable: the page-locking needs a GPU): at most two
    exist, a third copy waits until one is released and then reuses it, and a slab larger than
    the free buffer gets a buffer of its size."""
    import threading

    import torch

    from fasttomo.data.io.mrc import _HostBuffers

    vol = torch.from_numpy((RNG.normal(size=(5, 4, 3)) * 10).astype(np.float32))
    buffers = _HostBuffers(count=2, pin=False)
    a, release_a = buffers.copy(vol[:1])
    b, release_b = buffers.copy(vol[1:2])
    got = {}
    third = threading.Thread(target=lambda: got.update(c=buffers.copy(vol[2:3])))
    third.start()
    third.join(0.3)
    assert third.is_alive() and buffers.made == 2  # waiting: both buffers are still being written
    np.testing.assert_array_equal(a, vol[:1].numpy())
    release_a()
    third.join(5)
    c, _ = got["c"]
    assert np.shares_memory(c, a) and buffers.made == 2
    np.testing.assert_array_equal(c, vol[2:3].numpy())
    np.testing.assert_array_equal(b, vol[1:2].numpy())  # untouched by the third copy
    release_b()
    d, _ = buffers.copy(vol[2:5])  # three planes: the free one-plane buffer is dropped, one made
    assert not np.shares_memory(d, b) and d.shape == (3, 4, 3) and buffers.made == 2
    np.testing.assert_array_equal(d, vol[2:5].numpy())


def test_slab_writer_releases_what_it_skips_after_a_failed_write(tmp_path):
    """A slab queued behind a failed write is not written, but its buffer is released (the GPU
    export would otherwise wait for one forever); the failure is raised by close."""
    import threading

    from fasttomo.data.io.mrc import SlabWriter

    released, first_done = [], threading.Event()
    with open(tmp_path / "v.bin", "wb+") as f:
        writer = SlabWriter(f.fileno())
        writer.put(np.ones(4, np.float32), 0, lambda: (first_done.wait(5), released.append(0)))
        writer.put(np.ones(4, np.float32), -16, lambda: released.append(1))  # a negative offset fails
        threading.Timer(0.3, first_done.set).start()
        writer.put(np.full(4, 7, np.float32), 16, lambda: released.append(2))  # queued behind it
        with pytest.raises(OSError):
            writer.close()
        assert released == [0, 1, 2]
        assert os.path.getsize(tmp_path / "v.bin") == 16  # the slab behind the failure was skipped


@pytest.mark.gpu
def test_gpu_export_keeps_the_volume_for_the_scoring(tmp_path, monkeypatch):
    """Given a truth, the slab-wise export on a GPU also keeps the volume there (its copy is the
    file, bit for bit), and the scores that read that copy (large-volume path: streamed moments,
    FSC crops) are the scores that read the file; without a truth nothing is kept. With
    ``files.later`` the file's writes go on from that copy after the return, into the same bytes."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import fasttomo.quality.scoring as scoring
    from fasttomo.data.load import load_tiltseries
    from fasttomo.run.outputs import VolumeFiles, export_field

    cfg = compose_config([*TINY, "runtime=cuda", "optim.steps=3", f"output.dir={tmp_path / 'unused'}"])
    comps = build(cfg, load_tiltseries(cfg.data))
    trainer = make_trainer(comps)
    trainer.fit()
    shape = tuple(comps.box.shape_zyx)
    truth = np.zeros(shape, np.float32)
    monkeypatch.setattr(scoring, "WHOLE_VOLUME_MAX_VOXELS", 1000)  # this small volume scored as a large one
    monkeypatch.setattr(scoring, "STREAMED_MOMENTS_ABOVE", 1000)
    later = []
    with trainer.exported_field():
        vol, written, failed, finite, keep = export_field(trainer, cfg, tmp_path / "a", VolumeFiles(2.0, {}), truth)
        none = export_field(trainer, cfg, tmp_path / "b", VolumeFiles(2.0, {}))[4]
        drained, _, _, _, keep_c = export_field(trainer, cfg, tmp_path / "c", VolumeFiles(2.0, {}, later=later), truth)
    assert finite and not failed and "volume.mrc" in written and none is None
    assert keep is not None and keep.is_cuda
    np.testing.assert_array_equal(keep.cpu().numpy(), np.asarray(vol))
    # with ``later`` the writes go on from the kept copy after the return; then the file is the same
    (pending,) = later
    assert pending.wait_written() is None
    np.testing.assert_array_equal(np.asarray(drained), keep_c.cpu().numpy())
    assert pending.join() == str(tmp_path / "c" / "volume.mrc")
    assert _bytes(tmp_path / "c" / "volume.mrc")[1024:] == _bytes(tmp_path / "a" / "volume.mrc")[1024:]
    truth = (np.asarray(vol) + np.random.default_rng(1).normal(0, 0.01, shape)).astype(np.float32)
    from_file, _ = scoring.score_against_truth(vol, truth, 2.0, tilt_range=(-60, 60))
    from_copy, _ = scoring.score_against_truth(vol, truth, 2.0, tilt_range=(-60, 60), vol_on_device=keep)
    for key in ("pearson_global", "pearson_foreground", "mse", "data_range"):
        assert from_copy[key] == pytest.approx(from_file[key], rel=1e-12, nan_ok=True), key
    np.testing.assert_allclose(from_copy["fsc"]["fsc"], from_file["fsc"]["fsc"], rtol=1e-12, atol=1e-15)  # cuFFT


def test_kept_slabs_are_written_after_the_return_into_the_same_file(tmp_path):
    """Slabs the caller keeps (``kept``) with ``later``: the call returns once the slabs are
    checked and counted, a read-only map of the file; after ``wait_written`` the map holds the
    volume, and the published file is the one-shot file byte for byte."""
    one = write_mrc(tmp_path / "one.mrc", VOL, 1.5, labels=["x"])
    later = []
    mapped = write_mrc_slabs(tmp_path / "kept.mrc", VOL.shape, [(z, VOL[z:z + 3]) for z in range(0, 11, 3)],
                             MrcHeader(1.5, ("x",)), later=later, kept=True)
    (pending,) = later
    assert isinstance(mapped, np.memmap) and pending.wait_written() is None
    np.testing.assert_array_equal(mapped, VOL)
    assert pending.join() == str(tmp_path / "kept.mrc") and pending.write_seconds >= 0
    assert _bytes(one) == _bytes(tmp_path / "kept.mrc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.mrc", "one.mrc"]  # no temporary left


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["sirt", "field"])
def test_gpu_half_sets_are_held_on_the_gpu_and_score_as_the_written_halves(tmp_path, caplog, model):
    """On a GPU, evaluation.half_sets holds each half there for its FSC and writes no half file.
    SIRT (the same halves twice): that FSC is the FSC of the halves output.half_volumes writes."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = [*TINY, "runtime=cuda", "optim.steps=20"]
    if model == "sirt":
        args = [*(a for a in args if not a.startswith(("model.", "projector.", "sampler."))), "model=sirt",
                "model.iterations=5"]
    with caplog.at_level("INFO", logger="fasttomo"):
        held = run(compose_config([*args, "evaluation.half_sets=true", f"output.dir={tmp_path / 'held'}"]))
    assert sum("held on cuda" in r.getMessage() for r in caplog.records) == 2
    assert not list((tmp_path / "held").glob("volume_*")) and (tmp_path / "held" / "fsc_halfsets.png").is_file()
    assert 0.3 < held["half_sets"]["fsc"]["fsc_mean"] <= 1
    if model == "sirt":
        files = run(compose_config([*args, "output.half_volumes=true", f"output.dir={tmp_path / 'files'}"]))
        assert (tmp_path / "files" / "volume_even.mrc").is_file()
        np.testing.assert_allclose(np.array(held["half_sets"]["fsc"]["fsc"], float),
                                   np.array(files["half_sets"]["fsc"]["fsc"], float), rtol=0, atol=1e-4)
