"""`db.turned_away`: which connection errors a starting worker waits out (Postgres full or
starting up) and which it refuses at once (`tests/faults/test_faults_pg_connections.py` runs it
against a real full cluster)."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import exc

from proj.db import down, turned_away

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


@pytest.mark.parametrize(
    ("error", "is_down"),
    [
        (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), True),
        (psycopg.errors.CrashShutdown("terminating connection because of crash of another process"), True),
        (psycopg.errors.CannotConnectNow("the database system is shutting down"), True),
        (psycopg.errors.DiskFull("could not extend file: No space left on device"), True),
        (psycopg.errors.TooManyConnections("sorry, too many clients already"), True),
        (psycopg.errors.ConnectionFailure("connection failure"), True),
        (psycopg.errors.QueryCanceled("canceling statement due to statement timeout"), False),
        (psycopg.errors.UniqueViolation("duplicate key value violates unique constraint"), False),
        (psycopg.errors.OutOfMemory("out of memory"), False),
        (RuntimeError("the service answered an error"), False),
    ],
)
def test_down_tells_postgres_unable_to_serve_from_a_failed_statement(error: Exception, is_down: bool) -> None:
    """`db.down`: the body's Postgres errors the engine waits out as an outage (a restart, a full
    disk, no slots) and those that are the step's own (a timeout, a constraint, one query's memory)."""
    assert down(error) is is_down
    wrapped = exc.OperationalError("SELECT 1", {}, error)
    assert down(wrapped) is is_down


def test_down_sees_a_connection_sqlalchemy_invalidated() -> None:
    """A dropped connection psycopg reports without a SQLSTATE, which SQLAlchemy recognises."""
    dropped = psycopg.OperationalError("server closed the connection unexpectedly")
    lost = exc.OperationalError("SELECT 1", {}, dropped)
    assert not down(lost)
    lost.connection_invalidated = True
    assert down(lost)
