"""The dry run and the checks before training (run/preflight.py): data without signal is refused
in the dry run as in a run; the memory estimate matches what a CPU run really uses."""

from __future__ import annotations

import re

import mrcfile
import numpy as np
import pytest
import torch
from cli_helpers import TINY, TINY_RUN, cli


def test_the_dry_run_refuses_an_all_zero_stack_with_one_line(tmp_path):
    stack = tmp_path / "zeros.mrc"
    with mrcfile.new(stack) as m:
        m.set_data(np.zeros((8, 20, 24), dtype=np.float32))
        m.voxel_size = 10.0
    angles = tmp_path / "zeros.tlt"
    angles.write_text("\n".join(str(a) for a in np.linspace(-60, 60, 8)) + "\n")
    res = cli([*TINY_RUN, "data=mrc", f"data.path={stack}", f"data.angles={angles}", "dry_run=true"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    errors = [ln for ln in text.splitlines() if "[ERROR]" in ln]
    assert "Traceback" not in text and len(errors) == 1, text
    assert "every pixel of the stack holds the value 0; a constant stack carries no signal" in errors[0]
    assert "config and data are valid" not in text and not (tmp_path / "outputs").exists()


def test_a_dry_run_into_a_folder_the_run_would_refuse_exits_2(tmp_path):
    """The dry run prints its report, and where the run would stop at its folder (another run's
    results there) it ends with one error line and exit code 2, so a script can tell."""
    out = tmp_path / "done"
    first = cli([*TINY, "optim.steps=5", f"hydra.run.dir={out}"], tmp_path)
    assert first.returncode == 0, first.stderr
    res = cli([*TINY, "optim.steps=5", f"hydra.run.dir={out}", "dry_run=true"], tmp_path)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    error = [ln for ln in text.splitlines() if "[ERROR]" in ln]
    assert len(error) == 1 and error[0].endswith(f"dry run: the run would be refused: output folder {out} already "
                                                 f"holds results of an earlier run (checkpoints/last.pt, config.yaml, "
                                                 "fsc_truth.png, loss.png, metrics.json, reconstruct.log, ...); choose "
                                                 "a new folder (e.g. hydra.run.dir=outputs/my_run2) or set "
                                                 "output.overwrite=true to replace them."), error  # said once
    assert "Traceback" not in text and ".;" not in text
    fine = cli([*TINY, "optim.steps=5", f"hydra.run.dir={tmp_path / 'new'}", "dry_run=true"], tmp_path)
    assert fine.returncode == 0, fine.stderr


@pytest.mark.parametrize("extra, message", [
    (["evaluation.truth=nope.mrc"], r"nope\.mrc: file not found|nope\.mrc: cannot open"),
    (["evaluation.holdout_views=[100]"], r"evaluation\.holdout_views \[100\] are not views of this series"),
    (["data.n_tilts=3", "evaluation.half_sets=true"],
     r"evaluation\.half_sets: the even and the odd views are fitted apart and each half needs 2 views at least, "
     r"but 3 views are left to train on; drop evaluation\.half_sets=true\."),
])
def test_the_dry_run_refuses_what_the_run_would_refuse(tmp_path, extra, message):
    """A truth file that is not there, a held-out view the series lacks and half sets of too few
    views end the dry run with exit 2, as they end the run before training (the half sets were
    refused only after the training and the volume's export)."""
    for dry in (True, False):
        out = tmp_path / f"run{dry}"
        res = cli([*TINY, "optim.steps=5", *extra, f"hydra.run.dir={out}", f"dry_run={str(dry).lower()}"], tmp_path)
        text = res.stdout + res.stderr
        assert res.returncode == 2 and re.search(message, text), text
        assert "Traceback" not in text and not (out / "volume.mrc").exists()


SHAPES = {  # three small CPU runs: the tiny phantom, the embedded default's data, a thick box
    "tiny": ["data.width=24", "data.height=20", "data.n_tilts=15"],
    "default": ["sampler.batch_size=1024", "projector.samples_per_ray=48"],
    "thick": ["data.width=32", "data.height=32", "data.n_tilts=31", "data.thickness=96",
              "projector.samples_per_ray=null", "sampler.batch_size=2048"],
}
PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")


def _peak_rss(args: list[str], cwd) -> tuple[int, str]:
    """Peak resident memory (bytes) of one run of fasttomo-reconstruct in its own child process."""
    import subprocess
    import sys

    from cli_helpers import _env

    res = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "fasttomo.cli.reconstruct", *args],
                         cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("peak_rss_kib")][-1].split()
    assert line[2] == "0", res.stdout[-3000:] + res.stderr[-3000:]
    return int(line[1]) * 1024, res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_dry_run_memory_estimate_is_within_25_percent_of_the_peak_rss(tmp_path, shape):
    """The dry run's CPU estimate against the peak resident memory (getrusage of the child) of the
    same run, done for real (short, but with validation, per-view residuals and the final scores)."""
    args = ["experiment=quick", "runtime=cpu", "runtime.threads=1", "logging=quiet", "optim.steps=40",
            *(["model.resolutions=[8,16]", "sampler.batch_size=128", "projector.samples_per_ray=24"]
              if shape == "tiny" else []), *SHAPES[shape]]
    dry = cli([*args, "dry_run=true"], tmp_path)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    est = _estimate(dry.stdout + dry.stderr)
    peak, text = _peak_rss([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert abs(est - peak) <= 0.25 * peak, f"{shape}: estimate {est / 1e6:.0f} MB, peak RSS {peak / 1e6:.0f} MB"


def _estimate(text: str) -> float:
    import re

    m = re.search(r"memory on cpu \(estimate\): ([\d.]+) (kB|MB|GB)", text)
    assert m, text[-3000:]
    return float(m.group(1)) * {"kB": 1e3, "MB": 1e6, "GB": 1e9}[m.group(2)]


def test_a_box_too_thick_for_memory_is_refused_with_a_thickness_that_fits(tmp_path):
    """data.thickness sets the rays' length (and the size of a box-sized model): a thickness the
    memory cannot hold is refused before anything is built, naming a thickness that fits (and that
    one fits)."""
    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.config import ConfigError
    from fasttomo.data.load import load_tiltseries
    from fasttomo.quality.scoring import free_memory_bytes
    from fasttomo.run.build import build
    from fasttomo.run.preflight import check_memory, estimate_memory_bytes, rss_bytes

    free = free_memory_bytes(torch.device("cpu"))
    if free is None or free > 100e9:
        pytest.skip(f"needs a readable MemAvailable below 100 GB (free: {free})")
    stack, angles = tmp_path / "s.mrc", tmp_path / "s.tlt"
    with mrcfile.new(stack) as m:
        m.set_data((np.random.default_rng(0).random((15, 20, 24)) + 1).astype(np.float32))
        m.voxel_size = 10.0
    angles.write_text("\n".join(str(a) for a in np.linspace(-60, 60, 15)) + "\n")

    def config(thickness: int):
        cfg = compose_config(["runtime=cpu", "data=mrc", f"data.path={stack}", f"data.angles={angles}",
                              f"data.thickness={thickness}", "sampler.batch_size=1024",
                              "model.resolutions=[8,16]"])  # the rays grow with the thickness, not the model
        return cfg, load_tiltseries(cfg.data)

    before = rss_bytes()
    with pytest.raises(ConfigError, match=r"this run needs about .* more memory on cpu but .* is free .*training step "
                                          r".*use a thinner box \(data\.thickness=200000 makes rays of \d+ samples; "
                                          r"about data\.thickness=(\d+) or less fits\)") as info:
        check_memory(*config(200000))
    assert rss_bytes() - before < 200e6  # refused before the (box-sized) model was built
    fits = int(re.search(r"about data\.thickness=(\d+) or less fits", str(info.value)).group(1))
    assert 2 <= fits < 200000
    cfg, ts = config(fits)
    check_memory(cfg, ts)  # the thickness the message names is accepted ...
    comps = build(cfg, ts)
    assert sum(estimate_memory_bytes(cfg, comps).values()) < free  # ... and its built run's estimate fits


@pytest.mark.parametrize("case,commit,views,side,thickness", [
    ("camera1k", "ad5a2e8", 61, 1024, 256), ("camera2k", "ad5a2e8", 121, 2048, 512),
    ("camera4k", "cba97b6", 121, 4096, 256)])
def test_the_gpu_estimate_of_the_camera_cases_is_within_a_quarter_of_their_measured_peaks(
        case, commit, views, side, thickness, monkeypatch, tmp_path):
    """The planned CUDA estimate (fused kernels) of bench_scale's camera cases, sized as a run
    sizes them from the data alone, against the peak GPU memory their H200 records measured."""
    import dataclasses
    import json
    import types
    from pathlib import Path

    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.run import preflight
    from fasttomo.quality import scoring

    record = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / \
        f"bench_scale-{case}-NVIDIA-H200-{commit}.json"
    row = next(r for r in json.loads(record.read_text())["results"] if r["method"] == "field-default")
    peak = row.get("peak_gpu_before_scoring_GB") or row["peak_gpu_GB"]  # the scoring takes free memory only
    monkeypatch.setattr(preflight, "_fused", lambda device: True)
    monkeypatch.setattr(scoring, "free_memory_bytes", lambda device: 140_000_000_000)  # an H200's free memory
    cfg = compose_config(["data=mrc", f"data.path={tmp_path / 'unused.mrc'}", f"data.thickness={thickness}"])
    ts = types.SimpleNamespace(n_tilts=views, height=side, width=side, valid=None, pixel_size=10.0,
                               per_line_angles=False, angles=np.linspace(-60, 60, views),
                               stack=np.empty((views, side, side), np.float32))  # never touched: no memory
    shape = dataclasses.replace(preflight.planned_shape(cfg, ts), device=torch.device("cuda"))
    estimate = sum(preflight.memory_bytes(shape, True).values()) / 1e9
    assert 0.75 <= estimate / peak <= 1.25, (estimate, peak)


def test_the_cpu_estimate_counts_one_export_slab_where_the_scores_stream():
    """On the CPU a volume up to WHOLE_VOLUME_MAX_VOXELS is scored whole (24 B a voxel at the end);
    above it the export goes slab by slab and the scores stream, so the end costs one export slab,
    however large the volume: camera2k's 2^31 voxels were asked 51.5 GB for it and refused."""
    from fasttomo.quality.scoring import WHOLE_VOLUME_MAX_VOXELS
    from fasttomo.run.outputs import EXPORT_BYTES_PER_VOXEL, EXPORT_SLAB_MAX_BYTES
    from fasttomo.run.preflight import cpu_final_bytes

    from fasttomo.run.preflight import CPU_WHOLE_VOLUME_BYTES_PER_VOXEL as WHOLE

    assert cpu_final_bytes(1 << 20) == WHOLE << 20
    assert cpu_final_bytes(WHOLE_VOLUME_MAX_VOXELS) == WHOLE * WHOLE_VOLUME_MAX_VOXELS
    slab = EXPORT_SLAB_MAX_BYTES // 4 * EXPORT_BYTES_PER_VOXEL
    assert cpu_final_bytes(512 * 2048 * 2048) == cpu_final_bytes(256 * 4096 * 4096) == slab < 7e9
    # the slab the export will size from the memory left free: a quarter of it at EXPORT_BYTES_PER_VOXEL
    plane = 2048 * 2048
    free = 14_500_000_000
    planes = free // 4 // (EXPORT_BYTES_PER_VOXEL * plane)
    assert planes == 36 and cpu_final_bytes(512 * plane, plane, free) == planes * plane * EXPORT_BYTES_PER_VOXEL
    assert cpu_final_bytes(512 * plane, plane, 10 ** 12) == slab  # plenty free: the 1 GiB cap


def test_the_half_sets_estimate_counts_the_held_halves_only_where_they_are_held(monkeypatch):
    """After the main fit is let go the half sets peak at a half's fit (half the views' data)
    beside the even half held on the GPU and the odd half evaluated into its own tensor; with
    output.half_volumes, or where the free memory cannot hold both halves twice over, the halves
    go through files and the fit alone counts."""
    import dataclasses

    from fasttomo.run import preflight
    from fasttomo.quality import scoring

    monkeypatch.setattr(preflight, "_fused", lambda device: True)
    monkeypatch.setattr(scoring, "free_memory_bytes", lambda device: 140_000_000_000)
    vox = 4096 * 4096 * 256
    shape = preflight.RunShape(torch.device("cuda"), batch=4096, samples_per_ray=256, n_features=96, hidden=64,
                               n_val=10**7, pixels=121 * 4096 * 4096, stack_bytes=4 * 121 * 4096 * 4096,
                               parameters=10**9, voxels=vox, plane_voxels=4096 * 4096)
    fit = preflight.memory_bytes(shape, True)
    held = preflight.half_sets_bytes(shape, True, False, 140_000_000_000)
    assert held["the even half, held"] == held["the odd half, evaluated"] == 4 * vox
    assert held["a half's data"] == -(-shape.stack_bytes // 2)  # half the views
    assert held["a half's parameters"] == fit["parameters"]  # the same model
    rest = {k: v for k, v in held.items() if "half," not in k}
    assert sum(rest.values()) == sum(fit.values()) - fit["data"] + held["a half's data"]
    assert preflight.half_sets_bytes(shape, True, True, 140_000_000_000) == rest  # output.half_volumes: files
    assert preflight.half_sets_bytes(shape, True, False, 16 * vox) == rest  # no room for both halves


@pytest.mark.parametrize("record, n, size, thickness", [
    ("bench_scale-camera1k-halfsets-NVIDIA-H200-75d6465.json", 61, 1024, 256),
    ("bench_scale-camera2k-halfsets-NVIDIA-H200-ba4d1b4.json", 121, 2048, 512),
    ("bench_scale-camera4k-halfsets-steps3000-NVIDIA-H200-423e6f2.json", 121, 4096, 256)],
    ids=["camera1k", "camera2k", "camera4k"])
def test_the_half_sets_estimate_of_each_camera_case_is_within_a_quarter_of_its_measured_phases(
        monkeypatch, tmp_path, record, n, size, thickness):
    """Each camera case with evaluation.half_sets on the H200: the main run's phase against the
    fit's estimate, the halves' phases (their fits, volumes and FSC) against the half sets'."""
    import dataclasses
    import json
    import types
    from pathlib import Path

    from fasttomo.cli.reconstruct import compose_config
    from fasttomo.run import preflight
    from fasttomo.quality import scoring

    record = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / record
    phases = json.loads(record.read_text())["results"][0]["peak_GB_by_phase"]
    monkeypatch.setattr(preflight, "_fused", lambda device: True)
    monkeypatch.setattr(scoring, "free_memory_bytes", lambda device: 140_000_000_000)
    cfg = compose_config(["data=mrc", f"data.path={tmp_path / 'unused.mrc'}", f"data.thickness={thickness}",
                          "evaluation.half_sets=true"])
    ts = types.SimpleNamespace(n_tilts=n, height=size, width=size, valid=None, pixel_size=10.0,
                               per_line_angles=False, angles=np.linspace(-60, 60, n),
                               stack=np.empty((n, size, size), np.float32))  # never touched: no memory
    shape = dataclasses.replace(preflight.planned_shape(cfg, ts), device=torch.device("cuda"))
    fit = sum(preflight.memory_bytes(shape, True).values()) / 1e9
    halves = sum(preflight.half_sets_bytes(shape, True, False, 139_000_000_000).values()) / 1e9
    assert 0.75 <= fit / phases["main run"]["gpu"] <= 1.25, (fit, phases["main run"])
    measured = max(v["gpu"] for k, v in phases.items() if k != "main run")
    assert 0.75 <= halves / measured <= 1.25, (halves, measured)
