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

from tests.support.schema import BAD_STATUS_WRITES, hot_table_checks, migrate, rows, scratch_database

BEFORE, AFTER = "0011_attempt_on_step", "0012_status_domains"


@pytest.fixture
def scratch() -> Iterator[str]:
    with scratch_database("domains") as url:
        yield url


def _a_run(url: str) -> uuid.UUID:
    run = uuid.uuid4()
    rows(
        url,
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "VALUES (%s, 'probe', 1, %s, '{}', 'h', 'running')",
        (run, run.hex),
    )
    rows(
        url,
        "INSERT INTO engine.step (run_id, stage, name, max_attempts, status, attempts, lease_token, "
        "lease_owner, claimed_at, blocked_on) VALUES (%s, 0, 's1', 5, 'running', 1, %s, 'w1', now(), 'key')",
        (run, uuid.uuid4()),
    )
    return run


def _refuses_bad_values(url: str, run: uuid.UUID) -> None:
    for statement in BAD_STATUS_WRITES:
        with pytest.raises(psycopg.errors.CheckViolation):
            rows(url, statement, {"run": run})


def _state(url: str, run: uuid.UUID) -> dict[str, Any]:
    files = dict(rows(url, "SELECT relname, relfilenode FROM pg_class WHERE relname IN ('step', 'task_run')"))
    return {
        "files": files,
        "run": rows(url, "SELECT status FROM engine.task_run WHERE id = %s", (run,)),
        "step": rows(url, "SELECT status, blocked_on FROM engine.step WHERE run_id = %s", (run,)),
        "attempts": rows(
            url,
            "SELECT attempt, worker FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
            "WHERE s.run_id = %s",
            (run,),
        ),
        "checks": hot_table_checks(url),
    }


def test_status_domains_up_and_down(scratch: str) -> None:
    migrate(scratch, BEFORE)
    run = _a_run(scratch)
    before = _state(scratch, run)
    assert before["checks"] == ["step_blocked_on_check", "step_status_check", "task_run_status_check"]
    _refuses_bad_values(scratch, run)

    migrate(scratch, AFTER)
    after = _state(scratch, run)
    assert after["checks"] == []
    assert {k: v for k, v in after.items() if k != "checks"} == {
        k: v for k, v in before.items() if k != "checks"
    }  # same rows, same files: nothing rewritten; the view reads them as before
    _refuses_bad_values(scratch, run)

    migrate(scratch, BEFORE, down=True)
    down = _state(scratch, run)
    assert down["checks"] == before["checks"]
    assert (down["run"], down["step"], down["attempts"]) == (
        before["run"],
        before["step"],
        before["attempts"],
    )
    _refuses_bad_values(scratch, run)
    migrate(scratch, AFTER)
    assert _state(scratch, run)["checks"] == []
