"""The app is wired, not imported: a kinds module is served whatever order a script imports in.

Issue: a kinds module whose first line is `from proj import db`, imported before anything else by
a script that then calls `engine.start()` and `enqueue()`, was never served (its run stayed
`pending`), because `import proj` built the app, and its list of queues, before the module had
declared its kinds. Each case runs in a fresh interpreter, where import order is real.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

KINDS_MODULE = """
from proj import db  # the first line that used to build the app too early
from pydantic import BaseModel
from sqlalchemy import text

from proj.engine.kind import Kind, RetryPolicy, register, step


class In(BaseModel):
    n: int


def only(ctx):
    with db.transaction() as s:
        return {"doubled": ctx.input.n * 2, "db": s.scalar(text("SELECT 1"))}


register(Kind(name="{name}", version=1, retry=RetryPolicy.db(), input_model=In, canvas=(step("only", only),)))
"""

SCRIPT = """
import sys, time
sys.path.insert(0, {dir!r})
{imports}
from proj.engine.celery_engine import CeleryTaskEngine

engine = CeleryTaskEngine()
engine.start(roles=("worker", "beat"), concurrency=1)
ref = engine.enqueue({name!r}, {{"n": 21}}, idempotency_key="wiring")
deadline = time.monotonic() + 40
view = engine.get(ref.task_run_id)
while view.status not in ("succeeded", "failed", "canceled") and time.monotonic() < deadline:
    time.sleep(0.1)
    view = engine.get(ref.task_run_id)
print("STATUS", view.status)
engine.stop()
"""


def run_script(tmp_path: Path, imports: str) -> tuple[str, str]:
    name = f"wired_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}_kinds.py").write_text(KINDS_MODULE.replace("{name}", name))
    code = SCRIPT.format(dir=str(tmp_path), imports=imports.format(mod=f"{name}_kinds"), name=name)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return name, proc.stdout


@pytest.mark.parametrize(
    "imports",
    [
        pytest.param("import {mod}", id="kinds-module-first"),
        pytest.param("import proj.celery\nimport {mod}", id="app-first-then-kinds"),
        pytest.param("import proj\nprint(proj.app.main)\nimport {mod}", id="proj-app-attribute-first"),
    ],
)
def test_a_kinds_module_is_served_whatever_the_import_order(tmp_path: Path, imports: str) -> None:
    name, out = run_script(tmp_path, imports)
    assert "STATUS succeeded" in out, out
    from tests.support.services import sql

    rows = sql(
        "SELECT s.status, s.result FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
        "WHERE r.kind = %s",
        (name,),
    )
    assert rows == [("succeeded", {"doubled": 42, "db": 1})]


def test_importing_proj_builds_no_app() -> None:
    """`import proj` and `from proj import db` leave the app unbuilt until someone asks for it."""
    code = textwrap.dedent(
        """
        import sys
        from proj import db
        import proj.engine.runs
        assert "proj.celery" not in sys.modules, "importing the engine built the app"
        from proj.engine import broker
        assert broker.bound() is None
        app = broker.app()
        assert "proj.celery" in sys.modules and broker.bound() is app
        print("OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
