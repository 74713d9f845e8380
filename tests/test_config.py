"""Config composition (Hydra compose API) of every group option, and config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import HydraException

from fasttomo.config import Config, ConfigError, DataConfig, from_dict
from fasttomo.reconstruct import compose_config, config_dir

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
        assert cfg.sampler.batch_size == 8192 and cfg.sampler.samples_per_ray == 200
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
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    assert field in str(info.value)


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
