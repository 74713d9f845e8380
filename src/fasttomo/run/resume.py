"""The config of a resumed run: the checkpoint's, with the command line's changes where it names
keys, and refusal of the changes a continuation cannot make.

``resume=<checkpoint or run folder>`` continues the saved run. Its settings are the saved ones
(the checkpoint holds the resolved config), so ``resume=<run> optim.steps=4000`` is the whole
command however the run was started. Keys given on the command line replace the saved values:

* freely: where and how to write and log (``output.*``, ``logging.*``, ``name``), the total step
  count ``optim.steps``, threads and CUDA-graph use, the guard;
* with a warning that the continuation is no longer exact: learning rates and the rest of the
  optimizer, schedule, loss, precision, kernels, device and seed;
* refused, naming the key: what fixes the model and the data it is fitted to -- ``model.*``,
  ``data.*`` (except ``data.path``/``data.angles``: a moved file is fine, the sampler's
  fingerprint checks that the data are the same), the sampler's split and batch
  (``sampler.batch_size``, ``val_fraction``, ``split_seed``, ``drop_last``, ``skip_masked``,
  ``patch_size``) and
  the pose switches (``pose.learn*``).

``resume``, ``output.dir``, ``output.overwrite`` and ``dry_run`` always come from this
invocation, never from the checkpoint.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

from fasttomo.config import ConfigError, flatten  # noqa: F401 - flatten: public here too

FROM_INVOCATION = ("resume", "output.dir", "output.overwrite", "dry_run")
IMMUTABLE = ("data", "model", "sampler.batch_size", "sampler.val_fraction", "sampler.split_seed", "sampler.drop_last",
             "sampler.skip_masked", "sampler.patch_size", "pose.learn", "pose.learn_rotations", "pose.learn_shifts")
MUTABLE_EXCEPTIONS = ("data.path", "data.angles")


PATH_KEYS = ("data.path", "data.angles", "data.xf", "data.aln", "data.xtilt", "evaluation.truth",
             "evaluation.true_poses")
"""Settings that name a file: a run keeps them absolute (``~`` expanded), so its config.yaml and
checkpoints name the same files from any working directory (``resume=`` from another folder)."""


def absolute_paths(config: dict) -> dict:
    """``config`` (a nested config dict) with the relative file names of :data:`PATH_KEYS` made
    absolute against the working directory, ``~`` expanded; in place, and returned."""
    import os

    for key in PATH_KEYS:
        group, name = key.split(".")
        value = (config.get(group) or {}).get(name) if isinstance(config.get(group), dict) else None
        if isinstance(value, str) and value and value != "???":
            config[group][name] = os.path.abspath(os.path.expanduser(value))
    return config


def _under(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _set(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value


def immutable_changes(saved: dict, now: dict) -> list[str]:
    """Keys that cannot change on resume and differ between ``saved`` and ``now`` (config dicts)."""
    a, b = flatten(saved), flatten(now)
    return sorted(k for k in set(a) | set(b) if _under(k, IMMUTABLE) and not _under(k, MUTABLE_EXCEPTIONS)
                  and k in a and k in b and a[k] != b[k])


def refuse_immutable(saved: dict, now: dict, source: str, origin: dict[str, str] | None = None) -> None:
    """Raise :class:`ConfigError` naming the first keys that cannot change on resume (``origin``:
    the command-line item that set each key, named in the message)."""
    bad = immutable_changes(saved, now)
    if bad:
        a, b = flatten(saved), flatten(now)
        origin = origin or {}
        order = {k: i for i, k in enumerate(origin)}  # command-line (and option-file) order first
        bad.sort(key=lambda k: (order.get(k, len(order)), k))
        given = [origin.get(k, k) for k in bad[:4]]
        listing = "; ".join(f"{k}: saved {a[k]!r}, given {b[k]!r}" + (f" by {origin[k]}" if origin.get(k, k) != k
                                                                      else "") for k in bad[:4])
        raise ConfigError(
            f"{bad[0]}: cannot change when resuming from {source} ({listing}{'; ...' if len(bad) > 4 else ''}); "
            f"these fix the model and the data it is fitted to. Drop {', '.join(dict.fromkeys(given))} from the "
            "command line to continue the saved run with its own settings, or start a new run without resume=.")


FREE_ON_RESUME = ("resume", "name", "output", "logging", "optim.steps", "runtime.threads", "guard", "dry_run",
                  "runtime.cuda_graph")  # captured or eager: the same step
"""Settings a resumed run may change without a warning (where and how to log, the total step count)."""


def warn_changes(saved: dict, now: dict, source: str) -> list[str]:
    """Log (warning) and return the settings that differ from the saved run's, other than
    :data:`FREE_ON_RESUME`; an exact continuation needs none."""
    import logging

    a, b = flatten(saved), flatten(now)
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and not _under(k, FREE_ON_RESUME))
    if changed:
        logging.getLogger("fasttomo.train").warning(
            "resuming from %s with settings that differ from the saved run (the continuation is not exact): %s",
            source, ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed))
    return changed


def merge(saved: dict, current: dict, named: Iterable[str]) -> dict:
    """The resumed run's config dict: ``saved`` (the checkpoint's), with the keys (or whole groups)
    in ``named`` and :data:`FROM_INVOCATION` taken from ``current`` (this invocation's composed
    config). Keys the saved config lacks (a newer fasttomo) come from ``current``; keys this
    version no longer has are dropped."""
    named = list(named)
    take_now = [*FROM_INVOCATION, *named]
    out = copy.deepcopy(current)
    flat_saved = flatten(saved)
    for key, value in flatten(current).items():
        if _under(key, take_now) or key not in flat_saved:
            continue
        _set(out, key, copy.deepcopy(flat_saved[key]))
    return out


def named_keys(overrides: Iterable[str], saved: dict, option_values) -> dict[str, str]:
    """Dotted keys that the command-line ``overrides`` set, for :func:`merge`, each with the
    command-line item that set it.

    ``key=value`` names ``key``. A group option (``data=mrc``, ``schedule=plateau``,
    ``experiment=quick``) names the keys its file sets to a value other than the saved one
    (``option_values(group, option)`` returns that file's flattened, fully prefixed keys); keys the
    file leaves null or required (``???``) name nothing. So repeating the original command
    changes nothing, while ``data=phantom`` after ``data=mrc`` names ``data.source`` (refused)."""
    flat_saved = flatten(saved)
    out: dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.lstrip("+~").partition("=")
        key = key.strip()
        if not sep or key == "hydra" or key.startswith("hydra."):
            continue
        values = option_values(key, value.strip())
        if values is None:  # a plain key
            out[key] = item
            continue
        for k, v in values.items():
            if v is None or v == "???":
                continue
            if k not in flat_saved or flat_saved[k] != v:
                out.setdefault(k, item)
    for item in overrides:  # an explicit key=value wins over a group option's value for the same key
        key, sep, _ = item.lstrip("+~").partition("=")
        if sep and key.strip() in out:
            out[key.strip()] = item
    return out
