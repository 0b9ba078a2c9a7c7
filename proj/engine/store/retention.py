"""Retention (the `purge` kind): the step rows (with their attempts and results) of runs that
finished more than `:secs` ago, and old signals. Run rows stay: they hold the idempotency key,
which never expires (invariant 5); failed runs keep their steps (dead letters wait for an
operator). Proof: `tests/integration/test_acquisition_kinds.py`.

| function | from | to |
|---|---|---|
| `purge_finished_steps` (`PURGE_FINISHED_STEPS`) | steps of runs finished over `secs` ago | deleted |
| `purge_signals` (`PURGE_SIGNALS`) | signals stored over `secs` ago | deleted |

The histograms' observations of the steps deleted are added to `engine.counter` (see below).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.store import stats
from proj.engine.store.rows import changed

# The steps go, and what the histograms derived from them (`proj_step_duration_seconds`,
# `proj_signal_wake_seconds`, `store.stats`) counted of them is added to `engine.counter` in the
# same statement: a histogram's buckets are counters, and before this every purge made them go
# down (to Prometheus a reset, counted again as new by `rate()`). Every part of the statement sees
# the rows as they were before the delete, the attempts (`engine.attempt`) included. Counter
# names are JSON arrays: `["step_duration_seconds", kind, step, le]` (`le` the bucket's upper
# bound as text, or "sum_us": the sum in microseconds), `["signal_wake_seconds", le]`. Proof:
# `tests/integration/test_observability_review.py::test_purge_does_not_take_observations_…`.
PURGE_FINISHED_STEPS = text(
    """
    WITH gone AS (
        DELETE FROM engine.step
         WHERE run_id IN (SELECT id FROM engine.task_run
                           WHERE status IN ('succeeded', 'canceled')
                             AND finished_at < now() - make_interval(secs => :secs))
        RETURNING id, run_id, name, status, wakeups, started_at, finished_at, signalled_at
    ), durations AS (
        SELECT r.kind, g.name AS step, extract(epoch FROM g.finished_at - g.started_at)::float8 AS secs
          FROM gone g JOIN engine.task_run r ON r.id = g.run_id
         WHERE g.status = 'succeeded' AND g.wakeups = 0
           AND g.started_at IS NOT NULL AND g.finished_at IS NOT NULL
    ), wakes AS (
        SELECT w.secs
          FROM (SELECT extract(epoch FROM (SELECT min(a.started_at) FROM engine.attempt a
                                            WHERE a.step_id = g.id AND a.started_at >= g.signalled_at)
                                          - g.signalled_at)::float8 AS secs
                  FROM gone g
                 WHERE g.signalled_at IS NOT NULL) w
         WHERE w.secs IS NOT NULL
    ), folded AS (
        SELECT jsonb_build_array('step_duration_seconds', kind, step,
                   (CAST(:duration_bounds AS float8[]) || 'Infinity'::float8)
                       [width_bucket(secs, CAST(:duration_bounds AS float8[])) + 1]::text)::text AS name,
               count(*) AS value
          FROM durations GROUP BY 1
        UNION ALL
        SELECT jsonb_build_array('step_duration_seconds', kind, step, 'sum_us')::text,
               round(sum(secs) * 1000000)::bigint
          FROM durations GROUP BY kind, step
        UNION ALL
        SELECT jsonb_build_array('signal_wake_seconds',
                   (CAST(:wake_bounds AS float8[]) || 'Infinity'::float8)
                       [width_bucket(secs, CAST(:wake_bounds AS float8[])) + 1]::text)::text,
               count(*)
          FROM wakes GROUP BY 1
        UNION ALL
        SELECT jsonb_build_array('signal_wake_seconds', 'sum_us')::text, round(sum(secs) * 1000000)::bigint
          FROM wakes HAVING count(*) > 0
    ), kept AS (
        INSERT INTO engine.counter (name, value)
        SELECT name, sum(value) FROM folded GROUP BY name
        ON CONFLICT (name) DO UPDATE SET value = engine.counter.value + EXCLUDED.value
    )
    SELECT count(*) FROM gone
    """
)

PURGE_SIGNALS = text("DELETE FROM engine.task_signal WHERE created_at < now() - make_interval(secs => :secs)")


def purge_finished_steps(s: Session, secs: float) -> int:
    """Delete the steps of runs that succeeded or were canceled over `secs` ago, keeping what
    the histograms counted of them in `engine.counter`; how many."""
    params = {
        "secs": secs,
        "duration_bounds": list(stats.STEP_DURATION_BOUNDS),
        "wake_bounds": list(stats.SIGNAL_WAKE_BOUNDS),
    }
    return int(s.execute(PURGE_FINISHED_STEPS, params).scalar_one())


def purge_signals(s: Session, secs: float) -> int:
    """Delete the signals stored over `secs` ago; how many."""
    return changed(s.execute(PURGE_SIGNALS, {"secs": secs}))
