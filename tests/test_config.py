"""Config composition (Hydra compose API) of every group option, and config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import HydraException

from fasttomo.config import Config, ConfigError, DataConfig, from_dict
from fasttomo.cli.reconstruct import compose_config, config_dir

CONFIGS = Path(config_dir())
GROUPS = sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and p.name != "hydra")
NEEDS_PATH = {"mrc": ["data.path=stack.mrc"], "hdf5": ["data.path=stack.h5"],
              "tiff": ["data.path=stack.tif", "data.angles=stack.rawtlt"]}


def test_all_groups_present():
    for g in ("data", "model", "pose", "sampler", "optim", "schedule", "loss", "precision", "kernels",
              "runtime", "logging", "experiment"):
        assert g in GROUPS, f"config group {g} missing"


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONFIGS / g).glob("*.yaml"))])
def test_every_group_option_composes(group, option):
    extra = NEEDS_PATH.get(option, []) if group == "data" else []
    cfg = compose_config([f"{group}={option}", *extra])
    assert isinstance(cfg, Config)
    if group == "experiment" and option == "flagship":
        assert cfg.model.n_rotations == 8 and cfg.model.channels == 48
        assert cfg.model.resolutions == [50, 100, 200]
        assert cfg.sampler.batch_size == 8192 and cfg.projector.samples_per_ray == 200
        assert cfg.data.width == 200 and cfg.data.n_tilts == 61
    if group == "precision":
        assert cfg.precision.dtype == option


def test_defaults_are_the_embedded_phantom():
    cfg = compose_config([])
    assert cfg.data.source == "phantom" and cfg.data.n_tilts == 61
    assert (cfg.data.tilt_min, cfg.data.tilt_max) == (-60.0, 60.0)
    assert cfg.sampler.kind == "device" and cfg.kernels.backend == "auto"


def test_override_values_and_types():
    cfg = compose_config(["optim.steps=7", "optim.lr_grids=1", "model.resolutions=[8,[8,8,4]]"])
    assert cfg.optim.steps == 7
    assert isinstance(cfg.optim.lr_grids, float)
    assert cfg.model.resolution_triples() == ((8, 8, 8), (8, 8, 4))


def test_unknown_group_option_is_named():
    with pytest.raises(HydraException) as info:
        compose_config(["model=nosuchmodel"])
    msg = str(info.value)
    assert "nosuchmodel" in msg and "kplanes_tilted" in msg  # the available options are listed


def test_unknown_key_is_rejected_with_valid_keys():
    with pytest.raises(ConfigError) as info:
        from_dict(Config, {"optim": {"stpes": 3}})
    assert "stpes" in str(info.value) and "steps" in str(info.value)


@pytest.mark.parametrize("override,field", [
    ("data.width=-4", "data.width"),
    ("sampler.batch_size=0", "sampler.batch_size"),
    ("optim.lr_grids=-1", "optim.lr_grids"),
    ("data.tilt_min=-95", "data.tilt_min"),
    ("model.resolutions=[1]", "model.resolutions"),
    ("precision.dtype=fp8", "precision.dtype"),
    ("precision.planes=fp16", "precision.planes"),
    ("kernels.gpu_decoder=fast", "kernels.gpu_decoder"),
    ("output.formats=[]", "output.formats: names no volume file"),  # a run that writes no reconstruction
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    assert field in str(info.value)


def test_bf16_planes_need_a_kplanes_model():
    assert compose_config(["precision.planes=bf16"]).precision.planes == "bf16"
    assert compose_config(["model=kplanes", "precision.planes=bf16"]).model.n_rotations == 1
    for model in ("voxel", "sirt"):
        with pytest.raises(ConfigError, match=rf"precision.planes=bf16: model.kind={model} has no planes to sample"):
            compose_config([f"model={model}", "precision.planes=bf16"])


def test_missing_path_for_file_data():
    with pytest.raises(ConfigError) as info:
        compose_config(["data=mrc"])
    assert "data.path" in str(info.value)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError) as info:
        from_dict(Config, {"optim": {"steps": "many"}})
    assert "optim.steps" in str(info.value)


def test_phantom_data_config_defaults_valid():
    d = DataConfig()
    assert d.source == "phantom"


def test_schema_defaults_equal_the_default_composition():
    """The dataclass defaults and the default YAML composition describe the same run (the phantom
    group only spells out its 10 A pixel size, which the schema leaves to the data source)."""
    import dataclasses

    composed = dataclasses.asdict(compose_config([]))
    schema = dataclasses.asdict(Config())
    composed["data"]["pixel_size"] = schema["data"]["pixel_size"]
    assert composed == schema


# ----------------------------------------------------------------------------------- one schema per option
# For every group with options: a key some other option reads, given with an option that does not
# read it, is refused naming the key, the option and that option's keys.
UNREAD = [
    (["data.binning=4"], "data.binning", "data.source=phantom"),
    (["data.crop=[0,8,0,8]"], "data.crop", "data.source=phantom"),
    (["data=mrc", "data.path=s.mrc", "data.width=32"], "data.width", "data.source=mrc"),
    (["data=mrc", "data.path=s.mrc", "data.hdf5_stack=/x"], "data.hdf5_stack", "data.source=mrc"),
    (["data=mrc", "data.path=s.mrc", "data.particle.radius=10"], "data.particle", "data.source=mrc"),
    (["model=voxel", "model.channels=99"], "model.channels", "model.kind=voxel"),
    (["model=sirt", "model.decoder=linear"], "model.decoder", "model.kind=sirt"),
    (["model.iterations=5"], "model.iterations", "model.kind=kplanes_tilted"),
    (["sampler.num_workers=3"], "sampler.num_workers", "sampler.kind=device"),
    (["schedule.plateau_patience=3"], "schedule.plateau_patience", "schedule.kind=cosine"),
    (["schedule=plateau", "schedule.min_factor=0.1"], "schedule.min_factor", "schedule.kind=plateau"),
    (["schedule=constant", "schedule.min_factor=0.1"], "schedule.min_factor", "schedule.kind=constant"),
    (["pose.start_step=5"], "pose.start_step", "pose.learn=false"),
]


@pytest.mark.parametrize("overrides,key,option", UNREAD, ids=[u[1] + "@" + u[2] for u in UNREAD])
def test_a_key_the_option_does_not_read_is_refused(overrides, key, option):
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    msg = str(info.value)
    assert msg.startswith(f"{key}:") and option in msg and "does not read" in msg
    assert "the keys of " + option + " are [" in msg


@pytest.mark.parametrize("overrides,check", [
    (["data=mrc", "data.path=s.mrc", "data.binning=4"], lambda c: c.data.binning == 4),
    (["model=voxel", "model.voxel_shape=[4,5,6]"], lambda c: c.model.voxel_shape == [4, 5, 6]),
    (["sampler=dataloader", "sampler.num_workers=3"], lambda c: c.sampler.num_workers == 3),
    (["schedule=plateau", "schedule.plateau_patience=3"], lambda c: c.schedule.plateau_patience == 3),
    (["pose=refine", "pose.start_step=5"], lambda c: c.pose.start_step == 5),
])
def test_the_same_key_with_an_option_that_reads_it_is_taken(overrides, check):
    assert check(compose_config(overrides))


def test_a_background_value_without_a_background_term_is_refused():
    with pytest.raises(ConfigError, match=r"^intensity.background_value: intensity.background=none does not read"):
        compose_config(["intensity=none", "intensity.background_value=3"])
    assert compose_config(["intensity=learn", "intensity.background_value=3"]).intensity.background_value == 3.0


def test_every_config_group_refuses_a_misspelled_key():
    """Groups without options refuse unknown keys too (from_dict; Hydra refuses them first)."""
    import dataclasses

    groups = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(typing_hint(f.name))]
    assert len(groups) == 16
    for name in groups:
        with pytest.raises(ConfigError, match=f"{name}.*nosuchkey"):
            from_dict(Config, {name: {"nosuchkey": 1}})


def test_cli_refuses_binning_on_the_phantom(tmp_path):
    """The issue's example: one line naming data.binning, exit code 2, no run folder left behind."""
    from cli_helpers import cli

    res = cli(["data.binning=4", "optim.steps=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    text = res.stdout + res.stderr
    assert "data.binning: data.source=phantom does not read this key" in text
    assert "Traceback" not in text and not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------- YAML and schema in step
SELECTORS = {"intensity": "background", "precision": "dtype", "kernels": "backend", "runtime": "device"}


def _option_class(group: str, values: dict):
    import typing

    from fasttomo.config import GroupOption

    tp = typing.get_type_hints(Config)[group]
    if isinstance(tp, type) and issubclass(tp, GroupOption):
        base = tp.group_base()
        return base.option_class(values.get(base._selector, base._default_option())), base._selector
    return tp, SELECTORS.get(group)


def _own_values(path: Path) -> dict:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    data.pop("defaults", None)
    return data


def _option_values(group: str, path: Path) -> dict:
    """The values an option file sets, with those of the files its defaults list extends."""
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    merged: dict = {}
    for d in data.get("defaults", []):
        if isinstance(d, str) and d != "_self_":
            merged.update(_option_values(group, path.parent / f"{d}.yaml"))
    merged.update(_own_values(path))
    return merged


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS if g != "experiment"
                                          for p in sorted((CONFIGS / g).glob("*.yaml"))])
def test_option_files_hold_only_what_differs_from_the_schema(group, option):
    """Every key an option file sets is one its option reads, and none restates the schema's
    default (except the key that selects the option), so a default lives in one place."""
    import dataclasses

    path = CONFIGS / group / f"{option}.yaml"
    values = _option_values(group, path)
    cls, selector = _option_class(group, values)
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(cls)}
    for key, value in _own_values(path).items():
        assert key in defaults, f"{path}: {key} is not read by {cls.__name__}"
        if key != selector:
            assert value != defaults[key], f"{path}: {key}: {value!r} restates the default of {cls.__name__}"


def test_primary_config_restates_no_default():
    import yaml

    data = yaml.safe_load((CONFIGS / "reconstruct.yaml").read_text())
    for key in ("defaults", "hydra"):
        data.pop(key)
    assert data == {}, f"configs/reconstruct.yaml sets {sorted(data)}: leave defaults to src/fasttomo/config.py"


@pytest.mark.parametrize("group", [g for g in GROUPS if g not in ("experiment",)])
def test_every_key_is_visible_in_a_yaml_of_its_group(group):
    """Every key of every option of a group appears (set, or in a comment with its default) in
    one of the group's files, so a user browsing configs/ sees every switch."""
    import re
    import typing

    from fasttomo.config import group_option_classes, option_keys

    text = "\n".join(p.read_text() for p in (CONFIGS / group).glob("*.yaml"))
    tp = typing.get_type_hints(Config)[group]
    for cls in group_option_classes(tp):
        for key in option_keys(cls):
            assert re.search(rf"^\s*#?\s*{key}:", text, re.M), f"configs/{group}/: {key} ({cls.__name__}) is in no file"


def test_top_level_keys_are_visible_in_the_primary_config():
    import dataclasses
    import re

    text = (CONFIGS / "reconstruct.yaml").read_text()
    for f in dataclasses.fields(Config):
        if f.name in GROUPS:
            continue
        assert re.search(rf"^#\s*{f.name}:", text, re.M), f"{f.name} is not shown in configs/reconstruct.yaml"
        if dataclasses.is_dataclass(typing_hint(f.name)):
            for sub in dataclasses.fields(typing_hint(f.name)):
                assert re.search(rf"^#\s+{sub.name}:", text, re.M), f"{f.name}.{sub.name} not in reconstruct.yaml"


def typing_hint(name: str):
    import typing

    return typing.get_type_hints(Config)[name]


def test_cuda_graph_switch_is_in_a_runtime_file():
    assert "cuda_graph: auto" in (CONFIGS / "runtime" / "auto.yaml").read_text()


# ----------------------------------------------------------------------------------- older checkpoints
def test_an_old_checkpoint_config_is_upgraded():
    """Configs stored by fasttomo before one schema per option (every key of every source, moved
    keys under their old names) still build: moved keys are renamed, keys the option never read
    are dropped (that run ignored them)."""
    from fasttomo.config import to_dict, upgrade

    old = to_dict(Config())
    old["data"].update({"binning": 1, "crop": None, "hdf5_stack": "/tiltseries/stack", "normalize": "none"})
    old["model"]["learn_rotations"] = old["model"].pop("learn_frames")
    old["model"].update({"iterations": 100, "voxel_shape": None})
    old["sampler"]["samples_per_ray"] = 24
    del old["projector"]
    old["sampler"]["num_workers"] = 0
    old["schedule"].update({"plateau_patience": 50, "plateau_factor": 0.5})
    old["pose"].update({"learn_rotations": True, "learn_z1": True, "learn_shifts": True, "start_step": 0})
    cfg = from_dict(Config, upgrade(old))
    assert cfg.projector.samples_per_ray == 24 and cfg.model.learn_frames is True
    assert to_dict(cfg) == {**to_dict(Config()), "projector": {"samples_per_ray": 24}}


def test_an_old_refined_run_keeps_learning_z1():
    """A refined run saved before pose.learn_z1 existed learned z1 with z3: resumed, it still does
    (today's default, false, is for new runs); a saved learn_z1 is kept as it was."""
    from fasttomo.config import to_dict, upgrade

    old = to_dict(from_dict(Config, {"pose": {"learn": True}}))
    assert old["pose"]["learn_z1"] is False        # today's default
    del old["pose"]["learn_z1"]
    assert from_dict(Config, upgrade(old)).pose.learn_z1 is True
    assert from_dict(Config, upgrade({**old, "pose": {**old["pose"], "learn_z1": False}})).pose.learn_z1 is False
    fixed = to_dict(Config())
    assert "learn_z1" not in upgrade(fixed)["pose"]   # fixed poses read no such key


def test_the_validation_cadence_follows_the_step_count_unless_given():
    """logging.val_every=null: every 100 steps up to 2500 (the embedded run's 1500 included), then
    about 25 checks a run; a given value is kept; 0 is refused with the key named."""
    from fasttomo.train.trainer import TrainerConfig, auto_val_every

    assert [auto_val_every(s) for s in (150, 1500, 2500, 2750, 4000, 5250, 6500)] == [100, 100, 100, 150, 200,
                                                                                         250, 300]
    assert TrainerConfig.from_config(compose_config(["optim.steps=5250"])).val_every == 250
    assert TrainerConfig.from_config(compose_config(["optim.steps=5250", "logging.val_every=70"])).val_every == 70
    with pytest.raises(ConfigError, match="logging.val_every"):
        compose_config(["logging.val_every=0"])
