"""The engine's typed models match its migrations, as the ledger's and the outbox's do; statuses
are defined once and the database's CHECK constraints hold exactly those values."""

from __future__ import annotations

from proj.engine import models
from proj.engine.status import RunStatus, StepStatus
from tests.integration.test_ledger import schema_diff
from tests.support.services import sql


def test_engine_models_match_the_migration() -> None:
    assert schema_diff("engine", models.Base.metadata) == []


def test_status_checks_in_the_database_are_the_enums() -> None:
    rows = sql(
        "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE contype = 'c' AND conrelid IN ('engine.task_run'::regclass, 'engine.step'::regclass) "
        "AND pg_get_constraintdef(oid) LIKE '%status%'"
    )
    found = {table: definition for table, definition in rows}
    for table, enum in (("engine.task_run", RunStatus), ("engine.step", StepStatus)):
        definition = found[table]
        quoted = {part.split("'")[1] for part in definition.split("::text")[:-1] if "'" in part}
        assert quoted == {s.value for s in enum}, (table, definition)
