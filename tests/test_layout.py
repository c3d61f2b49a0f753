"""The package's layout holds: imports go one way (front ends -> engine -> backends -> model /
sampling / file format -> errors), the kernel and graph packages import nothing of the product,
no import circles (but typer's command registration in cli/), few loose files at the top."""

from __future__ import annotations

import ast
import os
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "gguf_runtime"

# what each part may import (besides itself); "errors" is allowed everywhere but the leaves
MAY_IMPORT = {
    "errors": set(),
    "quant_kernels": set(),
    "graphs": set(),
    "format": {"errors"},
    "sampling": {"errors"},
    "model": {"errors", "format"},
    "backends": {"errors", "format", "model", "sampling", "quant_kernels", "graphs"},
    "engine": {"errors", "format", "model", "sampling", "backends"},
    "tools": {"errors", "format", "model", "sampling", "backends", "engine", "quant_kernels", "__init__"},
    "server": {"errors", "format", "sampling", "engine", "__init__"},
    "cli": {"errors", "format", "sampling", "engine", "backends", "server", "tools", "__init__"},
    "__main__": {"cli"},
    "__init__": set(),
}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(name: str, path: Path) -> set[str]:
    """Modules of the package this one imports (at any depth of the file), as dotted names."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
            mod = base + (node.module.split(".") if node.module else [])
            if node.module:
                found.add(".".join(mod))
            for a in node.names:  # "from . import x": x may be a module
                found.add(".".join(mod + [a.name]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gguf_runtime"):
            found.add(node.module[len("gguf_runtime."):])
    return found


def part(mod: str) -> str:
    return mod.split(".")[0] if mod else "__init__"


def test_imports_go_one_way():
    mods = modules()
    bad = []
    for name, path in mods.items():
        for dep in imports(name, path):
            if dep not in mods:
                continue  # a name, not a module
            a, b = part(name), part(dep)
            if a != b and b not in MAY_IMPORT[a]:
                bad.append(f"{name} imports {dep}")
    assert not bad, "\n".join(bad)


def test_no_import_circles_but_command_registration():
    mods = modules()
    graph = {n: {d for d in imports(n, p) if d in mods and d != n} for n, p in mods.items()}
    # typer's registration: cli.app imports the command modules, which import cli.app
    graph = {n: {d for d in ds if not (n.startswith("cli.") and d.startswith("cli."))} for n, ds in graph.items()}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    # a package's __init__ re-exporting its own module is not a circle of the code
    cycles = [c for c in cycles if not all(m.split(".")[0] == c[0].split(".")[0] for m in c)
              or not any(m == c[0].split(".")[0] for m in c)]
    assert not cycles, cycles


def test_few_loose_files_at_the_top():
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert len(loose) <= 8, loose


def test_only_the_tuning_table_reads_the_environment():
    """No measured choice comes from the environment but through backends/cuda/tuning.py."""
    readers = []
    for p in PKG.rglob("*.py"):
        text = p.read_text()
        if "GGUF_RUN_" in text and "environ" in text:
            readers.append(str(p.relative_to(PKG)))
    assert sorted(readers) == ["backends/cuda/tuning.py", "tools/bench_report.py"], readers  # (+ the report's commit)
