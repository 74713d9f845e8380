"""Resume takes its config from the checkpoint (issue 10, case 7): the command line changes only
what it names; what cannot change (model shape, data) is refused with the key named."""

from __future__ import annotations

import pytest

from fasttomo.config import ConfigError, DataConfig
from fasttomo.data.io import write_tiltseries
from fasttomo.data.phantom import make_tiltseries
from fasttomo.cli.reconstruct import compose_config, run

TINY = ["experiment=quick", "logging=quiet", "runtime=cpu", "runtime.threads=1", "model.resolutions=[8]",
        "sampler.batch_size=128", "projector.samples_per_ray=16"]


@pytest.fixture(scope="module")
def mrc_run(tmp_path_factory):
    """A 4-step run on an MRC + .rawtlt series, with settings the defaults do not have."""
    tmp = tmp_path_factory.mktemp("resume_cfg")
    paths = write_tiltseries(tmp / "ph.mrc", make_tiltseries(DataConfig(width=16, height=16, n_tilts=9)), "mrc")
    out = tmp / "first"
    run(compose_config([*TINY, "data=mrc", f"data.path={paths[0]}", f"data.angles={paths[1]}", "data.thickness=8",
                        "data.normalize=quantile", "optim.steps=4", "optim.lr_grids=0.05", f"output.dir={out}"]))
    return tmp, out / "checkpoints" / "last.pt", paths


def test_resume_alone_continues_the_saved_run(mrc_run):
    tmp, ckpt, paths = mrc_run
    cfg = compose_config([f"resume={ckpt}", "optim.steps=6", f"output.dir={tmp / 'more'}"])
    assert cfg.data.source == "mrc" and cfg.data.path == paths[0] and cfg.data.thickness == 8
    assert cfg.optim.steps == 6 and cfg.optim.lr_grids == 0.05 and cfg.model.resolutions == [8]
    assert cfg.output.dir == str(tmp / "more") and cfg.resume == str(ckpt)
    metrics = run(cfg)
    assert metrics["steps"] == 6 and metrics["resumed_from"]["step"] == 4


def test_resume_from_the_run_folder_and_free_overrides(mrc_run):
    tmp, ckpt, paths = mrc_run
    cfg = compose_config([f"resume={ckpt.parent.parent}", "logging.log_every=2", f"output.dir={tmp / 'x'}"])
    assert cfg.resume == str(ckpt) and cfg.logging.log_every == 2 and cfg.data.thickness == 8
    # repeating the original command's data settings changes nothing ...
    again = [f"resume={ckpt}", "data=mrc", f"data.path={paths[0]}", "data.normalize=quantile", f"output.dir={tmp / 'x'}"]
    assert compose_config(again).data.thickness == 8
    # ... and a group option that would change the data names itself in the refusal
    with pytest.raises(ConfigError, match=r"^data.normalize: cannot change .* by data=mrc\); .* Drop data=mrc from"):
        compose_config([f"resume={ckpt}", "data=mrc", f"output.dir={tmp / 'x'}"])


@pytest.mark.parametrize("override,key", [("model.channels=4", "model.channels"), ("data=phantom", "data.source"),
                                          ("data.binning=2", "data.binning"),
                                          ("sampler.batch_size=64", "sampler.batch_size")])
def test_resume_refuses_what_cannot_change_naming_the_key(mrc_run, override, key):
    tmp, ckpt, _ = mrc_run
    with pytest.raises(ConfigError, match=rf"^{key}: cannot change when resuming from .*last\.pt"):
        compose_config([f"resume={ckpt}", override, f"output.dir={tmp / 'y'}"])


def test_resume_with_a_moved_data_file_is_allowed(mrc_run, tmp_path):
    tmp, ckpt, paths = mrc_run
    import shutil

    moved = shutil.copy(paths[0], tmp_path / "moved.mrc")
    cfg = compose_config([f"resume={ckpt}", f"data.path={moved}", f"output.dir={tmp_path / 'z'}"])
    assert cfg.data.path == str(moved) and cfg.data.thickness == 8


def test_a_checkpoint_of_an_older_fasttomo_resumes(mrc_run):
    """A checkpoint whose config has the shape of fasttomo before one schema per group option
    (every data key of every source, samples_per_ray under sampler, the model's learn_rotations)
    resumes: moved keys are renamed and the keys the option never read are dropped."""
    from fasttomo.train.checkpoint import load_checkpoint, save_checkpoint

    tmp, ckpt, paths = mrc_run
    state = load_checkpoint(ckpt)
    old = state["config"]
    old["data"].update({"width": 64, "height": 64, "n_tilts": 61, "tilt_min": -60.0, "tilt_max": 60.0, "noise": 0.0,
                        "phantom": "default", "n_ellipsoids": 8, "phantom_seed": 0, "hdf5_stack": "/tiltseries/stack"})
    old["sampler"]["samples_per_ray"] = old.pop("projector")["samples_per_ray"]
    old["sampler"]["num_workers"] = 0
    old["model"]["learn_rotations"] = old["model"].pop("learn_frames")
    old["model"].update({"iterations": 100, "relaxation": 1.0, "positivity": True, "voxel_shape": None})
    old["schedule"].update({"plateau_patience": 50, "plateau_factor": 0.5})
    old["pose"].update({"learn_rotations": True, "learn_z1": True, "learn_shifts": True, "start_step": 0})
    legacy = save_checkpoint(tmp / "legacy" / "last.pt", state)
    cfg = compose_config([f"resume={legacy}", "optim.steps=6", f"output.dir={tmp / 'from_legacy'}"])
    assert cfg.projector.samples_per_ray == 16 and cfg.data.source == "mrc" and cfg.data.thickness == 8
    metrics = run(cfg)
    assert metrics["steps"] == 6 and metrics["resumed_from"]["step"] == 4


def test_a_run_started_with_relative_file_names_resumes_from_another_folder(tmp_path, monkeypatch):
    """A run keeps its file settings absolute (config.yaml and the checkpoint), so the resume
    command it prints works from any working directory; a relative name on the resume command
    line is read against the directory it is given in, and names the same file."""
    paths = write_tiltseries(tmp_path / "data" / "ph.mrc", make_tiltseries(DataConfig(width=16, height=16, n_tilts=9)),
                             "mrc")
    monkeypatch.chdir(tmp_path / "data")
    first = compose_config([*TINY, "data=mrc", "data.path=ph.mrc", "data.angles=ph.rawtlt", "data.thickness=8",
                            "optim.steps=4", f"output.dir={tmp_path / 'first'}"])
    assert first.data.path == str(tmp_path / "data" / "ph.mrc") and first.data.angles == str(paths[1])
    run(first)
    assert f"path: {tmp_path / 'data' / 'ph.mrc'}" in (tmp_path / "first" / "config.yaml").read_text()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = compose_config([f"resume={tmp_path / 'first'}", "optim.steps=6", f"output.dir={tmp_path / 'more'}"])
    assert cfg.data.path == str(paths[0])
    assert run(cfg)["steps"] == 6
    monkeypatch.chdir(tmp_path / "data")  # the same file named relatively again: not a change
    again = compose_config([f"resume={tmp_path / 'first'}", "data.path=ph.mrc", f"output.dir={tmp_path / 'again'}"])
    assert again.data.path == str(paths[0])


@pytest.mark.parametrize("change", ["flipped stack", "other angles"])
def test_resume_on_other_data_is_refused(mrc_run, tmp_path, change):
    """data.path and data.angles may move, but the series must be the saved run's: a stack flipped
    left-right (same shape and intensity scale) or an angle file shifted by 0.5 degrees is refused."""
    from fasttomo.data.io.mrc import read_mrc, write_mrc
    from fasttomo.train.checkpoint import CheckpointError

    tmp, ckpt, paths = mrc_run
    stack, angles = paths
    if change == "flipped stack":
        raw = read_mrc(paths[0])
        stack = write_mrc(tmp_path / "flipped.mrc", raw.data[:, :, ::-1].copy(), float(raw.voxel_size[0]),
                          image_stack=True)
    else:
        values = [float(v) + 0.5 for v in open(paths[1]).read().split()]
        angles = tmp_path / "shifted.rawtlt"
        angles.write_text("\n".join(f"{v:.2f}" for v in values) + "\n")
    cfg = compose_config([f"resume={ckpt}", f"data.path={stack}", f"data.angles={angles}", "optim.steps=6",
                          f"output.dir={tmp_path / 'out'}"])
    with pytest.raises(CheckpointError, match=r"the tilt series \(its pixels or its angles\) differs from the saved "
                                              r"run's; resume on the same data"):
        run(cfg)
