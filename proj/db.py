"""One SQLAlchemy engine per process, shared by the task engine and business code (invariant 12).

Prefork children must not share the parent's sockets, so `reset_after_fork()` is wired to Celery's
`worker_process_init` signal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import namedtuple_row
from sqlalchemy import Engine, TextClause, create_engine, event, exc
from sqlalchemy.orm import Session, sessionmaker

from proj.settings import Settings, get_settings

_lock = threading.Lock()
_engine: Engine | None = None
_sessions: sessionmaker[Session] | None = None
_threads = 1  # threads of this process that run steps (`serve_threads`)


def pool_size_for(settings: Settings, threads: int) -> int:
    """The pool of a process whose `threads` run steps: `DB_POOL_SIZE`, or a connection per
    thread and one for its heartbeat if that is more. Why: under `-P threads -c 16` sixteen
    step threads and the lease heartbeat shared a pool of 3 (+2 overflow) and queued for it, a
    heartbeat queued long enough loses its leases (`tests/integration/test_preflight.py::
    test_a_threads_worker_sizes_its_pool_to_its_threads`)."""
    return max(settings.db_pool_size, threads + 1)


def serve_threads(threads: int) -> None:
    """Size this process' pool for `threads` step threads (a `-P threads` worker, the embedded
    engine); an engine already made with another size is closed, the next one has the new size."""
    global _threads
    settings = get_settings()
    before, _threads = pool_size_for(settings, _threads), threads
    if pool_size_for(settings, threads) != before:
        dispose()


def get_engine() -> Engine:
    """The process' engine, created lazily with the explicit pool budget.

    The engine is published last, after its session factory: a thread that finds `_engine` set
    without taking the lock must also find `_sessions` set (`sessions()` asserts it)."""
    global _engine, _sessions
    if _engine is None:
        with _lock:
            if _engine is None:
                s = get_settings()
                engine = create_engine(
                    s.require_database_url(),
                    pool_size=pool_size_for(s, _threads),
                    max_overflow=s.db_max_overflow,
                    pool_recycle=1800,
                    connect_args={
                        "application_name": "proj",
                        "connect_timeout": 5,
                        **tcp_params(),
                        **pooler_params(),
                    },
                )
                _ping_when_idle(engine, s.db_ping_idle_s)
                bound_idle_transactions(engine, idle_in_transaction_ms(s))
                _sessions = sessionmaker(engine, expire_on_commit=False)
                _engine = engine
    return _engine


def pooler_params() -> dict[str, Any]:
    """psycopg settings for what DATABASE_URL reaches (`DB_POOLER`).

    Behind a transaction pooler (PgBouncer `pool_mode=transaction`) consecutive transactions of
    one client may run on different server connections, so a statement psycopg prepared on one
    is unknown on the next ("prepared statement _pg3_0 does not exist"): never prepare there.
    Proof: `tests/integration/test_pgbouncer.py`.
    """
    return {"prepare_threshold": None} if get_settings().db_pooler == "transaction" else {}


def idle_in_transaction_ms(s: Settings) -> int:
    """How long a session of ours may sit idle inside a transaction before Postgres ends it
    (`DB_IDLE_IN_TRANSACTION_S`); 0: no bound of ours (behind a transaction pooler, where a
    session setting would stay on a server connection other clients share: PgBouncer's own
    `idle_transaction_timeout` does it there)."""
    return 0 if s.db_pooler == "transaction" else int(s.db_idle_in_transaction_s * 1000)


def bound_idle_transactions(engine: Engine, ms: int) -> None:
    """Every new connection of `engine` gets `idle_in_transaction_session_timeout` = `ms` (0:
    none), set once as it connects.

    Why: a process frozen inside a transaction (SIGSTOP, a paused VM or container) holds its row
    and advisory locks for as long as it stays frozen. The statements that take the engine's own
    locks bound their transaction at two thirds of the lease (`proj.engine.store.leases`); this
    is the backstop for every other transaction, business ones included (an API request frozen
    holding a request's row would stall the step that writes it). A statement, not a startup
    option: PgBouncer refuses startup options, and it is recommended in front of Postgres
    (`tests/integration/test_idle_bounds.py`).
    """
    if ms <= 0:
        return

    @event.listens_for(engine, "connect")
    def _connected(dbapi_conn: Any, record: Any) -> None:
        was = dbapi_conn.autocommit
        dbapi_conn.autocommit = True  # the setting outlives this statement: no transaction around it
        try:
            dbapi_conn.execute(BOUND_IDLE_TRANSACTIONS, {"ms": str(ms)})
        finally:
            dbapi_conn.autocommit = was


BOUND_IDLE_TRANSACTIONS = "SELECT set_config('idle_in_transaction_session_timeout', %(ms)s, false)"


def tcp_params() -> dict[str, int]:
    """libpq TCP settings: a connection whose packets vanish (a partition, a dead host) errors
    within about one lease instead of hanging a worker thread on a statement forever.

    `tcp_user_timeout` bounds unacknowledged sends; keepalives probe an idle connection. Both
    follow `LEASE_TTL_S`, so a partitioned worker learns of it about when its lease runs out
    (`tests/faults/test_faults_partition.py`).
    """
    lease = get_settings().lease_ttl_s
    return {
        "keepalives": 1,
        "keepalives_idle": max(1, int(lease / 3)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
        "tcp_user_timeout": max(1000, int(lease * 1000)),
    }


def _ping_when_idle(engine: Engine, idle_s: float) -> None:
    """Pessimistic disconnect handling, but only for connections that sat in the pool.

    `pool_pre_ping` costs a round trip on every checkout, and a busy worker checks out once per
    step: a fifth of a step's time. A connection returned moments ago is as alive as a ping
    would say; one that sat idle (Postgres restarted, `pg_terminate_backend`, a proxy timeout)
    is pinged, and a dead one is replaced before use (SQLAlchemy retries the checkout on
    `DisconnectionError`). A connection killed mid-use fails its statement either way, which
    the engine already treats as a failed attempt.
    """

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_conn: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < idle_s:
            return  # a fresh connection, or one in use a moment ago
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as e:
            raise exc.DisconnectionError(f"pooled connection is dead: {e}") from e


def sessions() -> sessionmaker[Session]:
    """Session factory bound to the process engine."""
    get_engine()
    assert _sessions is not None
    return _sessions


@contextmanager
def transaction() -> Iterator[Session]:
    """A session in one transaction: commit on success, rollback on error."""
    with sessions().begin() as session:
        yield session


class Autocommit:
    """A pooled connection in autocommit, driven through psycopg directly.

    For the engine's hot single statements (the claim, the one-statement commit): each commits by
    itself, so it needs no BEGIN and COMMIT round trips. Going around SQLAlchemy's `Connection`
    (checkout wrapper, isolation level set and reset, result wrapping) saves about two thirds of
    the client CPU of such a statement (`bench/README.md`). Statements are SQLAlchemy `text()`
    clauses, compiled once to the driver's `%(name)s` form; rows have attribute access.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn

    def first(self, stmt: TextClause, params: Mapping[str, Any]) -> Any | None:
        with self._conn.cursor(row_factory=namedtuple_row) as cur:
            return cur.execute(_driver_sql(stmt), params).fetchone()

    def all(self, stmt: TextClause, params: Mapping[str, Any]) -> list[Any]:
        with self._conn.cursor(row_factory=namedtuple_row) as cur:
            return cur.execute(_driver_sql(stmt), params).fetchall()


_compiled: dict[TextClause, str] = {}


def _driver_sql(stmt: TextClause) -> str:
    sql = _compiled.get(stmt)
    if sql is None:
        sql = _compiled[stmt] = str(stmt.compile(dialect=get_engine().dialect))
    return sql


@contextmanager
def autocommit() -> Iterator[Autocommit]:
    """A pooled connection on which every statement commits by itself (`Autocommit`).

    A connection that broke under it (Postgres restarted, `pg_terminate_backend`) or was left
    mid-statement is invalidated instead of going back to the pool, as SQLAlchemy would do.
    """
    fairy = get_engine().raw_connection()
    conn = fairy.driver_connection
    try:
        conn.autocommit = True
        yield Autocommit(conn)
    except BaseException:
        if conn.broken or conn.closed or conn.info.transaction_status != TransactionStatus.IDLE:
            fairy.invalidate()
        raise
    finally:
        if fairy.is_valid:
            conn.autocommit = False
        fairy.close()


# What Postgres answers a connection it cannot take *now*, though it is up and the settings are
# right: full at `max_connections` ("sorry, too many clients already", or only reserved slots
# left: SQLSTATE 53300), or not accepting yet (starting up, recovering, or still shutting down
# for a restart: 57P03). libpq reports a refused connection as text, with no SQLSTATE, so the
# message is what tells (`tests/unit/test_turned_away.py`).
TURNED_AWAY = (
    "too many clients",
    "connection slots are reserved",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is not yet accepting connections",
    "the database system is in recovery mode",
)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what it wraps: SQLAlchemy's `orig` (the driver's error), or `__cause__`."""
    seen: BaseException | None = error
    while seen is not None:
        yield seen
        seen = getattr(seen, "orig", None) or seen.__cause__


def turned_away(exc: BaseException) -> bool:
    """Whether `exc` (SQLAlchemy's, or psycopg's it wraps) is Postgres turning a connection away
    for now (`TURNED_AWAY`): worth waiting for, unlike a wrong URL, password or schema."""
    return any(
        getattr(seen, "sqlstate", None) in ("53300", "57P03")
        or (isinstance(seen, psycopg.OperationalError) and any(m in str(seen) for m in TURNED_AWAY))
        for seen in _causes(exc)
    )


# SQLSTATEs of a Postgres that cannot serve anyone now, whatever the statement: shut down or
# restarting under the session (57P01 terminated by an administrator, 57P02 crash, 57P03 not
# accepting yet), out of disk or of connection slots (53100, 53300), or the connection itself
# failing (class 08). Not a statement's own errors (a timeout, a constraint, out of memory for
# one query): those are the step's.
DOWN_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53100", "53300"})


def _down_here(seen: BaseException) -> bool:
    if getattr(seen, "connection_invalidated", False):  # SQLAlchemy saw the connection drop
        return True
    state = getattr(seen, "sqlstate", None)
    return isinstance(state, str) and (state in DOWN_SQLSTATES or state.startswith("08"))


def down(error: BaseException) -> bool:
    """Whether `error` (SQLAlchemy's or psycopg's) says Postgres is down or cannot serve now,
    rather than that a statement failed: an outage of a service the step needs, which the
    engine waits out without spending attempts where the kind's policy allows
    (`proj.engine.commits.commit_failure`; `tests/integration/test_outages.py::
    test_a_step_whose_postgres_session_is_terminated_waits_it_out`)."""
    return turned_away(error) or any(_down_here(seen) for seen in _causes(error))


def reset_after_fork() -> None:
    """Drop inherited pooled connections in a forked child (they belong to the parent)."""
    if _engine is not None:
        _engine.dispose(close=False)


def dispose() -> None:
    """Close the pool and forget the engine (tests that change DATABASE_URL)."""
    global _engine, _sessions
    with _lock:
        if _engine is not None:
            _engine.dispose()
        _engine = None
        _sessions = None
