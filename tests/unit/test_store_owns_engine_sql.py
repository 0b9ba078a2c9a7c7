"""`proj/engine/store/` holds every statement on `engine.*` (DESIGN §7): a statement on the
engine's tables anywhere else in `proj/` (the engine's other modules, admin, CLI, demo, kinds,
acquisition) fails this test. Migrations, the schema's history, live outside `proj/`.

No module outside the store executes a store statement itself either: the engine's other modules,
and the operators' read models (admin, CLI, demo), call the store's named, typed functions
(`store.claims.claim`, `store.commits.fail_run`, `store.views.list_runs`, ...)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SQL = re.compile(
    r"\b(FROM|JOIN|UPDATE|INTO)\s+engine\.(task_run|step|step_attempt|attempt|task_signal|counter)\b",
    re.IGNORECASE,
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


STORE = "proj.engine.store"
EXECUTES = {"execute", "scalar", "scalars", "first", "all", "one"}


def executed_store_statements(path: Path) -> set[str]:
    """Store constants this module hands to `.execute()` and its kin itself (`sql.CLAIM` from
    `from proj.engine.store import claims as sql` or `import proj.engine.store.claims as sql`, or
    a `CLAIM` imported from a store module), as `alias.NAME`."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()  # names bound to a store module
    constants: set[str] = set()  # names bound to a store module's constant
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(STORE + ".") and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                bound = a.asname or a.name
                if node.module == STORE:
                    modules.add(bound)
                elif node.module.startswith(STORE + ".") and a.name.isupper():
                    constants.add(bound)
    found: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        if node.func.attr not in EXECUTES:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id in modules:
            found.add(f"{arg.value.id}.{arg.attr}")
        elif isinstance(arg, ast.Name) and arg.id in constants:
            found.add(arg.id)
    return found


def executors() -> dict[str, set[str]]:
    store = ROOT / "proj" / "engine" / "store"
    out = {}
    for p in (ROOT / "proj").rglob("*.py"):
        if store not in p.parents and (found := executed_store_statements(p)):
            out[str(p.relative_to(ROOT))] = found
    return out


def test_the_engine_calls_the_store_instead_of_executing_its_statements() -> None:
    engine = {p: names for p, names in executors().items() if p.startswith("proj/engine/")}
    assert engine == {}


def test_no_module_outside_the_store_executes_its_statements() -> None:
    assert executors() == {}


def test_the_scan_sees_an_executed_store_statement(tmp_path: Path) -> None:
    """The check itself can fail: both spellings of executing a store constant are caught."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from proj.engine.store import claims as sql\n"
        "from proj.engine.store.waits import PARK\n"
        "import proj.engine.store.views as views\n"
        "def f(s, conn):\n"
        "    s.execute(sql.CLAIM, {})\n"
        "    conn.first(PARK, {})\n"
        "    s.scalar(views.RUN_EXISTS, {})\n"
        "    sql.claim(conn, step_id=1)\n"
        "    views.run_exists(s, 1)\n"
    )
    assert executed_store_statements(planted) == {"sql.CLAIM", "PARK", "views.RUN_EXISTS"}


def test_no_module_outside_the_store_holds_engine_sql() -> None:
    assert offenders() == set()


def test_the_scan_sees_engine_sql(tmp_path: Path) -> None:
    """The check itself can fail: a module with a statement on an engine table is caught."""
    planted = tmp_path / "planted.py"
    planted.write_text("Q = \"UPDATE engine.step SET status = 'failed' WHERE id = :id\"\n")
    assert holds_engine_sql(planted)
    assert holds_engine_sql(ROOT / "proj" / "engine" / "store" / "waits.py")
    assert not holds_engine_sql(ROOT / "proj" / "engine" / "models.py")  # the typed schema only
