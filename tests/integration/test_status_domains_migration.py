"""Migration 0012 turns the status CHECK constraints of `engine.step` and `engine.task_run` into
domains: the rows stay where they are (no table is rewritten), `engine.attempt` still reads
them, any other value is refused before and after, and the downgrade puts the checks back.

Run on a scratch database of its own: the suite's database stays at head."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import PG_ADMIN_URL, TEST_DB
from tests.integration.test_attempt_migration import _migrate, _rows
from tests.support.services import recreate_database

BEFORE, AFTER = "0011_attempt_on_step", "0012_status_domains"


@pytest.fixture
def scratch() -> Iterator[str]:
    name = f"{TEST_DB}_domains"
    recreate_database(PG_ADMIN_URL, name)
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    yield url
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _a_run(url: str) -> uuid.UUID:
    run = uuid.uuid4()
    _rows(
        url,
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "VALUES (%s, 'probe', 1, %s, '{}', 'h', 'running')",
        (run, run.hex),
    )
    _rows(
        url,
        "INSERT INTO engine.step (run_id, stage, name, max_attempts, status, attempts, lease_token, "
        "lease_owner, claimed_at, blocked_on) VALUES (%s, 0, 's1', 5, 'running', 1, %s, 'w1', now(), 'key')",
        (run, uuid.uuid4()),
    )
    return run


def _refuses_bad_values(url: str, run: uuid.UUID) -> None:
    for statement in (
        "UPDATE engine.task_run SET status = 'bogus' WHERE id = %s",
        "UPDATE engine.step SET status = 'bogus' WHERE run_id = %s",
        "UPDATE engine.step SET blocked_on = 'bogus' WHERE run_id = %s",
    ):
        with pytest.raises(psycopg.errors.CheckViolation):
            _rows(url, statement, (run,))


def _state(url: str, run: uuid.UUID) -> dict[str, Any]:
    files = dict(
        _rows(url, "SELECT relname, relfilenode FROM pg_class WHERE relname IN ('step', 'task_run')")
    )
    return {
        "files": files,
        "run": _rows(url, "SELECT status FROM engine.task_run WHERE id = %s", (run,)),
        "step": _rows(url, "SELECT status, blocked_on FROM engine.step WHERE run_id = %s", (run,)),
        "attempts": _rows(
            url,
            "SELECT attempt, worker FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
            "WHERE s.run_id = %s",
            (run,),
        ),
        "checks": sorted(
            r[0]
            for r in _rows(
                url,
                "SELECT conname FROM pg_constraint WHERE contype = 'c' "
                "AND conrelid IN ('engine.task_run'::regclass, 'engine.step'::regclass)",
            )
        ),
    }


def test_status_domains_up_and_down(scratch: str) -> None:
    _migrate(scratch, BEFORE)
    run = _a_run(scratch)
    before = _state(scratch, run)
    assert before["checks"] == ["step_blocked_on_check", "step_status_check", "task_run_status_check"]
    _refuses_bad_values(scratch, run)

    _migrate(scratch, AFTER)
    after = _state(scratch, run)
    assert after["checks"] == []
    assert {k: v for k, v in after.items() if k != "checks"} == {
        k: v for k, v in before.items() if k != "checks"
    }  # same rows, same files: nothing rewritten; the view reads them as before
    _refuses_bad_values(scratch, run)

    _migrate(scratch, BEFORE, down=True)
    down = _state(scratch, run)
    assert down["checks"] == before["checks"]
    assert (down["run"], down["step"], down["attempts"]) == (
        before["run"],
        before["step"],
        before["attempts"],
    )
    _refuses_bad_values(scratch, run)
    _migrate(scratch, AFTER)
    assert _state(scratch, run)["checks"] == []
