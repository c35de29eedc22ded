"""The house has one direction: core -> storage -> preinfer (library) -> pipelines -> bench ->
tools (`make real-model`), and inside preinfer/ its sub-packages have one too (SUBLAYERS,
bottom to top).

Reads every import (module level and function local) of the product, bench and tools packages
with `ast`; an import of a higher layer, or a cycle between modules, fails with the file and line.
Run by `make test` and by `make lint`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["core", "storage", "preinfer", "pipelines", "bench", "tools"]  # bottom to top
# preinfer/'s sub-packages, bottom to top; the package root (its public surface) sits on top
SUBLAYERS = {
    "preinfer": ["runtime", "model", "data", "checkpoint", "train", "schedule", "plan", "run"],
}


def _rank(mod: str) -> tuple[int, int]:
    """(layer, sub-layer) of a module; a layer without sub-layers, or its root, ranks on top."""
    parts = mod.split(".")
    subs = SUBLAYERS.get(parts[0], [])
    sub = subs.index(parts[1]) if len(parts) > 1 and parts[1] in subs else len(subs)
    return LAYERS.index(parts[0]), sub


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in LAYERS:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _imports(mod: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(project module imported, line) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import submodule` imports the submodule (and runs pkg/__init__, which
            # is pkg's public surface, not a dependency of the submodule importing it)
            names = subs if all(n in known for n in subs) else [base, *subs]
        for name in names:
            # the longest project module the name refers to ("a.b.c" -> module "a.b")
            parts = name.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != mod:
                out.setdefault(".".join(parts), node.lineno)
    return sorted(out.items(), key=lambda kv: kv[1])


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    known = set(mods)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    upward = []
    for mod, path in mods.items():
        here = _rank(mod)
        for target, line in _imports(mod, path, known):
            graph[mod].add(target)
            there = _rank(target)
            if there > here:
                what = "a higher layer" if there[0] > here[0] else "a higher sub-package"
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({what})")
    return graph, upward


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_runs_up_a_layer():
    _, upward = _graph()
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_every_library_module_sits_in_a_sub_package():
    """A module straight under preinfer/ (or in a sub-package SUBLAYERS does not list) has no
    place in the order: put it in the sub-package that owns its concept."""
    loose = [
        m for m in _modules()
        if m.split(".")[0] in SUBLAYERS and m != m.split(".")[0]
        and m.split(".")[1] not in SUBLAYERS[m.split(".")[0]]
    ]  # fmt: skip
    assert not loose, f"modules outside the sub-packages {SUBLAYERS}: {loose}"


def test_no_import_cycles():
    graph, _ = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_an_upward_import_and_a_cycle(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("from storage.x import y\n\ndef f():\n    from pipelines.cli import main\n")
    found = _imports("storage.x2", a, {"storage.x", "pipelines.cli"})
    assert [m for m, _ in found] == ["storage.x", "pipelines.cli"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _rank("preinfer.model.loss") < _rank("preinfer.train.step") < _rank("preinfer")
    assert _rank("preinfer.run.visit") < _rank("pipelines.bcd")


def test_every_module_imports():
    """Every module of every layer imports (a rename that missed an importer fails here, not
    in a benchmark an hour later)."""
    import importlib

    failed = []
    for mod in sorted(_modules()):
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 -- collect every failure
            failed.append(f"{mod}: {type(e).__name__}: {e}")
    assert not failed, "\n".join(failed)
