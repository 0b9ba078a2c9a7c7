"""Layering: the engine is handed the Celery app and imports nothing of the service, and the
packages import one another without a cycle at import time (issue: 10 files formed one cycle).
Inside the engine not even the type checker sees a cycle: an import under `if TYPE_CHECKING`
counts there too (`proj.engine.context` and `proj.engine.kind` named each other so)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proj", "ledger", "outbox")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports(path: Path, *, top_level_only: bool, type_checking: bool = False) -> set[str]:
    """Modules a file imports: at import time only (module body, outside `if TYPE_CHECKING`
    unless `type_checking`), or anywhere, lazy imports inside functions included. `from a
    import b` names `a.b` when b is a submodule's name, and `a` too (which `_edges` drops again
    when `a.b` is a module)."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []
    if top_level_only:
        stack: list[ast.stmt] = list(tree.body)
        while stack:
            node = stack.pop()
            nodes.append(node)
            if isinstance(node, ast.If) and (type_checking or not _is_type_checking(node)):
                stack.extend(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                stack.extend(node.body + node.orelse + node.finalbody)
    else:
        nodes = list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _edges(mods: dict[str, Path], *, type_checking: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        found = imports(path, top_level_only=True, type_checking=type_checking)
        deps = {m for m in found if m in mods and m != name}
        # `from proj import db` needs proj.db, not proj's own body, when db is a submodule
        graph[name] = {d for d in deps if not any(o.startswith(d + ".") and o in deps for o in found)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_at_import_time() -> None:
    assert cycles(_edges(_modules())) == []


def test_no_import_cycle_in_the_engine_even_for_the_type_checker() -> None:
    engine = {name: path for name, path in _modules().items() if name.startswith("proj.engine")}
    assert cycles(_edges(engine, type_checking=True)) == []


def test_a_type_checking_import_counts_for_the_engine_check(tmp_path: Path) -> None:
    """The check itself can fail: an import under `if TYPE_CHECKING` is an edge there, and not
    one for the import-time check."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from proj.engine.kind import Kind\n"
    )
    assert "proj.engine.kind" in imports(planted, top_level_only=True, type_checking=True)
    assert "proj.engine.kind" not in imports(planted, top_level_only=True)


def test_the_cycle_check_finds_a_cycle() -> None:
    """The check itself can fail: a planted two-module cycle is reported."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_engine_never_imports_the_app_or_the_service() -> None:
    """The engine is handed the app (`proj.engine.broker`); it imports no kinds, admin or CLI,
    not even lazily inside a function."""
    banned = ("proj.celery", "proj.kinds", "proj.admin", "proj.acquisition", "proj.cli", "proj.demo")
    offenders = {
        f"{path.relative_to(ROOT)} imports {mod}"
        for path in (ROOT / "proj" / "engine").rglob("*.py")
        for mod in imports(path, top_level_only=False)
        if mod.startswith(banned) or mod == "proj.app"
    }
    assert not offenders, sorted(offenders)


def test_ledger_and_outbox_import_nothing_of_proj() -> None:
    offenders = {
        f"{path.relative_to(ROOT)} imports {mod}"
        for pkg in ("ledger", "outbox")
        for path in (ROOT / pkg).rglob("*.py")
        for mod in imports(path, top_level_only=False)
        if mod == "proj" or mod.startswith("proj.")
    }
    assert not offenders, sorted(offenders)
