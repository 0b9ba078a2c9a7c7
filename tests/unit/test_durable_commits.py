"""Only a claim may commit without waiting for its WAL flush (invariant 1: a committed step never
runs again, so every statement that commits a step, a run, a signal or a business write waits for
the flush; `proj.engine.store.claims`, "One durable commit per step", says why a claim need
not). `tests/integration/test_claim_durability.py` shows the setting at work."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RELAXED = {("proj/engine/store/claims.py", name) for name in ("CLAIM", "CLAIM_START", "CLAIM_BATCH")}


def relaxing_statements(root: Path) -> set[tuple[str, str]]:
    """(module, constant) of every module-level string statement that mentions
    `synchronous_commit`, in `proj/`, `ledger/` and `outbox/`."""
    found: set[tuple[str, str]] = set()
    for top in ("proj", "ledger", "outbox"):
        for path in (root / top).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Name):
                    continue
                strings = (c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
                if any(isinstance(t, str) and "synchronous_commit" in t for t in strings):
                    found.add((str(path.relative_to(root)), node.targets[0].id))
    return found


def test_only_the_claims_relax_the_flush() -> None:
    assert relaxing_statements(ROOT) == RELAXED


def test_the_scan_sees_a_relaxed_commit(tmp_path: Path) -> None:
    """A planted commit that relaxes its flush is found: the scan can fail."""
    planted = tmp_path / "proj" / "engine" / "store" / "commits.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "from sqlalchemy import text\n"
        "SUCCEED = text(\"UPDATE engine.step SET status = 'succeeded' \"\n"
        "               \"WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL\")\n"
    )
    (tmp_path / "ledger").mkdir()
    (tmp_path / "outbox").mkdir()
    assert relaxing_statements(tmp_path) == {("proj/engine/store/commits.py", "SUCCEED")}
