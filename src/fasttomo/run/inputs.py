"""The inputs of a run, checked as a whole before anything is trained or written (the run's and
the dry run's one path): the tilt series, its ground truth, the held-out views, the half sets."""

from __future__ import annotations

from fasttomo.config import Config, ConfigError
from fasttomo.data.load import load_tiltseries
from fasttomo.quality.scoring import attach_truth, split_holdout


def load_inputs(cfg: Config):
    """(training series, held-out views) of ``cfg``, every check of the inputs made (the run's and
    the dry run's): the data read and validated, the truth attached, the held-out views set aside,
    and enough views left for the half sets (2 in each)."""
    ts = load_tiltseries(cfg.data)
    if cfg.evaluation.truth:
        attach_truth(ts, cfg.evaluation.truth, cfg.data.thickness)
    ts, hold = split_holdout(ts, cfg.evaluation.holdout_views)
    if (cfg.evaluation.half_sets or cfg.output.half_volumes) and ts.n_tilts < 4:
        which = "evaluation.half_sets" if cfg.evaluation.half_sets else "output.half_volumes"
        raise ConfigError(f"{which}: the even and the odd views are fitted apart and each half needs 2 views at "
                          f"least, but {ts.n_tilts} views are left to train on"
                          f"{' after evaluation.holdout_views' if hold is not None else ''}; drop {which}=true.")
    return ts, hold
