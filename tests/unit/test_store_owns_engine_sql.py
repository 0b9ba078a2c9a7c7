"""`proj/engine/store/` is to hold every statement on `engine.*` (DESIGN §7). The move is under
way: this test names the modules that still hold such SQL and fails when any other module starts
to (or when one of them is emptied without being crossed off, so the list only shrinks)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SQL = re.compile(
    r"\b(FROM|JOIN|UPDATE|INTO)\s+engine\.(task_run|step|step_attempt|task_signal)\b", re.I
)

# Still to move into proj/engine/store/ (issue 16). Do not add to this list.
NOT_YET_MOVED = {
    "proj/admin/app.py",
    "proj/admin/queries.py",
    "proj/demo.py",
    "proj/engine/context.py",
    "proj/engine/dispatch.py",
    "proj/engine/heartbeat.py",
    "proj/engine/liveness.py",
    "proj/engine/protocol.py",
    "proj/engine/runs.py",
    "proj/engine/sweeper.py",
    "proj/kinds/purge.py",
}


def holds_engine_sql(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENGINE_SQL.search(node.value):
            return True
    return False


def offenders() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for p in (ROOT / "proj").rglob("*.py")
        if "store" not in p.relative_to(ROOT / "proj").parts[:2] and holds_engine_sql(p)
    }


def test_no_new_module_writes_engine_sql_outside_the_store() -> None:
    assert offenders() - NOT_YET_MOVED == set()


def test_the_list_of_modules_left_to_move_only_shrinks() -> None:
    assert NOT_YET_MOVED - offenders() == set(), "moved: cross it off NOT_YET_MOVED"


def test_the_scan_sees_engine_sql() -> None:
    assert holds_engine_sql(ROOT / "proj" / "engine" / "store" / "waits.py")
    assert "proj/acquisition/service.py" not in offenders()  # reads through store.runs now
