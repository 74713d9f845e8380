"""`fasttomo-simulate`: write the built-in synthetic tilt series and its ground truth to files.

    fasttomo-simulate out=phantom format=mrc data.width=96 data.noise=0.05
        -> phantom.mrc (stack), phantom.rawtlt (angles, degrees), phantom_truth.mrc (volume)
    fasttomo-simulate out=phantom format=h5
        -> phantom.h5 (fasttomo's HDF5 layout: stack, angles and ground truth)

Feed them back with ``fasttomo-reconstruct data=mrc data.path=phantom.mrc data.angles=phantom.rawtlt``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from fasttomo.config import ConfigError, DataConfig, from_dict

log = logging.getLogger("fasttomo")


@dataclasses.dataclass
class SimulateConfig:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    out: str = "phantom"
    """Output base path: <out>.mrc + <out>.rawtlt + <out>_truth.mrc, or <out>.h5."""
    format: str = "mrc"
    """mrc or h5."""
    overwrite: bool = False
    """Replace existing files (otherwise an existing file is an error)."""


ConfigStore.instance().store(name="fasttomo_simulate_schema", node=SimulateConfig)


def simulate(data_cfg: DataConfig, out: str, fmt: str, overwrite: bool = False) -> list[Path]:
    """Write the phantom tilt series (and ground truth) ; returns the written paths."""
    from fasttomo.data.io import write_tiltseries
    from fasttomo.data.io.volume import write_volume
    from fasttomo.data.phantom import make_tiltseries

    if fmt not in ("mrc", "h5"):
        raise ConfigError(f"format: must be mrc or h5, got {fmt!r}.")
    if data_cfg.source != "phantom":
        raise ConfigError("data.source: fasttomo-simulate only writes the built-in phantom (data=phantom).")
    ts = make_tiltseries(data_cfg)
    base = Path(out)
    written = write_tiltseries(base.with_suffix(f".{fmt}"), ts, fmt, overwrite=overwrite)
    paths = list(written) if isinstance(written, (list, tuple)) else [Path(written)]
    if fmt == "mrc" and ts.ground_truth is not None:
        truth = base.parent / f"{base.name}_truth.mrc"
        write_volume(truth, ts.ground_truth, ts.pixel_size, label="fasttomo phantom ground truth",
                     attrs={"source": "fasttomo-simulate"}, fmt="mrc", overwrite=overwrite)
        paths.append(truth)
    for p in paths:
        log.info("wrote %s", p)
    return paths


def main() -> None:
    from fasttomo.data.tiltseries import TiltSeriesError
    from fasttomo.reconstruct import config_dir

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="simulate")
    def _app(cfg: DictConfig) -> None:
        try:
            sim = from_dict(SimulateConfig, OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
            simulate(sim.data, sim.out, sim.format, sim.overwrite)
        except (ConfigError, TiltSeriesError, FileExistsError) as exc:
            log.error("%s", exc)
            sys.exit(2)

    _app()


if __name__ == "__main__":
    main()
