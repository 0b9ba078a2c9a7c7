"""What operators read of the engine (/admin, `proj runs`/`show`): lists, counts and one run's
stages, progress and parked step. Read only: no statement here changes a row.

The runs list takes its filters as nullable parameters (NULL: any), so the statement is one and
whole whatever the operator filters on. Proofs: `tests/integration/test_admin.py`,
`tests/integration/test_cli.py`.
"""

from __future__ import annotations

from sqlalchemy import text

LIST_RUNS = text(
    """
    SELECT id, kind, version, status, current_step, idempotency_key, created_at, updated_at,
           finished_at, cancel_requested_at, last_error
      FROM engine.task_run
     WHERE (CAST(:kind AS text) IS NULL OR kind = :kind)
       AND (CAST(:version AS int) IS NULL OR version = :version)
       AND (CAST(:status AS text) IS NULL OR status = :status)
       AND (CAST(:rid AS uuid) IS NULL OR id = :rid OR idempotency_key = :q)
       AND (CAST(:pat AS text) IS NULL OR id::text LIKE :prefix OR idempotency_key ILIKE :pat)
     ORDER BY created_at DESC, id
     LIMIT :limit OFFSET :offset
    """
)

RUN_KINDS = text("SELECT DISTINCT kind FROM engine.task_run ORDER BY kind")
RUN_VERSIONS = text("SELECT DISTINCT version FROM engine.task_run ORDER BY version")
STATUS_COUNTS = text("SELECT status, count(*) FROM engine.task_run GROUP BY status")

RUN = text("SELECT * FROM engine.task_run WHERE id = :id")
RUN_PROGRESS = text("SELECT status, current_step, updated_at FROM engine.task_run WHERE id = :id")

RUNNING_PROGRESS = text(
    """
    SELECT name, item_index, status, progress FROM engine.step
     WHERE run_id = :id AND progress IS NOT NULL AND status = 'running'
     ORDER BY stage, item_index
    """
)

STAGE_COUNTS = text(
    """
    SELECT stage, name, status, count(*) AS n, max(attempts) AS attempts,
           max(max_attempts) AS max_attempts
      FROM engine.step WHERE run_id = :id
     GROUP BY stage, name, status ORDER BY stage, name
    """
)

PARKED_STEP = text(
    """
    SELECT name, wait_topic, wait_until, wait_since, wakeups FROM engine.step
     WHERE run_id = :id AND status = 'waiting' ORDER BY stage LIMIT 1
    """
)

DEAD_LETTERS = text(
    """
    SELECT * FROM engine.task_run WHERE status = 'failed'
     ORDER BY finished_at DESC NULLS LAST, created_at DESC LIMIT :limit
    """
)

FAILED_STEPS = text(
    """
    SELECT name, item_index, attempts, max_attempts, error, finished_at FROM engine.step
     WHERE run_id = :id AND status = 'failed' ORDER BY stage, item_index
    """
)

VERSION_MATRIX = text(
    """
    SELECT kind, version, status, count(*) AS n,
           min(created_at) FILTER (WHERE status IN ('pending','running','waiting')) AS oldest_active
      FROM engine.task_run GROUP BY kind, version, status ORDER BY kind, version
    """
)

PARKED_RUNS = text(
    """
    SELECT r.id AS run_id, r.kind, r.version, r.idempotency_key, s.name, s.wait_topic,
           s.wait_until, s.wait_since, s.wakeups
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE s.status = 'waiting' ORDER BY s.wait_until NULLS LAST LIMIT :limit
    """
)

PARKED_TOPICS = text(
    """
    SELECT s.wait_topic AS topic, count(*) AS n, min(s.wait_until) AS next_timer,
           (SELECT max(created_at) FROM engine.task_signal g WHERE g.topic = s.wait_topic) AS last_signal
      FROM engine.step s WHERE s.status = 'waiting'
     GROUP BY s.wait_topic ORDER BY n DESC, topic
    """
)

RUN_EXISTS = text("SELECT 1 FROM engine.task_run WHERE id = :id")

# What `proj demo` follows on screen: one run with the database's clock, its steps, and the runs
# of a request named by their keys.
RUN_WITH_CLOCK = text(
    """
    SELECT status, result, last_error, created_at, finished_at, clock_timestamp() AS now
      FROM engine.task_run WHERE id = :id
    """
)

STEPS_OF_RUN = text(
    """
    SELECT stage, name, item_index, item, status, attempts, started_at, finished_at
      FROM engine.step WHERE run_id = :id ORDER BY stage, item_index
    """
)

STEPS_NAMED_BY_KEY = text(
    """
    SELECT s.item_index, s.item, s.status, s.progress, s.finished_at
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE r.idempotency_key = :key AND s.name = :step ORDER BY s.item_index
    """
)

ENDED_BADLY_BY_KEYS = text(
    """
    SELECT kind, status, last_error FROM engine.task_run
     WHERE idempotency_key = ANY(:keys) AND status IN ('failed', 'canceled')
    """
)

FIRST_SIGNAL = text("SELECT min(created_at) FROM engine.task_signal WHERE topic = :topic")

RUNS_WITH_OPEN_STEPS_BY_KEYS = text(
    """
    SELECT kind, status, last_error,
           (SELECT string_agg(s.name || ' ' || s.status, ', ' ORDER BY s.stage, s.item_index)
              FROM engine.step s WHERE s.run_id = r.id AND s.status <> 'succeeded') AS open_steps
      FROM engine.task_run r WHERE idempotency_key = ANY(:keys) ORDER BY created_at
    """
)

STEP_ERRORS_BY_KEYS = text(
    """
    SELECT r.kind, s.name, s.item_index, s.status, s.attempts, s.error
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE r.idempotency_key = ANY(:keys) AND s.error IS NOT NULL ORDER BY s.id
    """
)
