"""Migration tests' tools: a scratch database of their own (the suite's stays at head), alembic
up or down on it, plain statements on it, and what the status domains (migration 0012) are
tested with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from alembic import command

from proj.engine.preflight import alembic_config
from tests.conftest import PG_ADMIN_URL, TEST_DB
from tests.support.services import recreate_database

# Writes of a value no status enum holds: each must be refused (`psycopg.errors.CheckViolation`).
BAD_STATUS_WRITES = (
    "UPDATE engine.task_run SET status = 'bogus' WHERE id = %(run)s",
    "UPDATE engine.step SET status = 'bogus' WHERE run_id = %(run)s",
    "UPDATE engine.step SET blocked_on = 'bogus' WHERE run_id = %(run)s",
)

HOT_TABLE_CHECKS = (
    "SELECT conname FROM pg_constraint WHERE contype = 'c' "
    "AND conrelid IN ('engine.task_run'::regclass, 'engine.step'::regclass) ORDER BY conname"
)


@contextmanager
def scratch_database(suffix: str) -> Iterator[str]:
    """A new empty database `<test db>_<suffix>`, dropped afterwards; yields its URL."""
    name = f"{TEST_DB}_{suffix}"
    recreate_database(PG_ADMIN_URL, name)
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(url: str, revision: str, down: bool = False) -> None:
    cfg = alembic_config(url.replace("postgresql://", "postgresql+psycopg://"))
    (command.downgrade if down else command.upgrade)(cfg, revision)


def rows(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def hot_table_checks(url: str) -> list[str]:
    """The names of the CHECK constraints left on `engine.task_run` and `engine.step`."""
    return [r[0] for r in rows(url, HOT_TABLE_CHECKS)]
