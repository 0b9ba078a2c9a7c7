"""The engine's typed models match its migrations, as the ledger's and the outbox's do; statuses
are defined once, and the database's status domains (migration 0012) hold exactly those values
and refuse any other."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from proj.engine import models
from proj.engine.status import RunStatus, StepStatus
from tests.integration.test_ledger import schema_diff
from tests.support.schema import BAD_STATUS_WRITES, hot_table_checks
from tests.support.services import pg_url, sql


def test_engine_models_match_the_migration() -> None:
    assert schema_diff("engine", models.Base.metadata) == []


def domain_values() -> dict[str, set[str]]:
    """Each domain of schema `engine`: the values its CHECK constraint quotes."""
    rows = sql(
        "SELECT t.typname, pg_get_constraintdef(c.oid) FROM pg_constraint c "
        "JOIN pg_type t ON t.oid = c.contypid WHERE t.typnamespace = 'engine'::regnamespace"
    )
    return {
        name: {part.split("'")[1] for part in definition.split("::text")[:-1] if "'" in part}
        for name, definition in rows
    }


def test_status_domains_in_the_database_are_the_enums() -> None:
    found = domain_values()
    assert found["run_status"] == {s.value for s in RunStatus}
    assert found["step_status"] == {s.value for s in StepStatus}
    assert found["blocked_on"] == {"global", "key"}
    columns = dict(
        sql(
            "SELECT table_name || '.' || column_name, domain_name FROM information_schema.columns "
            "WHERE table_schema = 'engine' AND domain_name IS NOT NULL"
        )
    )
    assert columns == {
        "task_run.status": "run_status",
        "step.status": "step_status",
        "step.blocked_on": "blocked_on",
    }


def test_the_hot_tables_keep_no_check_constraint() -> None:
    """Why the domains: a table CHECK is parsed again by every statement that writes the table
    (migration 0012). One added back to `step` or `task_run` would cost every claim and commit."""
    assert hot_table_checks(pg_url()) == []


@pytest.mark.parametrize(
    "statement",
    [
        *BAD_STATUS_WRITES,
        "INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, status) "
        "VALUES (%(run)s, 1, 'x', 0, 1, 'bogus')",
    ],
)
def test_a_status_outside_the_enum_is_refused(statement: str, engine: Any, published: list[Any]) -> None:
    """Broken on purpose: a value no enum holds, written by an insert or an update."""
    run = engine.enqueue("probe", {}, idempotency_key=uuid.uuid4().hex).task_run_id
    assert sql("SELECT count(*) FROM engine.step WHERE run_id = %s", (run,)) == [(1,)]
    with psycopg.connect(pg_url(), autocommit=True) as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(statement, {"run": run})
    assert sql("SELECT count(*) FROM engine.step WHERE run_id = %s AND status = 'bogus'", (run,)) == [(0,)]
