"""One error style for everything a user types on the command line.

The entry points call :func:`check_overrides` on ``sys.argv`` before Hydra composes anything, so a
mistyped group option, key or value is reported the way fasttomo reports its own errors: one
line naming the key and the fix, no Hydra internals, no traceback, exit code 2.

    data=mrcc               -> data=mrcc: no option 'mrcc' in group data; the options are hdf5, mrc,
                               phantom, tiff. Did you mean data=mrc?
    optim.stpes=10          -> optim.stpes: no such key. Did you mean optim.steps?
    optim.steps=1e3         -> optim.steps: expected an integer, got 1e3 (a number with a fraction or
                               exponent); write it as a whole number, e.g. optim.steps=1000.
    data.exclude_views=5    -> data.exclude_views: expected a list, got 5; write data.exclude_views=[5].
    data.exclude_views=1-5,9 -> data.exclude_views: expected a list, got 1-5,9 (without brackets, Hydra reads
                               values separated by commas as a sweep); write data.exclude_views=[1,2,3,4,5,9].
    --dry-run               -> --dry-run: fasttomo takes key=value settings, not --options; write dry_run=true.

What the checks here cannot see (an interpolation that does not resolve, a value a schema's
``__post_init__`` refuses) still ends in one line: the entry point turns Hydra's and OmegaConf's
exceptions into :class:`CommandLineError` through :func:`from_hydra`, and a run folder Hydra
cannot create through :func:`_folder_not_created`. The only Hydra import is
its override parser, inside :func:`check_overrides` (the entry points are Hydra's layer).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import sys
import types
import typing
from typing import Any, Union

from fasttomo.cli.help import (Program, field_type, fmt_value, handle_help, nearest, option_values, report, schema_keys,
                               sections)

EXIT_USER_ERROR = 2

# Hydra's command-line flags: those followed by a value, and those standing alone
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
_FLAGS = _FLAGS_WITH_VALUE | {"--help", "-h", "--hydra-help", "--version", "--resolve", "--run", "-r", "--multirun",
                              "-m"}


class CommandLineError(ValueError):
    """Something typed on the command line is wrong; the message names it and the fix."""


def overrides_of(argv: list[str]) -> list[str]:
    """The key=value / group=option / +key / ~key tokens of ``argv`` (Hydra's flags left out)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.startswith("-") and not a.startswith("--help"):
            skip = a in _FLAGS_WITH_VALUE
            continue
        if a.startswith("--help"):
            continue
        out.append(a)
    return out


def _did_you_mean(names: list[str], fmt: str = "{}") -> str:
    return f" Did you mean {' or '.join(fmt.format(n) for n in names)}?" if names else ""


# --------------------------------------------------------------------------------------- types
def _is_list_type(tp: Any) -> bool:
    return tp is list or typing.get_origin(tp) is list


def _type_error(key: str, raw: str, value: Any, tp: Any, example: Any, doc: str = "") -> str | None:
    """Why ``value`` (typed as ``raw``) does not fit ``tp``; None when it does (or might: strings
    that OmegaConf converts, interpolations). A list whose documentation opens with its form
    (``[min, max] ...``) has that many values: a single value is not 'a list of one' there."""
    if isinstance(value, str) and "${" in value:
        return None
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)]
    if value is None:
        if optional or not kinds:
            return None
        return f"{key}: cannot be null; give a value, e.g. {key}={fmt_value(example)}."
    if not kinds or any(k is Any for k in kinds):
        return None
    if example in (None, "???") or not _fits(example, kinds[0]):
        example = {int: 4, float: 0.5, bool: True, str: "<text>"}.get(kinds[0], None)
    ex = f"{key}={fmt_value(example)}" if example is not None else None
    for k in kinds:
        if _fits(value, k):
            return None
    k = kinds[0]
    if _is_list_type(k):
        spelled = _listed(key, [raw])
        if spelled != f"[{raw}]":
            return f"{key}: expected a list, got {raw}; write {key}={spelled} (the range spelled out)."
        form = re.match(r"\[([^\[\]]+)\]", doc.strip())
        if form:
            names = [w.strip() for w in form.group(1).split(",")]
            return (f"{key}: expected a list of {len(names)} values, got {raw}; write {key}=[{','.join(names)}] with "
                    "your values.")
        inner = raw if raw.strip() else fmt_value(value)
        return f"{key}: expected a list, got {raw}; write {key}=[{inner}] (a list of one), or [] for none."
    if isinstance(value, (list, dict)):
        what = "a list" if isinstance(value, list) else "a mapping"
        return f"{key}: expected {_words(k)}, got {what} ({raw}); give one value" + (f", e.g. {ex}." if ex else ".")
    if k is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return (f"{key}: expected an integer, got {raw} (Hydra reads it as the float {value:g}); write it as a whole "
                f"number, e.g. {key}={int(value)}.")
    shown = repr(raw) if isinstance(value, str) else raw
    return f"{key}: expected {_words(k)}, got {shown}" + (f"; e.g. {ex}." if ex else ".")


def _list_type(tp: Any) -> bool:
    """Whether ``tp`` (or a member of its Union) is a list."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    return any(_is_list_type(a) for a in args)


def _listed(key: str, items: list[str]) -> str:
    """``items`` as one bracketed list, every value kept; for a list of view numbers (the keys
    named *views) an IMOD-style range 1-5 is spelled out, as fasttomo takes no ranges."""
    out = []
    for item in items:
        lo, sep, hi = item.strip().partition("-")
        if key.endswith("views") and sep and lo.isdigit() and hi.isdigit() and int(lo) <= int(hi) < int(lo) + 1000:
            out += [str(i) for i in range(int(lo), int(hi) + 1)]
        else:
            out.append(item)
    return f"[{','.join(out)}]"


def _words(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, "a list" if _is_list_type(tp) else getattr(tp, "__name__", str(tp)))


@functools.lru_cache(maxsize=None)
def _holder(tp: Any) -> type:
    return dataclasses.make_dataclass("Value", [("v", tp)])


def _fits(value: Any, tp: Any) -> bool:
    """Whether OmegaConf accepts ``value`` for a node of type ``tp`` (its own validation: strings
    that spell a number or a boolean convert); stricter only for booleans, which take no integer
    (OmegaConf reads dry_run=2 as true)."""
    from omegaconf import OmegaConf, ValidationError

    if tp is bool and isinstance(value, int) and not isinstance(value, bool):
        return False
    node = OmegaConf.structured(_holder(tp))
    try:
        node.v = value
    except ValidationError:
        return False
    return True


# --------------------------------------------------------------------------------------- not key=value
def _not_key_value(p: Program, argv: list[str], keys: dict, groups: dict) -> str | None:
    """The first item of ``argv`` that is not Hydra's key=value (a GNU-style ``--dry-run``, or
    ``data.path x.mrc`` with a space for the '='), and what to write instead; None when all are.
    Before Hydra, whose argparse would print its usage and "unrecognized arguments"."""
    skip = False
    for i, a in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        bare = nxt is not None and "=" not in nxt and not nxt.startswith(("-", "~", "+"))  # a value standing alone
        if skip:
            skip = False
            continue
        name, eq, value = a.partition("=")
        if a.startswith("-"):
            if name in _FLAGS or name.startswith("--help"):
                skip = a in _FLAGS_WITH_VALUE
                continue
            if not eq and bare:
                value = nxt
            words = name.lstrip("-")
            named = [n for n in (words, words.replace("-", "_")) if n in keys or n in groups]
            near = named[:1] or [k for k in keys if k.rsplit(".", 1)[-1] == words.replace("-", "_")]
            near = near or nearest(words.replace("-", "_"), [*keys, *groups])
            if not near:
                return (f"{name}: fasttomo takes key=value settings, not --options; write them as key=value "
                        f"({p.prog} --help lists the keys).")
            fix = " or ".join(f"{k}={value or _placeholder(p, k)}" for k in near)
            return f"{name}: fasttomo takes key=value settings, not --options; write {fix}."
        key = name.lstrip("+")
        if (key in keys or key in groups) and (not eq or (not value and bare)):
            if nxt is not None and nxt.startswith("=") and not eq:  # data.path =x.mrc, data.path = x.mrc
                value = nxt[1:] or (argv[i + 2] if i + 2 < len(argv) else "")
            elif bare:
                value = nxt
            if not value:
                return f"{name}: no value; write {name}=<value>."
            return f"{name}: write {name}={value} (key=value, no spaces around =)."
    return None


def _placeholder(p: Program, key: str) -> str:
    """The value of a --flag given without one: true for a switch, else <value>."""
    return "true" if field_type(p.root, key) is bool else "<value>"


# --------------------------------------------------------------------------------------- the check
def check_overrides(p: Program, argv: list[str]) -> None:
    """Refuse, with a :class:`CommandLineError`, the first override of ``argv`` that names an
    unknown group option or key, or gives a value of the wrong type."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    groups = p.group_options()
    keys = schema_keys(p.root)
    problem = _not_key_value(p, argv, keys, groups)
    if problem:
        raise CommandLineError(problem)
    tokens = overrides_of(argv)
    if not tokens:
        return
    parser = OverridesParser.create()
    defaults = p.defaults()
    secs = set(sections(p.root))
    for token in tokens:
        try:
            ov = parser.parse_overrides([token])[0]
        except OverrideParseException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "cannot be read"
            raise CommandLineError(f"{token}: this is not a valid key=value ({first}); quote values with spaces or "
                                   "special characters, e.g. key='a b'.") from None
        key = ov.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or ov.package is not None:
            continue
        raw = token.split("=", 1)[1] if "=" in token else ""
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else None
        if key in groups:
            opts = groups[key]
            choices = values if values is not None else [ov.get_value_element_as_str()]
            if ov.is_delete():
                continue
            for choice in choices:
                if choice in opts or choice in ("null", "None"):
                    continue
                raise CommandLineError(f"{key}={choice}: no option {choice!r} in group {key}; the options are "
                                       f"{', '.join(opts)}.{_did_you_mean(nearest(choice, opts), key + '={}')} "
                                       f"({p.prog} --help {key} describes them.)")
            continue
        if key in keys:
            if ov.is_delete():
                continue
            tp = field_type(p.root, key)
            example = defaults.get(key, (None, ""))[0]
            vals = [ov.value()] if values is None else list(ov.sweep_iterator())
            raws = [raw] if values is None else values
            if _list_type(tp) and values is not None and not any(isinstance(v, (list, dict)) for v in vals):
                # data.exclude_views=3,7,12: Hydra reads a sweep of three integers; the user meant one list
                raise CommandLineError(f"{key}: expected a list, got {raw} (without brackets, Hydra reads values "
                                       f"separated by commas as a sweep); write {key}={_listed(key, values)}.")
            if _list_type(tp) and isinstance(vals[0], list) and values is None:
                items = [str(v) for v in vals[0]]
                spelled = _listed(key, items)
                if spelled != f"[{','.join(items)}]":  # data.exclude_views=[1-5]: a range in the list
                    raise CommandLineError(f"{key}: expected view numbers, got {raw} (fasttomo takes no ranges); "
                                           f"write {key}={spelled}.")
            for v, r in zip(vals, raws):
                msg = _type_error(key, r, v, tp, example, keys[key].doc)
                if msg:
                    raise CommandLineError(msg)
            continue
        head = key.split(".")[0]
        if head in groups and any(key in option_values(p.config_dir, head, o) for o in groups[head]):
            continue  # a key an option's file sets, that no schema here declares: Hydra and the schema decide
        if key in secs:
            raise CommandLineError(f"{key}: is a group of settings, not a value; set one of its keys, e.g. "
                                   f"{_first_key(keys, key)}=<value> ({p.prog} --help {key} lists them).")
        # an unknown key: the nearest keys, by the whole name and by the last part within its group
        near = nearest(key, keys)
        if not near and "." in key:
            in_group = [k for k in keys if k.startswith(head + ".")]
            tail = key.split(".")[-1]
            near = [k for k in in_group if k.split(".")[-1] in nearest(tail, [x.split(".")[-1] for x in in_group])]
        where = f"{p.prog} --help {head}" if head in secs else f"{p.prog} --help"
        raise CommandLineError(f"{key}: no such key.{_did_you_mean(near)} ({where} lists the valid keys.)")


def _first_key(keys: dict, section: str) -> str:
    return next((k for k in keys if k.startswith(section + ".")), section + ".<key>")


def from_hydra(exc: BaseException) -> CommandLineError | None:
    """A one-line :class:`CommandLineError` for an exception Hydra or OmegaConf raised while
    composing the config (None for anything else: a bug, shown with its traceback)."""
    mod = type(exc).__module__ or ""
    if not (mod.startswith("hydra") or mod.startswith("omegaconf")):
        return None
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    key = getattr(exc, "full_key", None)
    first = lines[0] if lines else type(exc).__name__
    if "HYDRA_FULL_ERROR" in first or first.startswith("Error"):
        first = next((ln for ln in lines[1:] if "HYDRA_FULL_ERROR" not in ln), first)
    first = first.replace("\\", "")
    ambiguous = re.match(r"Ambiguous value for argument '([^'=]+)=(.*)'", first)
    if ambiguous:  # a comma outside -m: Hydra's own hint is on the lines this keeps out
        name, value = ambiguous.groups()
        return CommandLineError(f"{name}={value}: the comma makes this several values; to keep it one value (a "
                                f"file name with a comma), quote it: \"{name}='{value}'\"; with -m, one job runs "
                                "for each value.")
    msg = f"{key}: {first}" if key and not first.startswith(str(key)) else first
    return CommandLineError(msg.rstrip(".") + ". (--help explains every group and key.)")


def _folder_not_created(exc: BaseException, multirun: bool) -> CommandLineError | None:
    """The one line for Hydra failing to create the run (or, ``multirun``, the sweep) folder
    before fasttomo runs: a parent that is not writable, or a file in the way. Recognised as an
    OSError raised by ``Path.mkdir`` called from Hydra's own code (hydra-core 1.3 makes the folder
    in ``run_job`` or its launcher); the error's filename is the folder."""
    if not isinstance(exc, OSError) or not exc.filename:
        return None
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        caller, callee = tb.tb_frame, tb.tb_next.tb_frame
        if caller.f_globals.get("__name__", "").startswith("hydra.") and callee.f_code.co_name == "mkdir":
            key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
            return CommandLineError(f"cannot create the output folder {os.path.abspath(os.fsdecode(exc.filename))} "
                                    f"({exc.strerror or type(exc).__name__}); choose a writable folder with "
                                    f"{key}=<dir>.")
        tb = tb.tb_next
    return None


def run_checked(p: Program, argv: list[str], app) -> None:
    """The entry points' common start: --help, the override check, then ``app()`` (Hydra) with its
    composition errors turned into one line and exit code 2."""
    code = handle_help(p, argv)
    if code is not None:
        sys.exit(code)
    try:
        check_overrides(p, argv)
    except CommandLineError as exc:
        report(str(exc), p.prog)
        sys.exit(EXIT_USER_ERROR)
    # Hydra prints its own errors (config search path, a HYDRA_FULL_ERROR hint) unless this is set;
    # then they reach us as exceptions and get one line like every other error.
    forced = "HYDRA_FULL_ERROR" not in os.environ
    if forced:
        os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except SystemExit:
        raise
    except KeyboardInterrupt:  # Ctrl-C while Hydra composes, before the run could install its handlers
        from fasttomo.cli.help import other_rank

        if not other_rank():  # under torchrun every rank gets the Ctrl-C: rank 0 says it
            report("interrupted before the run started; nothing was written", p.prog)
        logging.shutdown()
        sys.exit(130)
    except BaseException as exc:  # noqa: B902
        multirun = any(a in ("-m", "--multirun") or a.startswith("hydra.mode=") for a in argv)
        err = _folder_not_created(exc, multirun) or (from_hydra(exc) if forced else None)
        if err is None:
            raise
        report(str(err), p.prog)
        logging.shutdown()
        sys.exit(EXIT_USER_ERROR)


def hydra_app(name: str, schema, run, user_errors, throw_on_missing: bool = False) -> None:
    """Compose configs/<name>.yaml with the command line through Hydra, the typed ``schema``
    registered first (as ``fasttomo_<name>_schema``, the first entry of that file's defaults list,
    so a misspelled key is refused), and call ``run`` with the composed config as a plain dict;
    the ``user_errors`` it raises (a tuple of exception classes, or a function returning one, called
    once the config is composed, for classes whose modules are heavy to import) become one line and
    exit code 2."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from fasttomo.config import config_dir

    ConfigStore.instance().store(name=f"fasttomo_{name}_schema", node=schema)

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name=name)
    def _app(cfg) -> None:
        errors = user_errors() if callable(user_errors) else user_errors
        try:
            run(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=throw_on_missing))
        except errors as exc:
            logging.getLogger("fasttomo").error("%s", exc)
            sys.exit(EXIT_USER_ERROR)

    _app()
