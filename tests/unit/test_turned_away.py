"""`db.turned_away`: which connection errors a starting worker waits out (Postgres full or
starting up) and which it refuses at once (`tests/faults/test_faults_pg_connections.py` runs it
against a real full cluster)."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import exc

from proj.db import turned_away

FULL_15 = "FATAL:  remaining connection slots are reserved for non-replication superuser connections"
FULL_16 = "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute"


@pytest.mark.parametrize(
    "message",
    [
        FULL_15,
        FULL_16,
        "FATAL:  sorry, too many clients already",
        "FATAL:  the database system is starting up",
        # a `pg_ctl restart` still shutting down (57P03 too): the worker exited and stayed down
        "FATAL:  the database system is shutting down",
    ],
)
def test_full_or_starting_postgres_is_waited_for(message: str) -> None:
    error = psycopg.OperationalError(message)
    assert turned_away(error)
    assert turned_away(exc.OperationalError("SELECT 1", {}, error))  # as SQLAlchemy wraps it


@pytest.mark.parametrize(
    "error",
    [
        psycopg.OperationalError('FATAL:  password authentication failed for user "app"'),
        psycopg.OperationalError('FATAL:  database "proj" does not exist'),
        RuntimeError("too many clients"),  # not a connection error
    ],
)
def test_any_other_error_is_not(error: BaseException) -> None:
    assert not turned_away(error)
