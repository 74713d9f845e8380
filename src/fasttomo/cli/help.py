"""``--help`` for the command-line programs, built from what already documents the settings.

Nothing here is written twice: the keys, their types and defaults come from the typed dataclass
schemas (``fasttomo.config`` and the entry points' own), the text of a key from the attribute
docstring under its field (read with ``ast``), the groups and their options from the ``configs/``
folders, and an option's line from the first comment of its YAML file. The defaults shown are
the composed ones (the schema's, then the primary config's default group options and its own
values), so a key shows the value a plain run uses.

    fasttomo-reconstruct --help              # what the program does, groups, most used keys
    fasttomo-reconstruct --help optim        # a group: its options and every key, documented
    fasttomo-reconstruct --help optim.steps  # one key

No Hydra here: the entry points call :func:`handle_help` on ``sys.argv`` before Hydra sees it.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import sys
import textwrap
import time
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from fasttomo.config import flatten

WIDTH = 100
HELP_FLAGS = ("--help", "-h")


# --------------------------------------------------------------------------------------- schemas
@dataclasses.dataclass
class KeyInfo:
    """One settable key of a schema."""

    key: str
    """Dotted name, e.g. optim.steps."""
    tp: Any
    """The declared type."""
    default: Any
    doc: str

    @property
    def type_text(self) -> str:
        """The type in words: int, float, str, bool, list, with "or null" when optional."""
        return type_text(self.tp)


@functools.lru_cache(maxsize=None)
def _class_nodes(module: str) -> dict[str, ast.ClassDef]:
    """The class definitions of a module's source by name (outermost first), parsed once: reading
    each class with ``inspect.getsource`` parses its whole module again (most of --help's time)."""
    try:
        tree = ast.parse(Path(inspect.getsourcefile(sys.modules[module])).read_text(encoding="utf-8"))
    except (KeyError, OSError, TypeError, SyntaxError):
        return {}
    return {n.name: n for n in reversed(list(ast.walk(tree))) if isinstance(n, ast.ClassDef)}


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal right under a field), with those
    of its bases; {} when the source cannot be read."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        node = _class_nodes(klass.__module__).get(klass.__name__)
        body = node.body if node is not None else []
        for node, nxt in zip(body, body[1:] + [None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def dataclasses_in(tp: Any) -> list[type]:
    """The dataclasses a field type names: itself, or the members of a Union / Optional, each
    followed by its dataclass subclasses (a group whose options have schemas of their own, as a
    Union or as subclasses of one base, holds the keys of all of them)."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        found = [tp]
    elif typing.get_origin(tp) in (Union, types.UnionType):
        found = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a) and isinstance(a, type)]
    else:
        return []
    out: list[type] = []
    stack = list(found)
    while stack:
        cls = stack.pop(0)
        if cls not in out:
            out.append(cls)
            stack += [c for c in cls.__subclasses__() if dataclasses.is_dataclass(c)]
    return out


def type_text(tp: Any) -> str:
    """A field type in words (int, list, str or null, ...)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        parts = [type_text(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    origin = typing.get_origin(tp)
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return "???"


@functools.lru_cache(maxsize=None)
def schema_keys(root: type, prefix: str = "") -> dict[str, KeyInfo]:
    """Every settable (leaf) key under ``root``, dotted. A field whose type is a Union of several
    schemas (one per group option) holds the keys of all of them."""
    out: dict[str, KeyInfo] = {}
    hints = typing.get_type_hints(root)
    docs = field_docs(root)
    for f in dataclasses.fields(root):
        tp = hints.get(f.name, Any)
        subs = dataclasses_in(tp)
        if subs:
            for sub in subs:
                for k, v in schema_keys(sub, f"{prefix}{f.name}.").items():
                    out.setdefault(k, v)
            continue
        out[f"{prefix}{f.name}"] = KeyInfo(f"{prefix}{f.name}", tp, _default_of(f), docs.get(f.name, ""))
    return out


def sections(root: type) -> list[str]:
    """The top-level fields of ``root`` that are schemas of their own (data, optim, output ...)."""
    hints = typing.get_type_hints(root)
    return [f.name for f in dataclasses.fields(root) if dataclasses_in(hints.get(f.name, Any))]


def field_type(root: type, key: str) -> Any | None:
    """The declared type of dotted ``key`` under ``root`` (the first schema of a Union that has
    it); None when no schema has it."""
    info = schema_keys(root).get(key)
    return None if info is None else info.tp


# --------------------------------------------------------------------------------------- config folders
def _first_comment(path: Path) -> str:
    """The first comment block of a YAML file (without '# @package' lines), as one paragraph."""
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        s = raw.strip()
        if not s.startswith("#"):
            break
        s = s.lstrip("#").strip()
        if s.startswith("@package"):
            continue
        cut = s.find("Keys and defaults")  # the key list that follows is shown from the schema
        if cut >= 0:
            if s[:cut].strip():
                lines.append(s[:cut].strip())
            break
        if not s or raw.lstrip("#").startswith("   "):  # an indented example ends the prose
            if lines:
                break
            continue
        lines.append(s)
    return " ".join(lines)


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (at most about 200 characters)."""
    text = " ".join(text.split())
    start = 0
    while True:
        i = text.find(". ", start)
        if i < 0 or i > 200:
            break
        if not text[:i].endswith(("e.g", "i.e", "etc", "vs", ".")):  # "." : an ellipsis, "1 .. n"
            return text[: i + 1]
        start = i + 1
    return text if len(text) <= 200 else text[:197].rstrip() + "..."


@functools.lru_cache(maxsize=None)
def config_groups(config_dir: str) -> dict[str, dict[str, str]]:
    """{group: {option: first comment}} of the config folders (hydra's own excluded)."""
    root = Path(config_dir)
    out = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "hydra" and not p.name.startswith("_")):
        opts = {p.stem: _first_comment(p) for p in sorted(d.glob("*.yaml"))}
        if opts:
            out[d.name] = opts
    return out


def _load_yaml(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return data if isinstance(data, dict) else {}


@functools.lru_cache(maxsize=None)
def default_options(config_dir: str, primary: str) -> dict[str, str | None]:
    """{group: default option} from the primary config's defaults list."""
    out: dict[str, str | None] = {}
    for entry in _load_yaml(Path(config_dir) / f"{primary}.yaml").get("defaults", []):
        if isinstance(entry, dict):
            for k, v in entry.items():
                if not str(k).startswith("override") and "/" not in str(k):
                    out[str(k)] = None if v is None else str(v)
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def option_file(config_dir: str, group: str, option: str) -> dict:
    """The values a group option's file sets, as written (nested), over those of the options its
    defaults list extends (``model/kplanes.yaml`` extends ``kplanes_tilted``); {} when there is no
    such file. The one reader of option files (help, the command-line checks, resume)."""
    path = Path(config_dir) / group / f"{option}.yaml"
    if not path.is_file():
        return {}
    data = _load_yaml(path)
    out: dict = {}
    for entry in data.pop("defaults", None) or []:
        if isinstance(entry, str) and entry != "_self_":  # dict entries (override /group: x) are no values
            out = _merge(out, option_file(config_dir, group, entry))
    return _merge(out, data)


def option_values(config_dir: str, group: str, option: str) -> dict[str, Any]:
    """The keys an option sets (:func:`option_file`), flattened and prefixed (``@package _global_``
    files at the top level)."""
    path = Path(config_dir) / group / f"{option}.yaml"
    if not path.is_file():
        return {}
    glob = "@package _global_" in path.read_text(encoding="utf-8").split("\n", 1)[0]
    return flatten(option_file(config_dir, group, option), "" if glob else f"{group}.")


def composed_defaults(root: type, config_dir: str, primary: str) -> dict[str, tuple[Any, str]]:
    """{key: (default, where it comes from)}: the schema's default, replaced by the default group
    options' files and then by the primary config's own values (Hydra's order)."""
    out = {k: (v.default, "schema") for k, v in schema_keys(root).items()}
    for group, option in default_options(config_dir, primary).items():
        if option is None:
            continue
        for k, v in option_values(config_dir, group, option).items():
            if k in out:
                out[k] = (v, f"configs/{group}/{option}.yaml")
    own = _load_yaml(Path(config_dir) / f"{primary}.yaml")
    own.pop("defaults", None)
    own.pop("hydra", None)
    for k, v in flatten(own).items():
        if k in out:
            out[k] = (v, f"configs/{primary}.yaml")
    return out


# --------------------------------------------------------------------------------------- rendering
def fmt_value(v: Any) -> str:
    """A value as it is typed on the command line."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(fmt_value(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _wrap(text: str, indent: int) -> str:
    pad = " " * indent
    return "\n".join(textwrap.wrap(" ".join(text.split()), WIDTH, initial_indent=pad, subsequent_indent=pad))


def _hang(head: str, text: str) -> str:
    """``head`` followed by ``text`` wrapped to WIDTH, continuation lines indented under the text."""
    return "\n".join(textwrap.wrap(" ".join(text.split()), WIDTH, initial_indent=head,
                                   subsequent_indent=" " * len(head)))


@dataclasses.dataclass
class Program:
    """What one command's help is made of."""

    prog: str
    """The command name, e.g. fasttomo-reconstruct."""
    description: str
    """What the program does (a paragraph; blank lines separate paragraphs)."""
    root: type
    """The typed schema of its config."""
    config_dir: str
    primary: str
    """The primary config's name in config_dir (reconstruct, simulate, evaluate)."""
    common: tuple[str, ...] = ()
    """The most used keys, shown in the overview."""
    examples: tuple[str, ...] = ()
    groups: tuple[str, ...] | None = None
    """The config groups this program uses (None: those of its primary config's defaults list)."""

    def group_options(self) -> dict[str, dict[str, str]]:
        all_groups = config_groups(self.config_dir)
        names = self.groups if self.groups is not None else tuple(default_options(self.config_dir, self.primary))
        return {g: all_groups[g] for g in names if g in all_groups}

    def keys(self) -> dict[str, KeyInfo]:
        return schema_keys(self.root)

    def defaults(self) -> dict[str, tuple[Any, str]]:
        return composed_defaults(self.root, self.config_dir, self.primary)


def overview(p: Program) -> str:
    """The text of ``<prog> --help``."""
    lines = [_wrap(f"{p.prog}: " + p.description.split("\n\n")[0], 0)]
    for para in p.description.split("\n\n")[1:]:
        lines += ["", _wrap(para, 0)]
    groups = p.group_options()
    lines += ["", "usage:", f"  {p.prog} {'[group=option ...] ' if groups else ''}[key=value ...]",
              f"  {p.prog} --help [GROUP | KEY]       the full documentation of one part (e.g. --help "
              f"{(p.common or ('x',))[0]})"]
    if p.examples:
        split = [(e.split("#", 1)[0].rstrip(), e.split("#", 1)[1].strip() if "#" in e else "") for e in p.examples]
        col = min(64, max((len(c) for c, note in split if note), default=0))
        lines += ["", "examples:"] + [f"  {c.ljust(col)}  # {note}" if note else f"  {c}" for c, note in split]
    defaults_opt = default_options(p.config_dir, p.primary)
    if groups:
        lines += ["", "groups (choose one option of a group with group=option; * marks the default):"]
        for g, opts in groups.items():
            lines.append(f"  {g}")
            width = max(len(o) for o in opts) + 2
            for o, comment in opts.items():
                mark = "*" if defaults_opt.get(g) == o else " "
                text = first_sentence(comment) or "(no description)"
                lines.append(_hang(f"   {mark}{o.ljust(width)}", text))
    keys, defaults = p.keys(), p.defaults()
    common = [k for k in p.common if k in keys]
    if common:
        lines += ["", "most used keys (key=value; every key: --help GROUP):"]
        for k in common:
            info = keys[k]
            lines.append(f"  {k}: {info.type_text}, default {fmt_value(defaults[k][0])}")
            lines.append(_wrap(first_sentence(info.doc), 6))
    secs = [s for s in sections(p.root) if s not in groups]
    top = [k for k in keys if "." not in k and k not in common]
    if secs or top:
        lines += ["", _hang("other settings: ", ", ".join([f"{s}.*" for s in secs] + top)
                            + f" (--help {(secs or top)[0]})")]
    lines += ["", _wrap("Hydra's own options: -m/--multirun for sweeps, hydra.run.dir=<folder> for the run folder, "
                        "--cfg job to print the composed config (the keys the run fills in from the data are null "
                        "there); --hydra-help lists them.", 0)]
    return "\n".join(lines)


def key_help(p: Program, key: str) -> str:
    info = p.keys()[key]
    default, where = p.defaults()[key]
    src = "" if where == "schema" else f", from {where}"
    text = [f"{key}: {info.type_text}, default {fmt_value(default)}{src}"]
    text.append(_wrap(info.doc or "(no description)", 4))
    group = key.split(".")[0]
    opts = p.group_options().get(group)
    if opts:
        sets = {o: v[key] for o in opts if key in (v := option_values(p.config_dir, group, o))}
        if sets:
            text.append("    set by the options of " + group + ": " + ", ".join(f"{group}={o} -> {fmt_value(v)}"
                                                                              for o, v in sets.items()))
    return "\n".join(text)


def group_help(p: Program, group: str) -> str:
    keys, defaults = p.keys(), p.defaults()
    lines = []
    opts = p.group_options().get(group)
    if opts:
        default = default_options(p.config_dir, p.primary).get(group)
        lines.append(f"{group}: a config group; choose an option with {group}=<option> (default: {default})")
        lines.append("")
        lines.append("options:")
        for o, comment in opts.items():
            lines.append(f"  {o}{' (default)' if o == default else ''}")
            if comment:
                lines.append(_wrap(comment, 6))
            sets = option_values(p.config_dir, group, o)
            if sets:
                lines.append(_wrap("sets " + ", ".join(f"{k}={fmt_value(v)}" for k, v in sets.items()), 6))
    else:
        lines.append(f"{group}: settings under {group}.")
    lines += ["", "keys:"]
    for k, info in keys.items():
        if k.startswith(group + "."):
            lines.append(f"  {k}: {info.type_text}, default {fmt_value(defaults[k][0])}")
            lines.append(_wrap(info.doc or "(no description)", 6))
    return "\n".join(lines)


def nearest(name: str, choices, n: int = 3) -> list[str]:
    """The valid names closest to a mistyped ``name``: the best match alone when it stands out,
    else up to ``n`` about as close."""
    scored = sorted(((difflib.SequenceMatcher(None, name, c).ratio(), c) for c in set(choices)), reverse=True)
    scored = [(r, c) for r, c in scored if r >= 0.6]
    if not scored:
        return []
    best = scored[0][0]
    return [c for r, c in scored[:n] if r >= best - 0.04]


class HelpTopicError(LookupError):
    """``--help X`` names nothing known; the message lists the nearest topics."""


def topic_help(p: Program, topic: str) -> str:
    """``--help TOPIC``: a group or section, or one key."""
    keys = p.keys()
    groups = set(p.group_options()) | set(sections(p.root))
    if topic in groups:
        return group_help(p, topic)
    if topic in keys:
        return key_help(p, topic)
    near = nearest(topic, groups | set(keys))
    hint = f" did you mean {' or '.join(near)}?" if near else ""
    raise HelpTopicError(f"--help {topic}: no group or key of that name;{hint} {p.prog} --help lists the groups "
                         "and the most used keys.")


def handle_help(p: Program, argv: list[str]) -> int | None:
    """When ``argv`` asks for help (--help / -h, optionally followed by a topic): print it and return
    the exit code (0, or 2 for an unknown topic); None when it does not ask."""
    idx = next((i for i, a in enumerate(argv) if a in HELP_FLAGS or a.startswith("--help=")), None)
    if idx is None:
        return None
    arg = argv[idx]
    topic = arg.split("=", 1)[1] if "=" in arg else (argv[idx + 1] if idx + 1 < len(argv) else None)
    if topic is not None and (topic.startswith("-") or "=" in topic):
        topic = None
    try:
        text = topic_help(p, topic) if topic else overview(p)
    except HelpTopicError as exc:
        report(str(exc), p.prog)
        return 2
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into head
        pass
    return 0


def other_rank() -> bool:
    """Whether this process is a rank other than 0 of a torchrun launch (its errors are rank 0's:
    said once, by rank 0)."""
    import os

    return os.environ.get("RANK", "0") != "0"


def report(message: str, prog: str = "fasttomo") -> None:
    """Print ``message`` the way the run's own errors look ([time][fasttomo][ERROR] ...), on stderr
    (rank 0 only under torchrun: every rank meets the same error)."""
    if other_rank():
        return
    stamp = time.strftime("%Y-%m-%d %H:%M:%S") + f",{int(time.time() * 1000) % 1000:03d}"
    print(f"[{stamp}][fasttomo][ERROR] {' '.join(message.split())}", file=sys.stderr, flush=True)
