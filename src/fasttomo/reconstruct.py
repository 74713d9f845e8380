"""`fasttomo-reconstruct`: the Hydra entry point (one of the two modules that import Hydra).

    fasttomo-reconstruct                                   # built-in phantom, default model
    fasttomo-reconstruct data=mrc data.path=tilts.mrc data.angles=tilts.rawtlt
    fasttomo-reconstruct -m optim.steps=200,400            # a sweep, one run folder per job
    torchrun --standalone --nproc-per-node=2 -m fasttomo.reconstruct hydra.run.dir=outputs/ddp1

Hydra composes configs/reconstruct.yaml with the chosen group options and overrides; the result is
converted to the typed, validated ``fasttomo.config.Config`` and handed to the pipeline.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import yaml
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from fasttomo.config import Config, ConfigError, from_dict

log = logging.getLogger("fasttomo")

# The typed schema is the first entry of configs/reconstruct.yaml's defaults list: every field of
# every group exists (with its default and type) whichever group option is chosen, so any value
# can be overridden from the command line and a misspelled key is rejected by Hydra at once.
ConfigStore.instance().store(name="fasttomo_schema", node=Config)


def config_dir() -> str:
    """The configs folder: shipped inside the package (wheel install) or at the repository top
    level (source checkout / editable install)."""
    here = Path(__file__).resolve().parent
    for cand in (here / "configs", here.parents[1] / "configs"):
        if (cand / "reconstruct.yaml").is_file():
            return str(cand)
    raise FileNotFoundError(f"fasttomo: no configs folder found next to {here}; reinstall the package.")


def _option_values(group: str, option: str) -> dict | None:
    """The flattened, fully prefixed keys a group option's file sets (resume.named_keys); None
    when ``group`` is not a config group."""
    from fasttomo.resume import flatten

    root = Path(config_dir())
    if group == "hydra" or not (root / group).is_dir():
        return None
    if option in ("null", "None", ""):
        return {}
    path = root / group / f"{option}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    data.pop("defaults", None)
    return flatten(data) if group == "experiment" else flatten(data, f"{group}.")


def _resumed(data: dict, overrides: list[str]) -> dict:
    """The config of a resumed run: the checkpoint's, changed only where ``overrides`` name keys
    (see fasttomo/resume.py)."""
    from fasttomo import resume as rs
    from fasttomo.train.checkpoint import find_checkpoint, read_config

    path = find_checkpoint(data["resume"])
    saved = read_config(path)
    if saved is None:  # a checkpoint without its config: the command line is the config
        return {**data, "resume": str(path)}
    named = rs.named_keys(overrides, saved, _option_values)
    merged = rs.merge(saved, data, named)
    merged["resume"] = str(path)
    rs.refuse_immutable(saved, merged, str(path), named)
    return merged


def to_config(cfg: DictConfig, overrides: list[str] | None = None) -> Config:
    """Hydra/omegaconf config -> typed Config (errors name the field and the fix). With
    ``resume=...`` the settings come from the checkpoint, changed only by what ``overrides`` (the
    command line) name."""
    resume = OmegaConf.select(cfg, "resume", default=None)
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=not resume)
    except MissingMandatoryValue as exc:
        key = getattr(exc, "full_key", None) or str(exc)
        raise ConfigError(f"{key}: this value is required and was not given; set {key}=<value> on the command line.") from exc
    data.pop("hydra", None)
    if resume:
        data = _resumed(data, list(overrides or []))
        from fasttomo.resume import flatten

        missing = [k for k, v in flatten(data).items() if v == "???"]
        if missing:
            raise ConfigError(f"{missing[0]}: this value is required and was not given; set {missing[0]}=<value> on "
                              "the command line.")
    return from_dict(Config, data)


def compose_config(overrides: list[str] | None = None) -> Config:
    """Compose the primary config with ``overrides`` through Hydra's compose API (tests, notebooks)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="fasttomo"):
        cfg = compose(config_name="reconstruct", overrides=list(overrides or []))
    return to_config(cfg, list(overrides or []))


def run(cfg: Config) -> dict:
    """Run one reconstruction (cfg.output.dir must be set). Returns the metrics dict."""
    from fasttomo.pipeline import run_reconstruction

    return run_reconstruction(cfg)


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by input or config: reported as one clear line (exit code 2), no traceback."""
    from fasttomo.data.tiltseries import TiltSeriesError
    from fasttomo.kernels.dispatch import KernelUnavailableError
    from fasttomo.pipeline import OutputExistsError
    from fasttomo.train.checkpoint import CheckpointError

    return (ConfigError, TiltSeriesError, OutputExistsError, CheckpointError, KernelUnavailableError,
            FileNotFoundError)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="reconstruct")
def _app(cfg: DictConfig) -> float | None:
    try:
        config = to_config(cfg, list(HydraConfig.get().overrides.task))
        if not config.output.dir:
            config.output.dir = HydraConfig.get().runtime.output_dir
        metrics = run(config)
    except user_errors() as exc:
        log.error("%s", exc)
        sys.exit(2)
    return metrics.get("pearson_global") if metrics else None


def main() -> None:
    _app()


if __name__ == "__main__":
    main()
