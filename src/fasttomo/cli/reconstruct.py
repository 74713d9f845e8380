"""`fasttomo-reconstruct`: the Hydra entry point.

    fasttomo-reconstruct                                   # built-in phantom, default model
    fasttomo-reconstruct data=mrc data.path=tilts.mrc data.angles=tilts.rawtlt
    fasttomo-reconstruct -m optim.steps=200,400            # a sweep, one run folder per job
    torchrun --standalone --nproc-per-node=2 -m fasttomo.cli.reconstruct hydra.run.dir=outputs/ddp1

Hydra composes configs/reconstruct.yaml with the chosen group options and overrides; the result is
converted to the typed, validated ``fasttomo.config.Config`` and handed to the pipeline. With
``resume=...`` the settings come from the checkpoint instead, changed only where the command line
names keys (resume.py). ``dry_run=true`` checks everything and exits (preflight.py).

Exit codes: 0 done; 1 results could not be written (one line: what was saved where) or an
unexpected error (traceback); 2 config, data, output folder or checkpoint problem (one line);
3 training diverged; 130 / 143 stopped by SIGINT / SIGTERM (stop.py). A folder Hydra created for a
run that wrote nothing (a config error, a dry run, output.dir elsewhere) is removed again.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import sys
import time
from pathlib import Path

from fasttomo.config import Config, ConfigError, config_dir, from_dict, hydra_schema, strip_unset, upgrade

log = logging.getLogger("fasttomo")


@functools.lru_cache(maxsize=None)
def register_schema() -> None:
    """Register the typed schema, the first entry of configs/reconstruct.yaml's defaults list:
    every key of every option of every group exists (typed, left unset) whichever group option is
    chosen, so any value can be overridden from the command line and a misspelled key is rejected
    by Hydra at once. The keys nothing set are dropped before from_dict, which takes their
    defaults from the chosen option's dataclass and refuses a key that option does not read.
    Called (once) before Hydra composes, not at import: --help and the command-line checks need
    no Hydra."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="fasttomo_schema", node=hydra_schema(Config))


EXIT_USER_ERROR = 2   # config, input data, output folder, checkpoint: one line, no traceback
EXIT_DIVERGED = 3     # training diverged and could not be recovered
EXIT_WRITE_FAILED = 1  # results could not be written (the line says what was saved where)


def _option_values(group: str, option: str) -> dict | None:
    """The flattened, fully prefixed values a group option sets (resume.named_keys): its file's,
    over the defaults of the option's schema (``data=mrc`` means the mrc schema's defaults too,
    e.g. data.normalize=none); an experiment's file alone. None when ``group`` is not a config
    group."""
    import dataclasses
    import typing

    from fasttomo.cli.help import option_file
    from fasttomo.config import flatten, group_option_classes

    root = config_dir()
    if group == "hydra" or not (Path(root) / group).is_dir():
        return None
    if option in ("null", "None", ""):
        return {}
    data = option_file(root, group, option)
    if group == "experiment":
        return flatten(data)
    tp = typing.get_type_hints(Config).get(group)
    values: dict = {}
    if tp is not None:
        base = group_option_classes(tp)[0]
        cls = base
        if hasattr(base, "group_base"):
            b = base.group_base()
            cls = b._options.get(data.get(b._selector, b._default_option()), base)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
    values.update(data)
    return flatten(values, f"{group}.")


def _resumed(data: dict, overrides: list[str]) -> dict:
    """The config of a resumed run: the checkpoint's, changed only where ``overrides`` name keys
    (see fasttomo/resume.py)."""
    from fasttomo.run import resume as rs
    from fasttomo.train.checkpoint import find_checkpoint, read_config

    path = find_checkpoint(data["resume"])
    saved = read_config(path)
    if saved is None:  # a checkpoint without its config: the command line is the config
        return {**data, "resume": str(path)}
    saved = rs.absolute_paths(upgrade(saved))  # an older fasttomo's keys renamed; file names as the run reads them
    named = rs.named_keys(overrides, saved, _option_values)
    merged = rs.merge(saved, data, named)
    merged["resume"] = str(path)
    rs.refuse_immutable(saved, merged, str(path), named)
    return merged


def to_config(cfg, overrides: list[str] | None = None) -> Config:
    """Hydra/omegaconf config -> typed Config (errors name the field and the fix). With
    ``resume=...`` the settings come from the checkpoint, changed only by what ``overrides`` (the
    command line) name."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except MissingMandatoryValue as exc:  # pragma: no cover - interpolation of an unset key
        key = getattr(exc, "full_key", None) or str(exc)
        raise ConfigError(f"{key}: this value is required and was not given; set {key}=<value> on the command line.") from exc
    except OmegaConfBaseException as exc:  # e.g. an interpolation ${...} that does not resolve
        key = getattr(exc, "full_key", None)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{key}: {first}" if key else first) from None
    data.pop("hydra", None)
    from fasttomo.run.resume import absolute_paths

    absolute_paths(data)  # config.yaml and the checkpoints name the files from any working directory
    if data.get("resume") not in (None, "???"):
        data = _resumed(data, list(overrides or []))
    else:
        _refuse_experiment_keys(strip_unset(data), list(overrides or []))
    return from_dict(Config, strip_unset(data))


def _refuse_experiment_keys(data: dict, overrides: list[str]) -> None:
    """Name the experiment when its file, not the command line, sets keys the chosen group option
    does not read (experiment=flagship sets the phantom's data.width; with data=mrc from_dict would
    tell the user to remove a key they never typed), and give its other settings to use instead."""
    import typing

    from fasttomo.cli.help import fmt_value
    from fasttomo.config import GroupOption, option_keys

    given = {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] for o in overrides if "=" in o}
    exp = given.get("experiment")
    values = _option_values("experiment", exp) if exp else None
    if not values:
        return
    hints = typing.get_type_hints(Config)
    for group in dict.fromkeys(k.split(".")[0] for k in values):
        tp = hints.get(group)
        if not (isinstance(tp, type) and issubclass(tp, GroupOption)) or not isinstance(data.get(group), dict):
            continue
        base = tp.group_base()
        sel = data[group].get(base._selector, base._default_option())
        reads = option_keys(base._options.get(sel, base))
        unread = [k for k in values if k.startswith(group + ".") and k.split(".")[1] not in reads and k not in given]
        if not unread:
            continue
        readers = [v for v, c in base._options.items() if all(k.split(".")[1] in option_keys(c) for k in unread)]
        whose = f"keys of {group}.{base._selector}={'|'.join(map(str, readers))}" if readers else "keys"
        chosen = f"{group}={given[group]}" if group in given else f"{group}.{base._selector}={sel}"
        rest = " ".join(f"{k}={fmt_value(v)}" for k, v in values.items() if k not in unread and k not in given)
        raise ConfigError(f"experiment={exp} sets {', '.join(unread)}, {whose} that {chosen} does not read; to use "
                          f"the recipe's other settings with {chosen}, replace experiment={exp} with: {rest}.")


def compose_config(overrides: list[str] | None = None) -> Config:
    """Compose the primary config with ``overrides`` through Hydra's compose API (tests, notebooks)."""
    from hydra import compose, initialize_config_dir

    register_schema()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="fasttomo"):
        cfg = compose(config_name="reconstruct", overrides=list(overrides or []))
    return to_config(cfg, list(overrides or []))


def run(cfg: Config) -> dict:
    """Run one reconstruction (cfg.output.dir must be set), or the dry run when cfg.dry_run.
    Returns the metrics dict (the dry run's report)."""
    if cfg.dry_run:
        from fasttomo.run.preflight import dry_run

        return dry_run(cfg)
    from fasttomo.run.pipeline import run_reconstruction

    return run_reconstruction(cfg)


def exit_code(exc: BaseException) -> int | None:
    """The process exit code for ``exc`` (README "What a run guarantees"); None: a bug (traceback)."""
    if isinstance(exc, ConfigError):  # before the imports below, which load torch
        return EXIT_USER_ERROR
    from fasttomo.run.outputs import OutputWriteError
    from fasttomo.run.stop import RunInterrupted
    from fasttomo.train.guard import DivergenceError

    if isinstance(exc, RunInterrupted):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, DivergenceError):
        return EXIT_DIVERGED
    if isinstance(exc, OutputWriteError):
        return EXIT_WRITE_FAILED
    from fasttomo.run.pipeline import user_errors

    if isinstance(exc, user_errors()):
        return EXIT_USER_ERROR
    return None


# Folders that existed when the program started, among those Hydra may create for this run
# (recorded by main(); a folder Hydra made for a run that wrote nothing is removed again).
_STARTED = time.time()
_EXISTED: set[str] = set()
_CHECKED: set[str] = set()


def _note_existing_folders(argv: list[str]) -> None:
    cands = [a.split("=", 1)[1] for a in argv if a.startswith(("hydra.run.dir=", "output.dir="))]
    cands.append(f"outputs/{datetime.date.today():%Y-%m-%d}")
    for c in cands:
        if "${" in c:
            continue
        p = Path(c).resolve()
        for q in (p, *p.parents):
            _CHECKED.add(str(q))
            if q.exists():
                _EXISTED.add(str(q))


CLAIM = ".fasttomo-claim"
_claim: list[Path] = []


def _claimed(folder: str) -> str:
    """The time-stamped folder Hydra chose, or, when a run started in the same second claimed it
    (a job array, a shell loop), the first free of <folder>-2, <folder>-3, ...: a claim file
    created exclusively, removed when the run ends (by then the run folder's lock holds it). Under
    torchrun every rank's folder is rank 0's, so there the folder is kept as it is."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return folder
    for k in range(1, 100):
        cand = Path(folder if k == 1 else f"{folder}-{k}")
        try:
            cand.mkdir(parents=True, exist_ok=True)
            os.close(os.open(cand / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        except OSError:  # not writable: the run's own folder check says so
            return folder
        _claim.append(cand / CLAIM)
        if k > 1:
            log.info("output folder %s was taken by a run started in the same second; this run writes to %s",
                     folder, cand)
        return str(cand)
    return folder


def _release_claim() -> None:
    while _claim:
        try:
            _claim.pop().unlink()
        except OSError:
            pass


def _prune_new_empty(folder: str | Path) -> None:
    """Remove ``folder`` and its parents while they are empty and were made by this process."""
    p = Path(folder).resolve()
    stop = Path.cwd().resolve()
    first = True
    while p != stop and p != p.parent:
        try:
            if not p.is_dir() or any(p.iterdir()) or str(p) in _EXISTED:
                return
            if first and str(p) not in _CHECKED and p.stat().st_ctime < _STARTED:
                return  # not predicted and older than this process: not ours
            if not first and str(p) not in _CHECKED:
                return
            p.rmdir()
        except OSError:
            return
        first = False
        p = p.parent


def _hydra_app():
    """The Hydra application (``hydra.main`` over the run), made when the command line passed the
    checks."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    register_schema()

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="reconstruct")
    def _app(cfg) -> float | None:
        hydra_dir = out = HydraConfig.get().runtime.output_dir
        try:
            # the override strings as typed (iterating the ListConfig would resolve a ${...} in them)
            config = to_config(cfg, OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False))
            from fasttomo.kernels import prewarm

            prewarm.start()  # a GPU run: load the fused kernels while the run folder, data and model are prepared
            if not config.output.dir:
                named = any(o.startswith("hydra.run.dir=") for o in HydraConfig.get().overrides.hydra)
                config.output.dir = out = hydra_dir if named or config.dry_run else _claimed(hydra_dir)
            try:
                metrics = run(config)
            finally:
                _release_claim()
        except KeyboardInterrupt:  # Ctrl-C before the run installed its handlers (nothing to save yet)
            from fasttomo.cli.help import other_rank

            _prune_new_empty(out)
            _prune_new_empty(hydra_dir)
            if not other_rank():  # under torchrun every rank gets the Ctrl-C: rank 0 says it
                log.warning("interrupted before the run started; nothing was written")
            sys.exit(130)
        except BaseException as exc:  # noqa: B902 - every outcome gets its exit code
            _prune_new_empty(out)
            _prune_new_empty(hydra_dir)
            code = exit_code(exc)
            if code is None:
                raise
            from fasttomo.cli.help import other_rank

            if not getattr(exc, "fasttomo_logged", False) and not other_rank():
                (log.warning if code >= 128 else log.error)("%s", exc or "interrupted")
            sys.exit(code)
        if config.dry_run or Path(config.output.dir).resolve() != Path(hydra_dir).resolve():
            _prune_new_empty(hydra_dir)
        return metrics.get("pearson_global") if metrics else None

    return _app


DESCRIPTION = """reconstruct a 3-D volume from an electron-tomography tilt series by fitting a
neural field (multi-scale K-Planes in learned rotated frames, decoded by a small MLP) to the measured
pixels through differentiable line integrals, optionally refining the per-view poses. Without
arguments it reconstructs the built-in synthetic phantom (61 tilts over +-60 degrees).

Settings are composed from config groups (choose one option each, e.g. data=mrc) and single keys
(key=value). A run writes its folder (outputs/<date>/<time>/ unless hydra.run.dir=... is given):
the volume (MRC with the voxel size; HDF5, TIFF with output.formats), report.png, metrics.json, the loss curves, a
checkpoint, the log and TensorBoard events."""

COMMON_KEYS = ("data.path", "data.angles", "data.pixel_size", "data.thickness", "data.exclude_views", "data.binning",
               "optim.steps", "model.resolutions", "pose.learn", "runtime.device", "evaluation.half_sets",
               "evaluation.truth", "logging.checkpoint_every", "output.overwrite", "resume", "dry_run")


def program():
    """What ``--help`` and the command-line checks know of this command (fasttomo.cli.help)."""
    from fasttomo.cli.help import Program

    return Program("fasttomo-reconstruct", DESCRIPTION, Config, config_dir(), "reconstruct", COMMON_KEYS, examples=(
        "fasttomo-reconstruct                                  # the built-in phantom",
        "fasttomo-reconstruct data=mrc data.path=tilts.mrc data.angles=tilts.rawtlt data.thickness=120",
        "fasttomo-reconstruct experiment=quality pose=refine     # a recipe, pose refinement",
        "fasttomo-reconstruct -m optim.steps=500,1000            # a sweep: one run folder per job",
        "fasttomo-reconstruct resume=outputs/2026-01-01/10-00-00  # continue a run from its checkpoint",
        "tensorboard --logdir outputs/"))


def folder_problem(argv: list[str]) -> str | None:
    """A ``hydra.run.dir=`` or ``output.dir=`` on the command line that names a file, or lies
    under one (Hydra would stop with a traceback, the run after reading the data), or a sweep's
    ``hydra.sweep.dir=`` that holds an earlier sweep's runs, in words."""
    from fasttomo.run.folder import not_a_folder

    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in ("hydra.run.dir", "output.dir") or not value or "${" in value:
            continue
        why = not_a_folder(value)
        if why:
            return f"{key}={value} {why}; give a folder (new or existing) for the run."
    sweep = next((a.partition("=")[2] for a in argv if a.partition("=")[0] == "hydra.sweep.dir"), "")
    if sweep and "${" not in sweep and sweep_requested(argv) and "output.overwrite=true" not in argv:
        done = sorted(p.parent.name for p in Path(sweep).glob("*/manifest.json"))
        if done:  # Hydra would rewrite the sweep's multirun.yaml before each job refused its folder
            return (f"hydra.sweep.dir={sweep} holds the runs of an earlier sweep (jobs {', '.join(done[:5])}"
                    f"{' ...' if len(done) > 5 else ''}); choose another hydra.sweep.dir, or add "
                    "output.overwrite=true to replace their results.")
    return None


def _asks_for_the_job_config(argv: list[str]) -> bool:
    """``--cfg job`` / ``-c job`` / ``--cfg=job`` (Hydra's flag), without -m and without
    ``-p/--package`` (one package of it: Hydra prints that)."""
    pairs = zip(argv, argv[1:])
    asked = "--cfg=job" in argv or any(a in ("--cfg", "-c") and b == "job" for a, b in pairs)
    package = any(a in ("-p", "--package") or a.startswith("--package=") for a in argv)
    return asked and not package and not sweep_requested(argv)


def print_job_config(argv: list[str]) -> None:
    """The composed and checked config, as the run's config.yaml holds it before the run fills in
    what it chooses from the data (null there: data.thickness, optim.steps, loss.plane_tv ...).
    Hydra's own ``--cfg job`` prints '???' for every key the YAML files leave to the schema."""
    import yaml

    from fasttomo.config import to_dict

    flags = {"--cfg", "-c", "--resolve", "job", "--cfg=job"}
    try:
        cfg = compose_config([a for a in argv if a not in flags and not a.startswith("hydra.")])
    except ConfigError as exc:  # the one line a run gives (check_overrides caught what it can before)
        from fasttomo.cli.help import report

        report(str(exc), "fasttomo-reconstruct")
        sys.exit(EXIT_USER_ERROR)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")


def _start(argv: list[str]) -> None:
    from fasttomo.cli.help import report

    if _asks_for_the_job_config(argv):
        print_job_config(argv)
        return
    problem = folder_problem(argv)
    if problem:
        report(problem, "fasttomo-reconstruct")
        sys.exit(EXIT_USER_ERROR)
    app = _hydra_app()
    with _one_composition(argv):
        app()


def sweep_requested(argv: list[str]) -> bool:
    """Whether the command line asks Hydra for a multirun (-m/--multirun, or hydra.mode set)."""
    return any(a in ("-m", "--multirun") or a.lstrip("+~").startswith("hydra.mode") for a in argv)


@contextlib.contextmanager
def _one_composition(argv: list[str]):
    """Hydra composes the whole config twice for a run: once to read ``hydra.mode``
    (``Hydra.get_mode``, hydra-core 1.3) and once to run. fasttomo's configs never set the mode
    (a test checks it), so unless the command line asks for a sweep the first composition can
    only answer "not set", which is what this gives Hydra without composing (then Hydra runs
    the job as it does for "not set"). A sweep takes Hydra's own path."""
    try:
        from hydra._internal.hydra import Hydra
    except ImportError:  # another Hydra layout: its own two compositions
        yield
        return
    original = getattr(Hydra, "get_mode", None)
    if original is None or sweep_requested(argv):
        yield
        return
    Hydra.get_mode = lambda self, config_name, overrides: None
    try:
        yield
    finally:
        Hydra.get_mode = original


def main() -> None:
    from fasttomo.cli.errors import run_checked

    _note_existing_folders(sys.argv[1:])
    run_checked(program(), sys.argv[1:], lambda: _start(sys.argv[1:]))


def cli() -> None:
    """The console entry point (``fasttomo-reconstruct``, ``python -m fasttomo.cli.reconstruct``):
    ``main()``, then the interpreter's normal exit steps (atexit handlers, logging flushed and
    closed, stdout/stderr flushed) and ``os._exit`` instead of tearing every module down, which
    took about 1 s after each run (torch's objects and extensions; 0.8-1.1 s on an H200 machine).
    Every output is written and closed by then. An unexpected exception still ends the normal
    way (traceback, exit 1). In-process callers use ``main()``."""
    import atexit
    import os

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    from fasttomo.cli.help import other_rank

    if os.environ.get("FASTTOMO_EXIT_FILE") and not other_rank():
        try:  # scripts/launch_ddp.sh exits with it: torchrun's own code is 1 for any failed rank
            with open(os.environ["FASTTOMO_EXIT_FILE"], "w") as f:
                f.write(f"{code}\n")
        except OSError:
            pass
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    cli()
