"""`/metrics`: the engine's state in Prometheus text format, read at scrape time.

Why a custom collector over the database instead of counters in the workers: Postgres is the
truth, so every number (counters and histograms included) is derived from the tables and
survives worker and admin restarts, and any number of admin replicas agree
(`tests/integration/test_metrics.py::test_scrape_reports_the_engine_state`). The statements live in
`proj.engine.store.stats`; the outbox is read here (it is not engine state).

Fast and slow: what alerts need (live and failed runs, live steps, the outbox backlog, lease
recoveries, workers) is read at every scrape from small partial indexes. What reads the whole
history (succeeded/canceled counts, dispatched events, the two histograms: seconds at 1M runs,
`bench/metrics_scale.py`) is read by a background thread at most every `METRICS_SLOW_S` and
served from its last read (`HistoryCache`); the first scrape waits for it up to the bound.

Bounds: a scrape opens one short connection with `connect_timeout` and `statement_timeout`
from `METRICS_TIMEOUT_S`, so a down or locked database never hangs it. Such a scrape still
answers 200, the exporter convention (postgres_exporter's `pg_up`): a 503 made Prometheus mark the
whole target down (`up == 0`), so "Postgres is down" looked like "the admin is down" and the
broker's queue depth, which needs no database, was lost with it. `proj_database_up` is 1 on
every scrape that read Postgres and 0 on one that did not; then `proj_database_error{reason}`
says why in one of four short words (`connect_failed`, `connect_timeout`, `statement_timeout`,
`query_failed`: low cardinality; the full message is logged), and only what needs no database
follows (`proj_queue_messages`, `proj_library_free_bytes`). No family read from the database is
served then, not even from the history cache: a stale number would look live
(`tests/integration/test_metrics.py::test_database_down_answers_quickly_with_database_up_0`,
`::test_locked_table_answers_database_up_0_within_the_statement_timeout`). `/admin/overview`,
a page for people, still answers 503 with the reason. The broker is read with the same bound;
if it does not answer, `proj_queue_messages` is left out and the scrape still succeeds.

Auth: not behind the admin's Basic auth (Prometheus scrapes with a bearer token); when
`METRICS_TOKEN` is set, a missing or wrong token is a 401 JSON answer.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated

import psycopg
from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Engine, create_engine, exc, text
from sqlalchemy.pool import NullPool

from proj.admin.bearer import bearer_matches
from proj.engine.store import stats
from proj.settings import Settings, sqlalchemy_url

log = logging.getLogger(__name__)

OUTBOX_TABLE = text("SELECT to_regclass('outbox.outbox_event') IS NOT NULL")
# The backlog through the outbox's partial indexes (`outbox_event_due_idx`, `_dead_idx`).
OUTBOX_BACKLOG = text(
    """
    SELECT (SELECT count(*) FROM outbox.outbox_event WHERE status = 'pending') AS pending,
           (SELECT count(*) FROM outbox.outbox_event WHERE status = 'dead') AS dead,
           (SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
              FROM outbox.outbox_event WHERE status = 'pending') AS oldest_pending_s
    """
)
# Every dispatched event ever kept (slow: the whole table until `purge`).
OUTBOX_DISPATCHED = text("SELECT count(*) FROM outbox.outbox_event WHERE status = 'dispatched'")
STEP_STATUSES = ("pending", "running", "waiting")
REDIS_PRIORITY_SEP = "\x06\x16"  # kombu's Redis transport: `<queue>\x06\x16<priority>` lists
REDIS_PRIORITY_STEPS = (0, 3, 6, 9)


# `proj_database_error{reason}`: why a scrape could not read Postgres, one of these (a closed
# set, so the label never grows with error messages; `_reason_class`).
CONNECT_FAILED = "connect_failed"  # refused, unknown host, authentication, too many clients, …
CONNECT_TIMEOUT = "connect_timeout"  # no answer within METRICS_TIMEOUT_S (a hung server, a lost route)
STATEMENT_TIMEOUT = "statement_timeout"  # connected, but a read hit statement_ or lock_timeout
QUERY_FAILED = "query_failed"  # connected, then a read failed otherwise (connection cut, schema)


class MetricsUnavailable(RuntimeError):
    """The database did not answer within the scrape's bound; the message says why, `reason`
    is its short class (`CONNECT_FAILED`, `CONNECT_TIMEOUT`, `STATEMENT_TIMEOUT`, `QUERY_FAILED`)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# ------------------------------------------------------------------------------ snapshot


@dataclass(frozen=True)
class History:
    """The slow part of a scrape: what reads the whole history (succeeded and canceled run
    counts, dispatched outbox events, the histograms). Read in the background, at most every
    `METRICS_SLOW_S`, and served from the last read in between."""

    finished_runs: list[stats.RunCount]
    outbox_dispatched: int | None  # None: the outbox table is not migrated
    step_durations: dict[tuple[str, str], stats.Histogram]
    signal_wakes: stats.Histogram
    read_at: float  # time.monotonic()


@dataclass
class Snapshot:
    """Everything one scrape reports: the fast part read now, the slow part (`history`) as
    last read; None where it is not known yet (no history read yet, broker silent, …)."""

    live_runs: list[stats.RunCount]
    steps: stats.StepCounts
    lease_recoveries: int
    workers_alive: int
    history: History | None = None
    outages: list[stats.OutageCount] = field(default_factory=list)
    outbox: dict[str, int] | None = None  # None: the outbox table is not migrated
    outbox_oldest_pending_s: float = 0.0
    queues: dict[str, int] | None = None  # None: the broker did not answer
    library_free_bytes: int | None = None  # None: LIBRARY_ROOT does not exist
    minutes: list[stats.MinuteCount] = field(default_factory=list)
    now: datetime | None = None

    @property
    def runs(self) -> list[stats.RunCount]:
        return self.live_runs + (self.history.finished_runs if self.history else [])

    @property
    def step_durations(self) -> dict[tuple[str, str], stats.Histogram]:
        return self.history.step_durations if self.history else {}

    def runs_by(self, status: str) -> dict[str, int]:
        """Runs of one status per kind (all versions): dead letters, parked runs."""
        out: dict[str, int] = {}
        for r in self.runs:
            if r.status == status:
                out[r.kind] = out.get(r.kind, 0) + r.n
        return out


@dataclass(frozen=True)
class Outage:
    """A scrape whose database did not answer: why (a short class), and what is known without
    Postgres. None where that is not known either (broker silent, no LIBRARY_ROOT)."""

    reason: str
    queues: dict[str, int] | None = None
    library_free_bytes: int | None = None


def metrics_engine(settings: Settings, statement_timeout_s: float | None = None) -> Engine:
    """A pool-less engine whose every connection is bounded: a scrape never hangs on Postgres.

    The connect is bounded by `METRICS_TIMEOUT_S`, each statement by `statement_timeout_s`
    (default the same; the background history read gets `METRICS_SLOW_TIMEOUT_S`)."""
    connect_ms = int(settings.metrics_timeout_s * 1000)
    bound_ms = int((statement_timeout_s or settings.metrics_timeout_s) * 1000)
    return create_engine(
        sqlalchemy_url(settings.require_database_url()),
        poolclass=NullPool,
        connect_args={
            "application_name": "proj-metrics",
            "connect_timeout": max(1, round(settings.metrics_timeout_s)),
            "options": f"-c statement_timeout={bound_ms} -c lock_timeout={bound_ms}",
            "tcp_user_timeout": max(connect_ms, bound_ms),
            "keepalives": 1,
            "keepalives_idle": 1,
            "keepalives_interval": 1,
            "keepalives_count": 2,
        },
    )


def read_snapshot(engine: Engine, settings: Settings, *, overview: bool = False) -> Snapshot:
    """Read the fast part from the database (one session), then the broker and the library
    disk; the caller adds the history.

    `overview`: also the last hour of finished runs, for `/admin/overview`.
    Raises `MetricsUnavailable` when Postgres cannot be read within the bound.
    """
    connected = False
    try:
        with engine.connect() as conn:
            connected = True
            snap = Snapshot(
                live_runs=stats.live_run_counts(conn),
                steps=stats.step_counts(conn),
                lease_recoveries=stats.lease_recoveries(conn),
                workers_alive=stats.workers_alive(conn),
                outages=stats.steps_in_outage(conn),
                minutes=stats.finished_per_minute(conn) if overview else [],
                now=stats.database_now(conn) if overview else None,
            )
            read_outbox(conn, snap)
    except exc.DBAPIError as e:
        raise MetricsUnavailable(f"database unavailable: {_reason(e)}", _reason_class(e, connected)) from e
    snap.queues = queue_depths(settings)
    snap.library_free_bytes = library_free_bytes(settings.library_root)
    return snap


def read_history(engine: Engine) -> History:
    """The slow part, in one snapshot (`HistoryCache` runs it off the request path): repeatable
    read, so a purge committing in between cannot count its steps twice or not at all (the rows
    it deletes and what it folds into `engine.counter` are read as of one moment)."""
    with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn:
        dispatched = None
        if conn.execute(OUTBOX_TABLE).scalar_one():
            dispatched = int(conn.execute(OUTBOX_DISPATCHED).scalar_one())
        return History(
            finished_runs=stats.finished_run_counts(conn),
            outbox_dispatched=dispatched,
            step_durations=stats.step_durations(conn),
            signal_wakes=stats.signal_wakes(conn),
            read_at=time.monotonic(),
        )


class HistoryCache:
    """The last `History`, refreshed in a background thread when older than `max_age_s`.

    Why: at 1M finished runs the history costs seconds (`bench/metrics_scale.py`); a scrape
    must stay fast and bounded, and Prometheus' `rate()` over minutes does not need the newest
    second. A scrape never waits for a refresh except the very first (up to `wait_s`); a failed
    refresh keeps the last good value and is retried by the next scrape.
    """

    def __init__(self, engine: Callable[[], Engine], max_age_s: float, wait_s: float) -> None:
        self._engine = engine
        self.max_age_s = max_age_s
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._value: History | None = None
        self._thread: threading.Thread | None = None

    def get(self) -> History | None:
        with self._lock:
            stale = self._value is None or time.monotonic() - self._value.read_at >= self.max_age_s
            if stale and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._refresh, name="metrics-history", daemon=True)
                self._thread.start()
            thread = self._thread
        if self._value is None and thread is not None:
            thread.join(self.wait_s)
        return self._value

    def _refresh(self) -> None:
        try:
            self._value = read_history(self._engine())
        except Exception as e:  # the fast part still answers; the next scrape retries
            log.warning("metrics: history not read (%s); serving the last one", e)


def _reason(e: exc.DBAPIError) -> str:
    first = str(e.orig).strip().splitlines()[0] if e.orig is not None else str(e)
    return first[:300]


def _reason_class(e: exc.DBAPIError, connected: bool) -> str:
    """The short class of a failed read, for `proj_database_error{reason}`: a connect refused
    (`connect_failed`), a silent server (`connect_timeout`) and an unmigrated database
    (`query_failed`) in `tests/integration/test_metrics.py::
    test_database_down_answers_quickly_with_database_up_0`, a locked table (`statement_timeout`)
    in `::test_locked_table_answers_database_up_0_within_the_statement_timeout`."""
    if isinstance(e.orig, (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)):
        return STATEMENT_TIMEOUT
    if connected:
        return QUERY_FAILED
    return CONNECT_TIMEOUT if isinstance(e.orig, psycopg.errors.ConnectionTimeout) else CONNECT_FAILED


def read_outbox(conn: stats.Executor, snap: Snapshot) -> None:
    """Outbox backlog, if its table exists (the admin renders on a partial schema too)."""
    if not conn.execute(OUTBOX_TABLE).scalar_one():
        return
    row = conn.execute(OUTBOX_BACKLOG).one()
    snap.outbox = {"pending": int(row.pending), "dead": int(row.dead)}
    snap.outbox_oldest_pending_s = float(row.oldest_pending_s)


def library_free_bytes(root: str) -> int | None:
    """Free bytes on the library's file system; None if the root does not exist."""
    try:
        return int(shutil.disk_usage(root).free)
    except OSError:
        return None


# --------------------------------------------------------------------------------- broker


def engine_queues() -> list[str]:
    """The queues the engine publishes to: `engine` and one per known kind version."""
    from proj.engine.kind import all_kinds

    return ["engine", *sorted({k.queue for k in all_kinds()})]


def queue_depths(settings: Settings) -> dict[str, int] | None:
    """Messages waiting per queue, from the broker itself; None if it does not answer in time."""
    url = settings.broker_url or ""
    try:
        if url.startswith(("redis://", "rediss://")):
            return redis_depths(url, engine_queues(), settings.metrics_timeout_s)
        if url.startswith(("amqp://", "amqps://", "pyamqp://")):
            return amqp_depths(url, engine_queues(), settings.metrics_timeout_s)
    except Exception as e:  # the broker is a hint store: its absence is not a scrape failure
        log.warning("metrics: broker not readable (%s): proj_queue_messages left out", e)
    return None


def redis_depths(url: str, queues: list[str], timeout_s: float) -> dict[str, int]:
    """LLEN of each queue's lists (kombu keeps one list per priority step) in one pipeline."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        pipe = client.pipeline(transaction=False)
        for q in queues:
            for step in REDIS_PRIORITY_STEPS:
                pipe.llen(q if step == 0 else f"{q}{REDIS_PRIORITY_SEP}{step}")
        lengths = pipe.execute()
    finally:
        client.close()
    n = len(REDIS_PRIORITY_STEPS)
    return {q: int(sum(lengths[i * n : (i + 1) * n])) for i, q in enumerate(queues)}


def amqp_depths(url: str, queues: list[str], timeout_s: float) -> dict[str, int]:
    """A passive `queue_declare` per queue (a missing queue holds nothing: 0)."""
    import kombu

    out: dict[str, int] = {}
    with kombu.Connection(url, connect_timeout=timeout_s, transport_options={"max_retries": 1}) as conn:
        conn.ensure_connection(max_retries=1, timeout=timeout_s)
        for q in queues:
            channel = conn.channel()  # a 404 closes its channel: one per queue
            try:
                out[q] = int(channel.queue_declare(q, passive=True).message_count)
            except Exception:
                out[q] = 0
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
    return out


# ------------------------------------------------------------------------------ collector


class EngineCollector(Collector):
    """Metric families from a `Snapshot` (the database answered) or an `Outage` (it did not);
    `describe()` names every family it can export."""

    def __init__(self, state: Snapshot | Outage | None = None) -> None:
        self.state = state

    def describe(self) -> Iterable[Metric]:
        return list(_families(None))

    def collect(self) -> Iterable[Metric]:
        return list(_families(self.state))


def _families(state: Snapshot | Outage | None) -> Iterator[Metric]:
    """Each family once; filled from `state`, or empty (its name and type only) without one.
    An `Outage` yields only the families that need no database: none read from it, not even
    empty, so nothing stale or misleading stands beside `proj_database_up 0`."""
    up = GaugeMetricFamily(
        "proj_database_up", "1 if this scrape read Postgres within METRICS_TIMEOUT_S, 0 if it did not"
    )
    error = GaugeMetricFamily(
        "proj_database_error",
        "Why this scrape could not read Postgres (1 while proj_database_up is 0): "
        "connect_failed, connect_timeout, statement_timeout or query_failed",
        labels=["reason"],
    )
    queues = GaugeMetricFamily("proj_queue_messages", "Messages waiting in the broker", labels=["queue"])
    free = GaugeMetricFamily("proj_library_free_bytes", "Free bytes on the library's file system")
    if state is not None:
        up.add_metric([], 1 if isinstance(state, Snapshot) else 0)
        if isinstance(state, Outage):
            error.add_metric([state.reason], 1)
        for q, n in sorted((state.queues or {}).items()):
            queues.add_metric([q], n)
        if state.library_free_bytes is not None:
            free.add_metric([], state.library_free_bytes)
    yield from (up, error)
    if not isinstance(state, Outage):
        yield from _database_families(state)
    yield from (queues, free)


def _database_families(snap: Snapshot | None) -> Iterator[Metric]:
    """The families read from Postgres; filled from `snap`, or empty without one."""
    runs = GaugeMetricFamily(
        "proj_runs", "Runs by kind, version and status", labels=["kind", "version", "status"]
    )
    steps = GaugeMetricFamily("proj_steps", "Live steps by status", labels=["status"])
    dead = GaugeMetricFamily(
        "proj_dead_letters", "Failed runs awaiting an operator, by kind", labels=["kind"]
    )
    outbox = GaugeMetricFamily("proj_outbox_events", "Outbox events by status", labels=["status"])
    oldest = GaugeMetricFamily("proj_outbox_oldest_pending_seconds", "Age of the oldest pending outbox event")
    recov = CounterMetricFamily(
        "proj_lease_recoveries", "Step leases taken back from dead, frozen or partitioned workers"
    )
    durations = HistogramMetricFamily(
        "proj_step_duration_seconds",
        "First claim to commit of succeeded steps that never parked (rows still present)",
        labels=["kind", "step"],
    )
    wakes = HistogramMetricFamily(
        "proj_signal_wake_seconds", "Signal to the woken wait step claimed again (rows still present)"
    )
    workers = GaugeMetricFamily("proj_workers_alive", "Worker processes holding a liveness session")
    if snap is not None:
        _fill(snap, runs, steps, dead, outbox, oldest, recov, durations, wakes, workers)
    yield from (runs, steps, dead, outbox, oldest, recov, durations, wakes, workers)
    yield from _outage_families(snap)


def _outage_families(snap: Snapshot | None) -> Iterator[Metric]:
    """Steps waiting out an outage of a service they need (qBittorrent, a webhook), and for
    how long: an operator alerts on the age, since such a step spends no attempt and no dead
    letter comes for up to its policy's `outage_s` (`tests/integration/test_outages.py`)."""
    n = GaugeMetricFamily(
        "proj_steps_in_outage",
        "Live steps retrying without spending attempts: a service they need is down",
        labels=["kind", "step"],
    )
    age = GaugeMetricFamily(
        "proj_outage_oldest_seconds",
        "How long the oldest such step has been waiting out its outage",
        labels=["kind", "step"],
    )
    for o in snap.outages if snap is not None else []:
        n.add_metric([o.kind, o.step], o.n)
        age.add_metric([o.kind, o.step], o.oldest_s)
    yield from (n, age)


def _fill(snap: Snapshot, runs: GaugeMetricFamily, steps: GaugeMetricFamily, dead: GaugeMetricFamily,
          outbox: GaugeMetricFamily, oldest: GaugeMetricFamily, recov: CounterMetricFamily,
          durations: HistogramMetricFamily, wakes: HistogramMetricFamily,
          workers: GaugeMetricFamily) -> None:  # fmt: skip
    for r in snap.runs:
        runs.add_metric([r.kind, str(r.version), r.status], r.n)
    for status in STEP_STATUSES:
        steps.add_metric([status], getattr(snap.steps, status))
    for kind, n in sorted(snap.runs_by("failed").items()):
        dead.add_metric([kind], n)
    if snap.outbox is not None:
        for status, n in sorted(snap.outbox.items()):
            outbox.add_metric([status], n)
        oldest.add_metric([], snap.outbox_oldest_pending_s)
    recov.add_metric([], snap.lease_recoveries)
    for (kind, step), h in snap.step_durations.items():
        durations.add_metric([kind, step], _buckets(h), h.total)
    if snap.history is not None:
        wakes.add_metric([], _buckets(snap.history.signal_wakes), snap.history.signal_wakes.total)
    workers.add_metric([], snap.workers_alive)


def _buckets(h: stats.Histogram) -> list[tuple[str, float]]:
    return [("+Inf" if le == float("inf") else repr(le), cum) for le, cum in h.buckets]


def exported_series() -> set[str]:
    """Every series name a scrape may contain (histograms as `_bucket/_sum/_count`, counters as
    `_total`), from the collector itself: what the Grafana dashboard may use
    (`tests/unit/test_dashboard.py`)."""
    out: set[str] = set()
    for fam in EngineCollector().describe():
        if fam.type == "counter":
            out.add(fam.name + "_total")
        elif fam.type == "histogram":
            out.update(fam.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            out.add(fam.name)
    return out


def render(state: Snapshot | Outage) -> bytes:
    """The Prometheus text exposition of one scrape: a snapshot, or an outage."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(state))
    return generate_latest(registry)


# ---------------------------------------------------------------------------------- route


class Source:
    """The bounded engines (made on first use: the app builds without a database) and the
    history cache, shared by `/metrics` and `/admin/overview`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._engines: dict[str, Engine] = {}
        self.history = HistoryCache(
            lambda: self._engine("slow", settings.metrics_slow_timeout_s),
            max_age_s=settings.metrics_slow_s,
            wait_s=settings.metrics_timeout_s,
        )

    def _engine(self, name: str, statement_timeout_s: float | None = None) -> Engine:
        if name not in self._engines:
            self._engines[name] = metrics_engine(self.settings, statement_timeout_s)
        return self._engines[name]

    def snapshot(self, *, overview: bool = False) -> Snapshot:
        """Fast part now, then the history as last read; `MetricsUnavailable` if the database
        does not answer (`/metrics` serves an `Outage` then, `/admin/overview` a 503)."""
        snap = read_snapshot(self._engine("fast"), self.settings, overview=overview)
        snap.history = self.history.get()
        if (
            snap.history is not None
            and snap.outbox is not None
            and snap.history.outbox_dispatched is not None
        ):
            snap.outbox["dispatched"] = snap.history.outbox_dispatched
        return snap


def metrics_router(settings: Settings, source: Source) -> APIRouter:
    """`GET /metrics`, open or behind `METRICS_TOKEN`. Always 200 past the token: when the
    database cannot be read within `METRICS_TIMEOUT_S`, `proj_database_up 0` with the reason's
    class and what needs no database (the module docstring says why)."""
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    def scrape(authorization: Annotated[str | None, Header()] = None) -> Response:
        refused = check_token(settings, authorization)
        if refused is not None:
            return refused
        state: Snapshot | Outage
        try:
            state = source.snapshot()
        except MetricsUnavailable as e:
            log.warning("metrics: %s", e)
            state = Outage(
                e.reason,
                queues=queue_depths(settings),
                library_free_bytes=library_free_bytes(settings.library_root),
            )
        return Response(render(state), media_type=CONTENT_TYPE_LATEST, headers={"Cache-Control": "no-store"})

    return router


def check_token(settings: Settings, authorization: str | None) -> JSONResponse | None:
    """None when the scrape may go on; a 401 JSON answer when `METRICS_TOKEN` is set and the
    request does not carry exactly `Authorization: Bearer <token>` (constant-time compare)."""
    expected = settings.metrics_token.get_secret_value() if settings.metrics_token else ""
    if not expected:
        return None
    if bearer_matches(authorization, expected):
        return None
    return JSONResponse(
        {"detail": "missing or wrong bearer token (METRICS_TOKEN)", "error": "Unauthorized"},
        status_code=401,
        headers={"WWW-Authenticate": 'Bearer realm="proj metrics"'},
    )
