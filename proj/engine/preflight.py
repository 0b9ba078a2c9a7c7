"""Start-up checks: the schema is current, the connection budget fits (invariant 12) and a
connection pooler in front of Postgres runs in a mode the engine is configured for.

Workers never migrate; they refuse to start with a message that says what to run.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psycopg
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import text

from proj import db
from proj.engine.errors import ConnectionBudgetExceeded, PoolerUnsafe, SchemaBehind
from proj.settings import Settings, get_settings, libpq_url

log = logging.getLogger(__name__)

T = TypeVar("T")


def _migrations_dir() -> Path:
    """The Alembic scripts: the `migrations` package, installed beside `proj` (a checkout, an
    editable install or a wheel, as in the Docker image)."""
    spec = importlib.util.find_spec("migrations")
    if spec is not None and spec.origin:
        return Path(spec.origin).resolve().parent
    return Path(__file__).resolve().parents[2] / "migrations"


MIGRATIONS = _migrations_dir()


def alembic_config(url: str | None = None) -> Config:
    """Alembic configuration pointing at the repository's `migrations/`."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    return str(ScriptDirectory.from_config(alembic_config()).get_current_head())


def current_revision() -> str | None:
    with db.transaction() as s:
        exists = s.scalar(text("SELECT to_regclass('public.alembic_version') IS NOT NULL"))
        if not exists:
            return None
        revision: str | None = s.scalar(text("SELECT version_num FROM public.alembic_version"))
        return revision


def check_schema() -> None:
    """Refuse to run on a schema older (or newer) than this code."""
    head, current = head_revision(), current_revision()
    if current == head:
        return
    if current is not None and not known_revision(current):
        # Told to run `proj migrate`, the operator of a rolled-back image met alembic's "Can't
        # locate revision" (`tests/integration/test_operator_review.py::
        # test_a_worker_on_a_schema_a_newer_version_migrated_says_so`).
        raise SchemaBehind(
            f"database schema is at {current}, which this code does not know: a newer version of "
            "proj migrated it; run that version, or restore the database from before the upgrade"
        )
    raise SchemaBehind(
        f"database schema is at {current or 'nothing'}, this code needs {head}: "
        "run `proj migrate` (workers never migrate on start)"
    )


def known_revision(revision: str) -> bool:
    """Whether this code's migrations include `revision`."""
    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except Exception:  # alembic's ResolutionError / CommandError for an unknown id
        return False


@dataclass(frozen=True)
class Budget:
    """The worst case of connections this configuration may open, against the server's limit."""

    per_process: int
    processes: int
    reserved: int
    worst_case: int
    max_connections: int
    processes_are: str

    @property
    def fits(self) -> bool:
        return self.worst_case <= self.max_connections


def connection_budget(
    settings: Settings,
    max_connections: int,
    superuser_reserved: int,
    *,
    concurrency: int | None = None,
    one_process: bool = False,
) -> Budget:
    """Every worker process may fill its pool and overflow, and holds one liveness session
    (`proj.engine.liveness`) unless `REAP_INTERVAL_S=0`; beat/admin/CLI use the reserve.

    A prefork worker is `concurrency` processes, each with its own pool. A worker whose pool runs
    in its own process (`-P threads`, `solo`) is one process: its threads share one pool, sized
    to them (`db.pool_size_for`), and one liveness session, so it needs one process' connections,
    not `concurrency` times as many.
    Why: `-P threads -c 16` was refused as 16 processes' worth of connections it can never open
    (`tests/integration/test_preflight.py::test_a_threads_worker_is_budgeted_as_one_process`).
    `concurrency` is the worker's own (`-c`), else `WORKER_CONCURRENCY`."""
    liveness = 1 if settings.reap_interval_s > 0 else 0
    per_worker = settings.worker_concurrency if concurrency is None else concurrency
    threads_per_process = per_worker if one_process else 1
    per_process = db.pool_size_for(settings, threads_per_process) + settings.db_max_overflow + liveness
    if one_process:
        processes, processes_are = settings.expected_workers, "EXPECTED_WORKERS, each one process of threads"
    else:
        processes = settings.expected_workers * per_worker
        which_c = "WORKER_CONCURRENCY" if concurrency is None else "this worker's -c"
        processes_are = f"EXPECTED_WORKERS x {which_c}"
    worst = per_process * processes + settings.reserved_connections
    return Budget(
        per_process,
        processes,
        settings.reserved_connections,
        worst,
        max_connections - superuser_reserved,
        processes_are,
    )


def check_connection_budget(
    settings: Settings | None = None, *, concurrency: int | None = None, one_process: bool = False
) -> Budget:
    """Raise `ConnectionBudgetExceeded` with the arithmetic when the pools could not fit (for a
    worker: its own `concurrency` and whether its pool is `one_process`, see `connection_budget`)."""
    settings = settings or get_settings()
    with db.transaction() as s:
        max_conn = int(s.scalar(text("SHOW max_connections")))
        reserved = int(s.scalar(text("SHOW superuser_reserved_connections")))
    budget = connection_budget(settings, max_conn, reserved, concurrency=concurrency, one_process=one_process)
    if not budget.fits:
        raise ConnectionBudgetExceeded(
            f"worst case {budget.worst_case} connections = {budget.processes} worker processes "
            f"({budget.processes_are}) x {budget.per_process} "
            f"(the pool: DB_POOL_SIZE or a connection per thread, + DB_MAX_OVERFLOW + 1 liveness session) "
            f"+ {budget.reserved} reserved, "
            f"but Postgres allows "
            f"{budget.max_connections}: lower the pools or concurrency, or raise max_connections"
        )
    return budget


def when_admitted(checks: Callable[[], T], *, first_pause_s: float = 0.5, max_pause_s: float = 5.0) -> T:
    """Run the start-up `checks`, waiting as long as Postgres turns the connection away for now
    (`db.turned_away`: full at `max_connections`, or starting up), instead of refusing to start.

    Why: a worker that exited on "too many clients" stayed down once the other clients left (or,
    under a supervisor, came back in a loop that only added connection attempts); Postgres
    answered, so nothing in the configuration is wrong. Any other error still refuses at once.
    Proof: `tests/faults/test_faults_pg_connections.py`.
    """
    pause = first_pause_s
    while True:
        try:
            return checks()
        except Exception as exc:
            if not db.turned_away(exc):
                raise
            log.warning("Postgres turns this worker away for now, trying again in %.1fs: %s", pause, exc)
        db.dispose()  # no half-opened pool kept across the wait
        time.sleep(pause)
        pause = min(pause * 2, max_pause_s)


def migrate_to_head() -> str:
    """Upgrade the database to the newest migration; returns the head revision (`proj migrate`).

    Workers never migrate on start: they refuse a schema behind the code (`check_schema`)."""
    from alembic import command

    command.upgrade(alembic_config(get_settings().require_database_url()), "head")
    return head_revision()


def transaction_pooled(url: str) -> bool:
    """Whether `url` reaches Postgres through a transaction (or statement) pooler.

    Two client connections: A runs one statement in autocommit, then B opens a transaction.
    Directly or through a session pooler they are two sessions, two backends. A transaction
    pooler hands B the server connection A just released (PgBouncer reuses the most recently
    used one first), so B's backend is A's. Proof: `tests/integration/test_pgbouncer.py`.
    """
    conninfo = libpq_url(url)
    with (
        psycopg.connect(conninfo, autocommit=True, prepare_threshold=None, connect_timeout=5) as a,
        psycopg.connect(conninfo, autocommit=True, prepare_threshold=None, connect_timeout=5) as b,
    ):
        pid_a = a.execute("SELECT pg_backend_pid()").fetchone()
        with b.transaction():
            pid_b = b.execute("SELECT pg_backend_pid()").fetchone()
    return pid_a == pid_b


def check_pooling(settings: Settings | None = None) -> None:
    """Refuse a pooler mode the engine cannot run behind, saying what to set.

    Behind PgBouncer in transaction mode the engine needs `DB_POOLER=transaction` (no prepared
    statements, `proj.db.pooler_params`) and its liveness sessions (session advisory locks,
    `proj.engine.liveness`) on a direct `LIVENESS_DATABASE_URL`; or `REAP_INTERVAL_S=0`, which
    leaves recovery to the leases. Session mode needs nothing.
    """
    settings = settings or get_settings()
    settings.require_database_url()
    pooled = transaction_pooled(settings.database_url or "")
    if pooled and settings.db_pooler != "transaction":
        raise PoolerUnsafe(
            "DATABASE_URL goes through a transaction pooler (PgBouncer pool_mode=transaction?): "
            "set DB_POOLER=transaction and LIVENESS_DATABASE_URL=<a direct Postgres URL>, "
            "or use pool_mode=session (README: PgBouncer)"
        )
    if settings.db_pooler != "transaction" or settings.reap_interval_s <= 0:
        return
    live = settings.liveness_database_url
    if not live or transaction_pooled(live):
        raise PoolerUnsafe(
            "DB_POOLER=transaction: the liveness sessions hold session advisory locks, unsafe "
            "behind a transaction pooler; set LIVENESS_DATABASE_URL to a direct Postgres URL "
            "(not through the pooler), or REAP_INTERVAL_S=0 to recover by leases only"
        )
