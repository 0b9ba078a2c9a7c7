"""Child runs, run deadlines and waiting for a run's result.

A child step enqueues its child (`stages.INSERT_RUN` with `parent_run_id`) and, in the same
transaction, parks on the topic `run-finished:<child id>` (`waits.PARK`) unless the child has
finished already (`CHILD_STATE`, read under the topic's advisory lock). A run with a parent that
finishes (succeeded, failed, canceled) stores that signal and wakes the parked step in its own
finishing transaction (`waits.LOCK_TOPIC`, `waits.STORE_SIGNAL`, `waits.WAKE_TOPIC`). Every
statement that finishes a run also issues `pg_notify('engine_run_finished', <run id>)`, delivered
at commit, which `TaskEngine.result()` listens for.

| statement | from | to |
|---|---|---|
| `CHILD_STATE` | | the child's status, result and error (under the topic lock) |
| `LIVE_CHILDREN` | | a run's unfinished children not asked to cancel yet, locked (the cascade) |
| `CHILDREN` | | a run's children, for the admin tree and `proj show` |
| `PAST_DEADLINE` | live runs past `deadline_at`, no live lease | locked for `EXPIRE_RUN` |
| `EXPIRE_RUN` | run live | failed with `DeadlineExceeded` |
| `RUN_OUTCOME` (psycopg) | | a run's status and outcome, read by `result()` on its LISTEN connection |

Proofs: `tests/integration/test_children.py`, `tests/faults/test_children_faults.py`.
"""

from __future__ import annotations

from sqlalchemy import text

RUN_FINISHED_CHANNEL = "engine_run_finished"


def finished_topic(run_id: object) -> str:
    """The stored signal a finishing child run leaves for its parent's parked step."""
    return f"run-finished:{run_id}"


CHILD_STATE = text(
    """
    SELECT id, kind, status, result, last_error, cancel_reason
      FROM engine.task_run WHERE id = :id
    """
)

LIVE_CHILDREN = text(
    """
    SELECT id FROM engine.task_run
     WHERE parent_run_id = :id AND status IN ('pending', 'running', 'waiting')
       AND cancel_requested_at IS NULL
     ORDER BY created_at, id
       FOR UPDATE
    """
)

CHILDREN = text(
    """
    SELECT id, kind, version, status, idempotency_key, created_at, finished_at
      FROM engine.task_run WHERE parent_run_id = :id
     ORDER BY created_at, id
    """
)

PAST_DEADLINE = text(
    """
    SELECT r.id FROM engine.task_run r
     WHERE r.deadline_at <= now() AND r.deadline_at IS NOT NULL
       AND r.status IN ('pending', 'running', 'waiting')
       AND NOT EXISTS (SELECT 1 FROM engine.step s
                        WHERE s.run_id = r.id AND s.status = 'running' AND s.lease_until > now())
     ORDER BY r.deadline_at LIMIT :n
       FOR UPDATE OF r SKIP LOCKED
    """
)

# Guard: only a live run expires. Its open steps are canceled by `cancels.CANCEL_OPEN_STEPS`.
EXPIRE_RUN = text(
    """
    UPDATE engine.task_run SET status = 'failed', last_error = CAST(:err AS jsonb),
           finished_at = now(), updated_at = now()
     WHERE id = :run AND status IN ('pending', 'running', 'waiting')
    RETURNING id, kind, version, input, trace, created_at, finished_at, parent_run_id,
              pg_notify('engine_run_finished', id::text)::text AS notified
    """
)

# psycopg SQL, run on `result()`'s own LISTEN connection.
LISTEN = "LISTEN engine_run_finished"
RUN_OUTCOME = """
    SELECT status, result, last_error, cancel_reason FROM engine.task_run WHERE id = %(id)s
"""
