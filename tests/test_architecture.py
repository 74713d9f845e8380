"""The structure drawn from the imports: every module of the package is parsed (ast, imports
inside functions included), and the graph of which module imports which must have no cycle and
no arrow running back up the layers of docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "fasttomo"

# Lowest first. A module may import modules of its own layer (without a cycle) or of lower ones.
LAYERS = [
    # 0: foundations: typed config, pure helpers, the tilt-series container and its files
    ["fasttomo.config", "fasttomo.logging", "fasttomo.metrics", "fasttomo.plots", "fasttomo.stop",
     "fasttomo.losses", "fasttomo.intensity", "fasttomo.data.tiltseries", "fasttomo.data.io",
     "fasttomo.data.background", "fasttomo.timeline", "fasttomo.allocator"],
    # 1: data and geometry
    ["fasttomo.data", "fasttomo.geometry", "fasttomo.trace"],
    # 2: the kernel door
    ["fasttomo.kernels"],
    # 3: object models and the conventional projectors
    ["fasttomo.models", "fasttomo.conventional.projectors", "fasttomo.conventional.sirt"],
    # 4: the projector and the scores built on it
    ["fasttomo.projector", "fasttomo.scoring"],
    # 5: training (and the SIRT baseline, the conventional counterpart of a fit)
    ["fasttomo.train", "fasttomo.conventional.baseline", "fasttomo.conventional"],
    # 6: typed config -> objects; run folders, outputs, resume, preflight
    ["fasttomo.build", "fasttomo.outputs", "fasttomo.runfolder", "fasttomo.resume", "fasttomo.preflight",
     "fasttomo.report"],
    # 7: one run, start to finish
    ["fasttomo.pipeline"],
    # 8: the entry points
    ["fasttomo.reconstruct", "fasttomo.simulate", "fasttomo.evaluate", "fasttomo.cli_help", "fasttomo.cli_errors",
     "fasttomo.trace.command", "fasttomo.trace.__main__", "fasttomo"],
]

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


def layer(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or (p != "fasttomo" and module.startswith(p + "."))) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} is in no layer of tests/test_architecture.py: add it (and to docs/architecture.md)"
    return level


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


def test_no_import_runs_back_up_the_layers():
    graph = import_graph()
    up = sorted(f"{a} (layer {layer(a)}) -> {b} (layer {layer(b)})" for a, bs in graph.items() for b in bs
                if layer(b) > layer(a))
    assert not up, "imports running back up:\n" + "\n".join(up)


def test_train_does_not_import_build():
    graph = import_graph()
    assert not {m for m in graph if m.startswith("fasttomo.train")} & {a for a, bs in graph.items()
                                                                     if "fasttomo.build" in bs}


def test_the_graph_is_real():
    """The parser sees the arrows that exist (a guard against a graph that is empty by mistake)."""
    graph = import_graph()
    assert "fasttomo.train.trainer" in graph["fasttomo.build"]
    assert "fasttomo.projector" in graph["fasttomo.build"]
    assert "fasttomo.pipeline" in graph["fasttomo.reconstruct"]
