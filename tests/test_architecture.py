"""The structure drawn from the tree and the imports: every module of the package is parsed (ast,
imports inside functions included). The folders of src/fasttomo are the layers: the graph of which
folder imports which must have no cycle (so the folders stack into floors), the few files directly
in the package are the foundations and import no folder, and docs/architecture.md lists the
folders in an order every import follows downward."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "fasttomo"

def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its body)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets.update(subs or [mod])  # `from pkg import module` names the module, not pkg
        graph[name] = {t for t in (_resolve(t, mods) for t in targets if t.startswith("fasttomo"))
                       if t and t != name and not name.startswith(t + ".")}  # a package's own parents: free
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    cycles = _cycles(import_graph())
    assert not cycles, f"import cycles: {cycles}"


def unit(module: str) -> str:
    """The layer a module belongs to: its folder directly under src/fasttomo, or "foundations" for
    the files that sit there (config, logging, timeline, the package itself)."""
    parts = module.split(".")
    if len(parts) > 1 and (PKG / parts[1]).is_dir():
        return parts[1]
    return "foundations"


def folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, bs in import_graph().items():
        graph.setdefault(unit(a), set()).update(unit(b) for b in bs if unit(b) != unit(a))
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each folder's floor: 0 for one that imports no other folder, else one above the highest
    it imports (the graph must be acyclic for this to end)."""
    memo: dict[str, int] = {}

    def floor(u: str) -> int:
        if u not in memo:
            memo[u] = 1 + max((floor(v) for v in graph.get(u, ())), default=-1)
        return memo[u]

    return {u: floor(u) for u in graph}


def documented_order() -> list[str]:
    """The folders as docs/architecture.md's layer table lists them, top first."""
    text = (PKG.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `([a-z_]+)/?` \|", text, flags=re.M)


def test_the_folders_import_each_other_without_a_cycle():
    cycles = _cycles(folder_graph())
    assert not cycles, f"folders importing each other in a circle: {cycles}"


def test_the_foundations_import_no_folder():
    graph = folder_graph()
    assert not graph.get("foundations"), f"the files in src/fasttomo import folders: {graph['foundations']}"


def test_at_most_eight_files_directly_in_the_package():
    files = sorted(p.name for p in PKG.glob("*.py"))
    assert len(files) <= 8, files


def test_docs_list_every_folder_in_an_order_the_imports_follow():
    order = documented_order()
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(order) == sorted(folders + ["foundations"]), (order, folders)
    rank = {u: i for i, u in enumerate(order)}  # top first: an import must point to a later row
    graph = folder_graph()
    up = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if rank[b] < rank[a])
    assert not up, "imports running back up docs/architecture.md's layer table:\n" + "\n".join(up)
    assert floors(graph)[order[0]] == max(floors(graph).values())


def test_only_the_entry_points_import_hydra():
    hydra = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] in ("hydra", "omegaconf") for n in names):
                hydra.add(name)
    assert hydra and all(unit(m) == "cli" for m in hydra), sorted(hydra)


def test_train_does_not_import_the_run():
    graph = import_graph()
    assert not any(unit(b) == "run" for a, bs in graph.items() if unit(a) == "train" for b in bs)


def test_the_graph_is_real():
    """The parser sees the arrows that exist (a guard against a graph that is empty by mistake)."""
    graph = import_graph()
    assert "fasttomo.train.trainer" in graph["fasttomo.run.build"]
    assert "fasttomo.methods.field.projector" in graph["fasttomo.run.build"]
    assert "fasttomo.run.pipeline" in graph["fasttomo.cli.reconstruct"]
    assert folder_graph()["cli"] >= {"run", "foundations"}


# ------------------------------------------------------------------------------------ function sizes
MAX_LINES = 80
"""No function in src is longer than this (Triton kernel bodies, decorated ``triton.jit``, aside)."""
MAX_RUN_PARAMS = 5
"""No function in src/fasttomo/run/ takes more parameters than this (self and cls aside)."""
LONG_ALLOWED: set[str] = set()
"""Functions still over the limit (none: make_tiltseries, prepare and run_trace were split on
their own branches)."""


def _functions():
    """(dotted name, node, module) of every function and method in src (nested ones too)."""
    for module, path in _modules().items():
        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{prefix}.{child.name}", child, module
                    yield from walk(child, f"{prefix}.{child.name}")
                elif isinstance(child, ast.ClassDef):
                    yield from walk(child, f"{prefix}.{child.name}")
        yield from walk(ast.parse(path.read_text(encoding="utf-8")), module)


def _triton_jit(fn) -> bool:
    return any("jit" in ast.unparse(d) and "triton" in ast.unparse(d) for d in fn.decorator_list)


def test_no_function_is_longer_than_80_lines():
    long = {name: fn.end_lineno - fn.lineno + 1 for name, fn, _ in _functions()
            if fn.end_lineno - fn.lineno + 1 > MAX_LINES and not _triton_jit(fn)}
    assert set(long) <= LONG_ALLOWED, {k: v for k, v in long.items() if k not in LONG_ALLOWED}


def test_no_function_of_the_run_takes_more_than_5_parameters():
    many = {}
    for name, fn, module in _functions():
        if not module.startswith("fasttomo.run"):
            continue
        a = fn.args
        params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
        params = [p for p in params if p not in ("self", "cls")]
        if len(params) > MAX_RUN_PARAMS:
            many[name] = params
    assert not many, many


def test_the_size_checks_see_the_long_functions():
    """The walk finds methods and nested functions, and the allow-list names only real functions."""
    names = {name for name, _, _ in _functions()}
    assert "fasttomo.train.trainer.Trainer.fit" in names and "fasttomo.run.run.Run.execute" in names
    assert LONG_ALLOWED <= names and "fasttomo.data.phantom.make_tiltseries" in names
