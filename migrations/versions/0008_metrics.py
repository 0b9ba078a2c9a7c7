"""metrics: the signal time of a woken wait, a lease-recovery counter, a finished-runs index

Revision ID: 0008_metrics
Revises: 0007_front_door
Create Date: 2026-12-04

- `engine.step.signalled_at`: when a signal (not a timer) last woke the parked step, written by
  the wake statement of `runs.signal`. The re-claim is the step's first attempt started at or
  after it, so `proj_signal_wake_seconds` is derived from the tables.
- `engine.counter`: monotonic engine counters. The sweeper adds the leases it took back (expired,
  or ended by the liveness reaper) to `lease_recoveries` in the transaction that takes them back.
  Why not count orphaned `step_attempt` rows at scrape time: `purge` deletes the attempts of old
  runs, which Prometheus would read as a counter reset (a false spike in `rate()`), and an index
  on `step_attempt.outcome` would cost every step commit its HOT update. Backfilled from the
  attempts present (an attempt never closed whose step moved on to another lease).
- `task_run_finished_idx`: the overview's "runs finished per minute" reads the last hour only.
- `step_signalled_idx`: the signal-wake histogram reads only steps a signal woke.
- `task_run_live_idx`: live and failed runs per kind@version at every scrape, without reading
  the finished history (few rows: a run enters it while pending/running/waiting or failed).
"""

from alembic import op

revision = "0008_metrics"
down_revision = "0007_front_door"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE engine.step ADD COLUMN signalled_at TIMESTAMP WITH TIME ZONE")
    op.execute("CREATE INDEX step_signalled_idx ON engine.step (signalled_at) WHERE signalled_at IS NOT NULL")
    op.execute("CREATE TABLE engine.counter (name TEXT PRIMARY KEY, value BIGINT NOT NULL DEFAULT 0)")
    op.execute(
        """
        INSERT INTO engine.counter (name, value)
        SELECT 'lease_recoveries', count(*)
          FROM engine.step_attempt a JOIN engine.step s ON s.id = a.step_id
         WHERE a.outcome IS NULL AND a.lease_token IS DISTINCT FROM s.lease_token
        """
    )
    op.execute(
        "CREATE INDEX task_run_finished_idx ON engine.task_run (finished_at, status) "
        "WHERE finished_at IS NOT NULL"
    )
    op.execute(
        "CREATE INDEX task_run_live_idx ON engine.task_run (kind, version, status) "
        "WHERE status IN ('pending', 'running', 'waiting', 'failed')"
    )


def downgrade() -> None:
    op.execute("DROP INDEX engine.task_run_live_idx")
    op.execute("DROP INDEX engine.task_run_finished_idx")
    op.execute("DROP TABLE engine.counter")
    op.execute("DROP INDEX engine.step_signalled_idx")
    op.execute("ALTER TABLE engine.step DROP COLUMN signalled_at")
