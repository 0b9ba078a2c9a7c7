"""`proj doctor`: check what a deployment needs and say what to fix, one line per check.

Each check is independent and bounded in time (a few seconds at most), so a dead dependency is
reported instead of hanging. URLs are shown with their passwords masked; secrets never print.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from proj.settings import Settings, get_settings

Status = Literal["OK", "FAIL", "WARN", "SKIP"]


@dataclass(frozen=True)
class Check:
    """One result: `fix` says what to do when the status is not OK."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def mask_url(url: str | None) -> str:
    """The URL with any password replaced by `***`."""
    if not url:
        return "(not set)"
    from kombu.utils.url import maybe_sanitize_url

    return str(maybe_sanitize_url(url, mask="***"))


def _first_line(exc: BaseException) -> str:
    """The gist of an error: the driver's own exception if wrapped, first line, bounded."""
    exc = getattr(exc, "orig", None) or exc
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def check_postgres(settings: Settings) -> Check:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    try:
        url = settings.require_database_url()
    except RuntimeError as exc:
        if not settings.database_url:
            return Check("postgres", "FAIL", "DATABASE_URL is not set", str(exc))
        return Check("postgres", "FAIL", f"{mask_url(settings.database_url)}: {exc}", "correct DATABASE_URL")
    shown = mask_url(settings.database_url)
    engine = None
    try:
        engine = create_engine(
            url, poolclass=NullPool, connect_args={"connect_timeout": 3, "application_name": "proj-doctor"}
        )
        with engine.connect() as conn:
            version = conn.scalar(text("SHOW server_version"))
        return Check("postgres", "OK", f"{shown}: PostgreSQL {version}")
    except Exception as exc:
        return Check(
            "postgres",
            "FAIL",
            f"{shown}: {_first_line(exc)}",
            "start PostgreSQL or correct DATABASE_URL (host, port, user, database must exist)",
        )
    finally:
        if engine is not None:
            engine.dispose()


def check_broker(settings: Settings) -> Check:
    if not settings.broker_url:
        return Check("broker", "FAIL", "BROKER_URL is not set", "set BROKER_URL=redis://127.0.0.1:6379/0")
    from kombu import Connection

    shown = mask_url(settings.broker_url)
    try:
        with Connection(settings.broker_url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=5)
            with conn.channel() as channel:  # a real round trip, not just a socket
                client = getattr(channel, "client", None)
                if client is not None and hasattr(client, "ping"):
                    client.ping()
        return Check("broker", "OK", f"{shown}: reachable ({conn.transport_cls})")
    except Exception as exc:
        return Check(
            "broker",
            "FAIL",
            f"{shown}: {_first_line(exc)}",
            "start Redis (or RabbitMQ) or correct BROKER_URL",
        )


def check_qbittorrent(settings: Settings) -> Check:
    """qBittorrent's Web UI answering a login. Unset `QBT_URL` is a warning, not a skip: every
    acquire then fails at its add step ("QBT_URL is not set"), and "no check failed" alone hid
    it (`tests/integration/test_cli.py::test_doctor_warns_that_acquires_fail_without_qbt_url`)."""
    if not settings.qbt_url:
        return Check(
            "qbittorrent",
            "WARN",
            "QBT_URL is not set: every acquire fails at its add step",
            "set QBT_URL (with QBT_USERNAME / QBT_PASSWORD) to qBittorrent's Web UI",
        )
    import qbittorrentapi

    client = qbittorrentapi.Client(
        host=settings.qbt_url,
        username=settings.qbt_username or "",
        password=settings.qbt_password.get_secret_value() if settings.qbt_password else "",
        REQUESTS_ARGS={"timeout": (3, 5)},
        DISABLE_LOGGING_DEBUG_OUTPUT=True,
    )
    try:
        client.auth_log_in()
        version = client.app_version()
        return Check("qbittorrent", "OK", f"{mask_url(settings.qbt_url)}: qBittorrent {version}")
    except qbittorrentapi.LoginFailed:
        return Check(
            "qbittorrent",
            "FAIL",
            f"{mask_url(settings.qbt_url)}: login refused",
            "check QBT_USERNAME / QBT_PASSWORD (qBittorrent → Options → Web UI)",
        )
    except Exception as exc:
        return Check(
            "qbittorrent",
            "FAIL",
            f"{mask_url(settings.qbt_url)}: {_first_line(exc)}",
            "start qbittorrent-nox with its Web UI enabled, or correct QBT_URL",
        )


def check_library(settings: Settings) -> Check:
    """LIBRARY_ROOT is there and writable. A warning, not a failure: imports wait for a root
    that is not there (its disk unmounted) without spending attempts, and never create it
    (`proj.kinds.common.require_mounted`); this may also run on a host that does not mount it
    (`tests/integration/test_cli.py::test_doctor_warns_of_a_library_root_that_is_not_there`)."""
    import os
    import shutil
    from pathlib import Path

    root = Path(settings.library_root)
    if not root.is_dir():
        return Check(
            "library",
            "WARN",
            f"LIBRARY_ROOT {root} is not there: imports wait for it",
            f"mount the library's disk, or create the folder (mkdir -p {root}) where the workers run",
        )
    if not os.access(root, os.W_OK | os.X_OK):
        return Check(
            "library", "WARN", f"{root} is not writable by this user", "give the workers' user write access"
        )
    free = shutil.disk_usage(root).free
    return Check("library", "OK", f"{root}: {free / 2**30:.1f} GiB free")


def check_schema() -> Check:
    from proj.engine import preflight
    from proj.engine.errors import SchemaBehind

    try:
        preflight.check_schema()
        return Check("schema", "OK", f"at head {preflight.head_revision()}")
    except SchemaBehind as exc:
        detail, _, fix = str(exc).partition(": ")  # the check's message is "what: what to do"
        return Check("schema", "FAIL", detail, fix or "run `proj migrate`")
    except Exception as exc:
        return Check("schema", "FAIL", _first_line(exc), "fix the postgres check first")


# The engine's tables whose autovacuum is switched off one by one (`ALTER TABLE … SET
# (autovacuum_enabled = false)`): the server-wide setting alone does not tell.
AUTOVACUUM_OFF_TABLES = """
    SELECT n.nspname || '.' || c.relname
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname IN ('engine', 'ledger', 'outbox', 'acq') AND c.relkind = 'r'
       AND 'autovacuum_enabled=false' = ANY (coalesce(c.reloptions, '{}'))
     ORDER BY 1
"""


def check_autovacuum() -> Check:
    """The engine's claims and sweeps rely on partial indexes the planner only picks with
    current statistics; with autovacuum off they go stale (tables planned as empty).

    Off means any of: `autovacuum = off`, `track_counts = off` (autovacuum then never acts,
    whatever it says), or a table of ours with `autovacuum_enabled = false`
    (`tests/integration/test_cli.py::test_doctor_warns_of_autovacuum_off_for_one_table`)."""
    from sqlalchemy import text

    from proj import db

    try:
        with db.get_engine().connect() as conn:
            on = conn.scalar(text("SHOW autovacuum")) == "on"
            counts = conn.scalar(text("SHOW track_counts")) == "on"
            tables = list(conn.scalars(text(AUTOVACUUM_OFF_TABLES)))
    except Exception as exc:
        return Check("autovacuum", "FAIL", _first_line(exc), "fix the postgres check first")
    off = [w for w, bad in (("autovacuum = off", not on), ("track_counts = off", not counts)) if bad]
    if tables:
        off.append("autovacuum_enabled = false on " + ", ".join(tables))
    if not off:
        return Check("autovacuum", "OK", "on")
    return Check(
        "autovacuum",
        "WARN",
        f"{'; '.join(off)}: engine table statistics go stale, claims and sweeps may stop using their indexes",
        "set autovacuum = on and track_counts = on in postgresql.conf and reset the tables' "
        "autovacuum_enabled, or run ANALYZE on the engine schema regularly",
    )


def check_budget(settings: Settings) -> Check:
    from proj.engine.errors import ConnectionBudgetExceeded
    from proj.engine.preflight import check_connection_budget

    try:
        b = check_connection_budget(settings)
        return Check(
            "connection budget",
            "OK",
            f"worst case {b.worst_case} of {b.max_connections} connections "
            f"({b.processes} processes x {b.per_process} + {b.reserved} reserved)",
        )
    except ConnectionBudgetExceeded as exc:
        detail, _, fix = str(exc).partition(": lower")
        return Check("connection budget", "FAIL", detail, "lower" + fix if fix else str(exc))
    except Exception as exc:
        return Check("connection budget", "FAIL", _first_line(exc), "fix the postgres check first")


def check_workers(settings: Settings) -> Check:
    """A worker answering a ping and the queues it consumes; a version queue that holds messages
    no worker consumes is a warning (an old run waiting for a worker of its version, invariant
    10, or a kind no worker serves). Proof:
    `tests/integration/test_cli.py::test_doctor_warns_of_a_queue_nobody_consumes`.
    """
    try:
        from proj.celery import app

        replies = app.control.inspect(timeout=1.0).active_queues() or {}
        consumed = {q["name"] for qs in replies.values() for q in qs}
        orphans = [(q, n) for q, n in queue_depths(app) if n and q not in consumed]
    except Exception as exc:
        return Check("workers", "WARN", _first_line(exc), "fix the broker check first")
    waiting = "; ".join(f"{q} has {n} message(s) and no consumer" for q, n in orphans)
    if not replies:
        detail = "no worker answered within 1 s" + (f"; {waiting}" if waiting else "")
        return Check("workers", "WARN", detail, "start `celery -A proj worker`")
    if orphans:
        return Check(
            "workers",
            "WARN",
            f"{len(replies)} worker(s); {waiting}",
            "start a worker that serves those versions (ENGINE_SERVE), or let the runs drain",
        )
    return Check("workers", "OK", f"{len(replies)} worker(s); queues: {', '.join(sorted(consumed))}")


def queue_depths(app: object) -> list[tuple[str, int]]:
    """Messages waiting on each declared kind version's queue (a passive declare: creates none)."""
    from proj.engine.kind import all_kinds

    out: list[tuple[str, int]] = []
    with app.connection_for_read() as conn:  # type: ignore[attr-defined]
        channel = conn.default_channel
        for name in sorted({k.queue for k in all_kinds()}):
            try:
                out.append((name, int(channel.queue_declare(queue=name, passive=True).message_count)))
            except Exception:  # AMQP: a queue never declared does not exist (404 closes the channel)
                channel = conn.channel()
    return out


def run_checks(
    settings: Settings | None = None, on_check: Callable[[str], None] | None = None
) -> list[Check]:
    """All checks, in dependency order; schema and budget need Postgres, workers the broker."""
    settings = settings or get_settings()
    results: list[Check] = []

    def run(name: str, fn: Callable[[], Check]) -> Check:
        if on_check:
            on_check(name)
        started = time.monotonic()
        c = fn()
        if time.monotonic() - started > 10:  # pragma: no cover - visible slowness is a finding too
            c = Check(c.name, c.status, c.detail + " (slow)", c.fix)
        results.append(c)
        return c

    pg = run("postgres", lambda: check_postgres(settings))
    broker = run("broker", lambda: check_broker(settings))
    run("qbittorrent", lambda: check_qbittorrent(settings))
    run("library", lambda: check_library(settings))
    if pg.status == "OK":
        run("schema", check_schema)
        run("autovacuum", check_autovacuum)
        run("connection budget", lambda: check_budget(settings))
    else:
        results.append(Check("schema", "SKIP", "needs postgres", "fix the postgres check first"))
        results.append(Check("autovacuum", "SKIP", "needs postgres", "fix the postgres check first"))
        results.append(Check("connection budget", "SKIP", "needs postgres", "fix the postgres check first"))
    if broker.status == "OK":
        run("workers", lambda: check_workers(settings))
    return results
