"""Statistics over `engine.*`: what `/metrics` and `/admin/overview` show, and the one counter
the sweeper bumps (`count_lease_recoveries`, the only write here).

Why here: `proj/engine/store/` is the one owner of engine statements (DESIGN §7), so the
collector (`proj.admin.metrics`) and the overview page never write engine SQL of their own.

Cost at scale (`bench/metrics_scale.py`, 1M finished runs, plans in `bench/README.md`):
- *fast* statements run at every scrape and read only small partial indexes: live and failed
  runs (`task_run_live_idx`), live steps (`step_due_idx`, `step_running_run_idx`,
  `step_wait_until_idx`), the last hour of finished runs (`task_run_finished_idx`), and the
  lease-recovery counter, one row of `engine.counter` bumped by the sweeper;
- *slow* statements read the whole history (succeeded/canceled counts, the histograms): the
  admin runs them in the background at most every `METRICS_SLOW_S` and serves the last result.
  The histograms are derived from the rows still present plus what `purge` folded into
  `engine.counter` when it deleted the steps of runs older than `RETENTION_DAYS`
  (`retention.PURGE_FINISHED_STEPS`), so they survive restarts of workers and of the admin alike
  and never go down (a histogram's buckets are counters: a drop is a reset to Prometheus). The
  caller reads both in one snapshot (`proj.admin.metrics.read_history`: repeatable read). Step
  durations cost one pass over the retained succeeded steps; signal wakes only the steps a
  signal woke (`step_signalled_idx`).

Every statement is a named constant written out whole; every reader returns typed rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, text
from sqlalchemy.orm import Session

Executor = Connection | Session

# Bucket upper bounds (seconds, `le`) of the two histograms; +Inf is implied.
STEP_DURATION_BOUNDS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
)  # fmt: skip
SIGNAL_WAKE_BOUNDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# ---------------------------------------------------------------------------------- gauges

# Live and failed runs: few, read every scrape through `task_run_live_idx` (partial, 0008).
RUN_COUNTS_LIVE = text(
    """
    SELECT kind, version, status, count(*) AS n
      FROM engine.task_run
     WHERE status IN ('pending', 'running', 'waiting', 'failed')
     GROUP BY kind, version, status
     ORDER BY kind, version, status
    """
)
# Succeeded and canceled runs: all the history, one pass over `task_run_status_idx` (index-only,
# ~0.2 s at 1M runs): a *slow* statement, refreshed in the background (`proj.admin.metrics`).
RUN_COUNTS_FINISHED = text(
    """
    SELECT kind, version, status, count(*) AS n
      FROM engine.task_run
     WHERE status IN ('succeeded', 'canceled')
     GROUP BY kind, version, status
     ORDER BY kind, version, status
    """
)
# One probe of each partial index of live steps (`step_due_idx`, `step_lease_idx`,
# `step_wait_until_idx`): finished steps are never read.
STEP_COUNTS = text(
    """
    SELECT (SELECT count(*) FROM engine.step WHERE status = 'pending') AS pending,
           (SELECT count(*) FROM engine.step WHERE status = 'running') AS running,
           (SELECT count(*) FROM engine.step WHERE status = 'waiting') AS waiting
    """
)
# Steps waiting out an outage of a service they need (`errors.Unavailable`, migration 0014), per
# kind and step, with the oldest outage's age: one probe of `step_outage_idx`, which holds only
# those steps. A dead letter's step past its window keeps `outage_since`: only live runs count.
STEPS_IN_OUTAGE = text(
    """
    SELECT r.kind, s.name, count(*) AS n,
           extract(epoch FROM now() - min(s.outage_since)) AS oldest_s
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE s.outage_since IS NOT NULL AND s.status IN ('pending', 'running')
       AND r.status IN ('pending', 'running', 'waiting')
     GROUP BY r.kind, s.name
     ORDER BY r.kind, s.name
    """
)
# Worker processes holding their liveness session (`proj.engine.liveness`): the database's own
# view of who can claim, no broker round trip. 0 when `REAP_INTERVAL_S=0` (no sessions).
WORKERS_ALIVE = text(
    """
    SELECT count(*) FROM pg_stat_activity
     WHERE datname = current_database() AND application_name = 'proj-liveness'
    """
)
# Runs that ended in the last hour, per minute and status (`task_run_finished_idx`).
FINISHED_PER_MINUTE = text(
    """
    SELECT date_trunc('minute', finished_at) AS minute, status, count(*) AS n
      FROM engine.task_run
     WHERE finished_at >= date_trunc('minute', now()) - interval '59 minutes'
     GROUP BY 1, 2
     ORDER BY 1, 2
    """
)
DATABASE_NOW = text("SELECT now()")

# -------------------------------------------------------------------------------- counters

LEASE_RECOVERIES = text(
    "SELECT coalesce((SELECT value FROM engine.counter WHERE name = 'lease_recoveries'), 0)"
)
# Written by the sweeper in the transaction that takes the leases back (`sweeper.sweep`).
COUNT_LEASE_RECOVERIES = text(
    """
    INSERT INTO engine.counter (name, value) VALUES ('lease_recoveries', :n)
    ON CONFLICT (name) DO UPDATE SET value = engine.counter.value + EXCLUDED.value
    """
)

# ------------------------------------------------------------------------------ histograms

# A step's duration: its first claim to its commit (retries and their backoff included) for
# succeeded steps that never parked; a parked wait's time is the signal's, not its work.
# `width_bucket(x, bounds)` is the number of bounds <= x: bucket k holds bounds[k-1] <= x < bounds[k].
STEP_DURATION_BUCKETS = text(
    """
    SELECT r.kind, s.name AS step,
           width_bucket(extract(epoch FROM s.finished_at - s.started_at)::float8,
                        CAST(:bounds AS float8[])) AS bucket,
           count(*) AS n,
           sum(extract(epoch FROM s.finished_at - s.started_at))::float8 AS total
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE s.status = 'succeeded' AND s.wakeups = 0
       AND s.started_at IS NOT NULL AND s.finished_at IS NOT NULL
     GROUP BY r.kind, s.name, bucket
    """
)
# A signal's wake: the first signal that woke a parked step (`step.signalled_at`, set by the
# wake in `runs.signal` and kept by later wakes) to that step's next claim (its first attempt
# started since). Steps not claimed yet are not counted until they are; then for good.
SIGNAL_WAKE_BUCKETS = text(
    """
    SELECT width_bucket(w.secs, CAST(:bounds AS float8[])) AS bucket, count(*) AS n,
           sum(w.secs)::float8 AS total
      FROM (SELECT extract(epoch FROM (SELECT min(a.started_at) FROM engine.attempt a
                                        WHERE a.step_id = s.id AND a.started_at >= s.signalled_at)
                                      - s.signalled_at)::float8 AS secs
              FROM engine.step s
             WHERE s.signalled_at IS NOT NULL) w
     WHERE w.secs IS NOT NULL
     GROUP BY bucket
    """
)

# What `purge` folded in of the steps it deleted (`retention.PURGE_FINISHED_STEPS`): counter
# rows named `["step_duration_seconds", kind, step, le | "sum_us"]`, `["signal_wake_seconds", …]`.
HISTOGRAM_BASE = text(
    """
    SELECT name::jsonb AS key, value FROM engine.counter
     WHERE name LIKE :prefix ORDER BY name
    """
)


# ----------------------------------------------------------------------------------- types


@dataclass(frozen=True)
class RunCount:
    kind: str
    version: int
    status: str
    n: int


@dataclass(frozen=True)
class StepCounts:
    pending: int
    running: int
    waiting: int


@dataclass(frozen=True)
class OutageCount:
    """Steps of one kind and step name waiting out an outage, and how long the oldest has."""

    kind: str
    step: str
    n: int
    oldest_s: float


@dataclass(frozen=True)
class MinuteCount:
    minute: datetime
    status: str
    n: int


@dataclass(frozen=True)
class Histogram:
    """Cumulative buckets as Prometheus wants them: `(le, count)` ending with +Inf."""

    buckets: tuple[tuple[float, int], ...]
    total: float

    @property
    def count(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    def quantile(self, q: float) -> float | None:
        """Linear interpolation within the bucket, as PromQL's `histogram_quantile` does."""
        if self.count == 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0
        for le, cum in self.buckets:
            if cum >= rank:
                if le == float("inf"):
                    return lower  # beyond the last finite bound: its lower edge, like PromQL
                inside = cum - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 0.0)
            lower, below = le, cum
        return lower


def cumulative(bounds: Sequence[float], per_bucket: dict[int, int], total: float) -> Histogram:
    """`width_bucket` counts (index k = k bounds <= x) to cumulative `le` buckets."""
    out, running = [], 0
    for k, le in enumerate([*bounds, float("inf")]):
        running += per_bucket.get(k, 0)
        out.append((le, running))
    return Histogram(buckets=tuple(out), total=total)


# --------------------------------------------------------------------------------- readers


def live_run_counts(s: Executor) -> list[RunCount]:
    """Pending, running, waiting and failed runs per kind and version (`proj_runs`, dead
    letters, parked runs): exact at every scrape."""
    return [RunCount(r.kind, int(r.version), r.status, int(r.n)) for r in s.execute(RUN_COUNTS_LIVE)]


def finished_run_counts(s: Executor) -> list[RunCount]:
    """Succeeded and canceled runs per kind and version (the slow part of `proj_runs`)."""
    return [RunCount(r.kind, int(r.version), r.status, int(r.n)) for r in s.execute(RUN_COUNTS_FINISHED)]


def step_counts(s: Executor) -> StepCounts:
    """Live steps by status (`proj_steps`)."""
    row = s.execute(STEP_COUNTS).one()
    return StepCounts(pending=int(row.pending), running=int(row.running), waiting=int(row.waiting))


def steps_in_outage(s: Executor) -> list[OutageCount]:
    """Live steps waiting out an outage, per kind and step (`proj_steps_in_outage`)."""
    return [OutageCount(r.kind, r.name, int(r.n), float(r.oldest_s)) for r in s.execute(STEPS_IN_OUTAGE)]


def workers_alive(s: Executor) -> int:
    """Worker processes with a liveness session (`proj_workers_alive`)."""
    return int(s.execute(WORKERS_ALIVE).scalar_one())


def lease_recoveries(s: Executor) -> int:
    """Leases taken back from workers since the schema exists (`proj_lease_recoveries_total`)."""
    return int(s.execute(LEASE_RECOVERIES).scalar_one())


def finished_per_minute(s: Executor) -> list[MinuteCount]:
    """Runs finished in the last hour by minute and status (the overview's first chart)."""
    return [MinuteCount(r.minute, r.status, int(r.n)) for r in s.execute(FINISHED_PER_MINUTE)]


def count_lease_recoveries(s: Session, n: int) -> None:
    """Add `n` to `proj_lease_recoveries_total`, in the sweeper's transaction that took the leases
    back (so the counter and the recoveries commit together)."""
    s.execute(COUNT_LEASE_RECOVERIES, {"n": n})


def database_now(s: Executor) -> datetime:
    """The database's clock: charts are aligned on it, not on this host's."""
    now: datetime = s.execute(DATABASE_NOW).scalar_one()
    return now


def _bucket_of(bounds: Sequence[float], le: float) -> int:
    """The `width_bucket` index of the first bucket whose upper bound is at least `le` (a bound
    folded under other bounds lands in the next bucket up: still counted below its `le`)."""
    for k, bound in enumerate(bounds):
        if bound >= le:
            return k
    return len(bounds)


def _fold(bounds: Sequence[float], buckets: dict[int, int], le: str, n: int) -> float:
    """Add one row purge folded (`_base`) to `buckets`; the seconds it adds to the sum."""
    if le == "sum_us":
        return n / 1_000_000
    k = _bucket_of(bounds, float(le))
    buckets[k] = buckets.get(k, 0) + n
    return 0.0


def _base(s: Executor, name: str) -> list[tuple[list[str], int]]:
    rows = s.execute(HISTOGRAM_BASE, {"prefix": f'["{name}",%'})
    return [(list(r.key), int(r.value)) for r in rows]


def step_durations(s: Executor) -> dict[tuple[str, str], Histogram]:
    """`proj_step_duration_seconds` per (kind, step): the steps present plus what purge folded."""
    per: dict[tuple[str, str], dict[int, int]] = {}
    totals: dict[tuple[str, str], float] = {}
    for r in s.execute(STEP_DURATION_BUCKETS, {"bounds": list(STEP_DURATION_BOUNDS)}):
        key = (r.kind, r.step)
        per.setdefault(key, {})[int(r.bucket)] = int(r.n)
        totals[key] = totals.get(key, 0.0) + float(r.total or 0.0)
    for (_, kind, step_name, le), n in _base(s, "step_duration_seconds"):
        key = (kind, step_name)
        totals[key] = totals.get(key, 0.0) + _fold(STEP_DURATION_BOUNDS, per.setdefault(key, {}), le, n)
    return {key: cumulative(STEP_DURATION_BOUNDS, b, totals.get(key, 0.0)) for key, b in sorted(per.items())}


def signal_wakes(s: Executor) -> Histogram:
    """`proj_signal_wake_seconds`: signal → the woken step claimed again (plus what purge folded)."""
    per: dict[int, int] = {}
    total = 0.0
    for r in s.execute(SIGNAL_WAKE_BUCKETS, {"bounds": list(SIGNAL_WAKE_BOUNDS)}):
        per[int(r.bucket)] = int(r.n)
        total += float(r.total or 0.0)
    for (_, le), n in _base(s, "signal_wake_seconds"):
        total += _fold(SIGNAL_WAKE_BOUNDS, per, le, n)
    return cumulative(SIGNAL_WAKE_BOUNDS, per, total)
