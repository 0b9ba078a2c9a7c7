"""`proj/engine/store/` holds every statement on `engine.*` (DESIGN §7): a statement on the
engine's tables anywhere else in `proj/` (the engine's other modules, admin, CLI, demo, kinds,
acquisition) fails this test. Migrations, the schema's history, live outside `proj/`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SQL = re.compile(
    r"\b(FROM|JOIN|UPDATE|INTO)\s+engine\.(task_run|step|step_attempt|task_signal|counter)\b", re.IGNORECASE
)


def holds_engine_sql(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENGINE_SQL.search(node.value):
            return True
    return False


def offenders() -> set[str]:
    store = ROOT / "proj" / "engine" / "store"
    return {
        str(p.relative_to(ROOT))
        for p in (ROOT / "proj").rglob("*.py")
        if store not in p.parents and holds_engine_sql(p)
    }


def test_no_module_outside_the_store_holds_engine_sql() -> None:
    assert offenders() == set()


def test_the_scan_sees_engine_sql(tmp_path: Path) -> None:
    """The check itself can fail: a module with a statement on an engine table is caught."""
    planted = tmp_path / "planted.py"
    planted.write_text("Q = \"UPDATE engine.step SET status = 'failed' WHERE id = :id\"\n")
    assert holds_engine_sql(planted)
    assert holds_engine_sql(ROOT / "proj" / "engine" / "store" / "waits.py")
    assert not holds_engine_sql(ROOT / "proj" / "engine" / "models.py")  # the typed schema only
