"""output.half_volumes=true: the even-view and odd-view tomograms are written as MRC (whatever
output.formats says) with the full volume's header and orientation, and the half-set FSC computed
from the written files is the run's own (metrics.json, report.png)."""

from __future__ import annotations

import json

import mrcfile
import numpy as np
from cli_helpers import TINY, TINY_PHANTOM

from fasttomo.cli.reconstruct import compose_config, run
from fasttomo.quality.scoring import pair_fsc


def _header(path):
    with mrcfile.open(path, permissive=False) as m:
        h = m.header
        head = {"shape": m.data.shape, "voxel": tuple(float(v) for v in m.voxel_size.tolist()),
                "axes": (int(h.mapc), int(h.mapr), int(h.maps)), "mode": int(h.mode),
                "origin": tuple(float(v) for v in h.origin.tolist()),
                "labels": [bytes(l).rstrip(b"\0 ") for l in h.label[1:int(h.nlabl)]]}  # [0]: mrcfile's, dated
        return head, np.array(m.data)


def test_half_volumes_written_like_the_full_one_and_their_fsc_is_the_run_s(tmp_path):
    out = tmp_path / "run"
    run(compose_config([*TINY, "optim.steps=30", "output.half_volumes=true", "output.formats=[mrc]",
                        f"output.dir={out}"]))
    full, _ = _header(out / "volume.mrc")
    even_head, even = _header(out / "volume_even.mrc")
    odd_head, odd = _header(out / "volume_odd.mrc")
    assert even_head == full and odd_head == full
    assert not np.array_equal(even, odd)  # two fits of different views
    metrics = json.loads((out / "metrics.json").read_text())
    angles = np.linspace(-60.0, 60.0, 15)  # TINY: 15 tilts over the phantom's default +-60 degrees
    mine, _ = pair_fsc(even, odd, full["voxel"][0], (float(angles.min()), float(angles.max())))
    assert json.loads(json.dumps(mine)) == metrics["half_sets"]
    assert (out / "report.png").is_file() and (out / "fsc_halfsets.png").is_file()
    manifest = json.loads((out / "manifest.json").read_text())
    assert "volume_even.mrc" in json.dumps(manifest) and "volume_odd.mrc" in json.dumps(manifest)


def test_half_volumes_are_mrc_even_when_the_formats_are_not(tmp_path):
    out = tmp_path / "run"
    run(compose_config([*TINY_PHANTOM, "model=sirt", "model.iterations=5", "logging=quiet", "runtime=cpu",
                        "output.half_volumes=true", "output.formats=[h5]", f"output.dir={out}"]))
    assert sorted(p.name for p in out.glob("volume*")) == ["volume.h5", "volume_even.h5", "volume_even.mrc",
                                                         "volume_odd.h5", "volume_odd.mrc"]



def test_half_volumes_in_slabs_give_every_format_the_same_voxels(tmp_path):
    """The half volumes are written slab by slab into their MRC files (output.slab_planes=2, not a
    divisor of Z) and the other formats from those files: the same voxels in each."""
    from fasttomo.data.io.volume import read_volume

    out = tmp_path / "run"
    run(compose_config([*TINY, "optim.steps=10", "output.half_volumes=true", "output.formats=[mrc,h5]",
                        "output.slab_planes=2", f"output.dir={out}"]))
    for half in ("even", "odd"):
        mrc, h5 = read_volume(out / f"volume_{half}.mrc")[0], read_volume(out / f"volume_{half}.h5")[0]
        assert mrc.shape == read_volume(out / "volume.mrc")[0].shape and np.isfinite(mrc).all()
        np.testing.assert_array_equal(mrc, h5)
    assert json.loads((out / "metrics.json").read_text())["half_sets"]["fsc"]



def test_the_disk_estimate_counts_the_half_volumes_a_run_writes():
    """The disk check counts volume_even.* / volume_odd.* where output.half_volumes writes them
    (every format, MRC always), none for evaluation.half_sets alone (the halves are held for
    their FSC), and an MRC file each where a camera-size half has no GPU to be held on."""
    import math
    import types

    import torch

    from fasttomo.run.preflight import estimate_output_bytes

    def volumes(*overrides, shape=(10, 20, 30), device="cpu") -> float:
        comps = types.SimpleNamespace(box=types.SimpleNamespace(shape_zyx=shape), device=torch.device(device),
                                      projector=torch.nn.Linear(2, 2))
        return estimate_output_bytes(compose_config([*TINY, *overrides]), comps)["volumes"] / (
            4 * math.prod(shape) + 4096)

    assert volumes("output.formats=[mrc]") == 1
    assert volumes("output.formats=[mrc]", "output.half_volumes=true") == 3
    assert volumes("output.formats=[h5,tiff]", "output.half_volumes=true") == 2 + 2 * 3
    assert volumes("output.formats=[mrc]", "evaluation.half_sets=true") == 1
    camera2k = (512, 2048, 2048)
    assert volumes("output.formats=[mrc]", "evaluation.half_sets=true", shape=camera2k) == 3
    assert volumes("output.formats=[mrc]", "evaluation.half_sets=true", shape=camera2k, device="cuda") == 1


def test_a_camera_size_half_with_no_gpu_to_hold_it_goes_through_its_mrc_file(tmp_path, monkeypatch, caplog):
    """evaluation.half_sets alone on the CPU: a half the scores stream (WHOLE_VOLUME_MAX_VOXELS
    lowered here to 1000) is written slab by slab to volume_<half>.mrc and its FSC read from the
    files' maps crop by crop, never whole in memory; a small one is held and nothing is written."""
    import fasttomo.quality.scoring as scoring

    small = run(compose_config([*TINY, "optim.steps=10", "evaluation.half_sets=true", f"output.dir={tmp_path / 's'}"]))
    assert small["half_sets"]["fsc"] and not list((tmp_path / "s").glob("volume_*"))
    monkeypatch.setattr(scoring, "WHOLE_VOLUME_MAX_VOXELS", 1000)
    out = tmp_path / "large"
    with caplog.at_level("INFO", logger="fasttomo"):
        metrics = run(compose_config([*TINY, "optim.steps=10", "evaluation.half_sets=true", "output.formats=[mrc]",
                                      f"output.dir={out}"]))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "for its FSC (no room on the GPU to hold it)" in text and "from crops" in text
    even, odd = mrcfile.read(out / "volume_even.mrc"), mrcfile.read(out / "volume_odd.mrc")
    angles = np.linspace(-60.0, 60.0, 15)
    mine, _ = pair_fsc(even, odd, float(_header(out / "volume.mrc")[0]["voxel"][0]),
                       (float(angles.min()), float(angles.max())))
    assert json.loads(json.dumps(mine)) == metrics["half_sets"]
    assert "volume_even.mrc" in (out / "manifest.json").read_text()
