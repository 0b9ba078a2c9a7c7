"""Ending an attempt: every statement here is fenced by the lease token (invariant 3).

The guard `id = :id AND lease_token = :tok AND status = 'running'` sits in each WHERE clause;
no row back means another attempt owns the step now and the commit is refused, with nothing
written (`tests/faults/test_engine_faults.py`, `tests/integration/test_inline.py`).

| statement | step from → to | run |
|---|---|---|
| `SUCCEED_AND_LOCK_RUN` | running → succeeded (result) | row locked for the advance |
| `SUCCEED_AND_CLAIM_NEXT` | running → succeeded; next stage's single step inserted running | pointer moved |
| `SUCCEED_AND_FINISH` | running → succeeded | → succeeded with the result |
| `FAIL_OR_RETRY` | running → failed (final) or pending after a backoff | |
| `RECORD_RETRY_ERROR` | | `last_error` of the retried attempt |
| `CANCEL_STEP` | running → canceled (the body stopped on a cancel request) | |
| `FAIL_RUN` | | live → failed (a dead letter) |
| `CLOSE_ATTEMPT` | its attempt record gets its outcome | |

The two one-statement commits (`SUCCEED_AND_*`) are a linear chain's fast path in autocommit:
they write only when the run is where a plain advance expects it (its stage, no cancel asked,
live); otherwise nothing is written and the general path (`SUCCEED_AND_LOCK_RUN`) sorts it out.
`SUCCEED_AND_CLAIM_NEXT` claims no step past the run's deadline; `SUCCEED_AND_FINISH` leaves a
run with a parent to the general path, which stores the parent's wake-up signal
(`chain.notify_parent`). A run that finishes notifies `engine_run_finished` (`result()`).
"""

from __future__ import annotations

from sqlalchemy import text

SUCCEED_AND_LOCK_RUN = text(
    """
    WITH done AS (
        UPDATE engine.step s SET status = 'succeeded', result = CAST(:result AS jsonb),
               finished_at = now(), lease_token = NULL, lease_until = NULL, progress = NULL
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), closed AS (
        UPDATE engine.step_attempt a SET outcome = 'succeeded', ended_at = now(), error = NULL
          FROM done WHERE a.step_id = done.id AND a.lease_token = :tok
    )
    SELECT r.id, r.kind, r.version, r.input, r.status, r.current_stage, r.cancel_requested_at,
           r.priority, r.trace, r.created_at, coalesce(r.deadline_at <= now(), false) AS past_deadline
      FROM done JOIN engine.task_run r ON r.id = done.run_id
       FOR UPDATE OF r
    """
)

SUCCEED_AND_CLAIM_NEXT = text(
    """
    WITH me AS MATERIALIZED (
        SELECT id, run_id FROM engine.step
         WHERE id = :id AND lease_token = :tok AND status = 'running'
           FOR UPDATE
    ), run AS MATERIALIZED (
        SELECT r.id FROM engine.task_run r JOIN me ON r.id = me.run_id
         WHERE r.current_stage = :stage AND r.cancel_requested_at IS NULL
           AND r.status NOT IN ('succeeded', 'failed', 'canceled')
           AND (r.deadline_at IS NULL OR r.deadline_at > now())
           FOR UPDATE OF r
    ), done AS (
        UPDATE engine.step s SET status = 'succeeded', result = CAST(:result AS jsonb),
               finished_at = now(), lease_token = NULL, lease_until = NULL, progress = NULL
          FROM run
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), closed AS (
        UPDATE engine.step_attempt a SET outcome = 'succeeded', ended_at = now(), error = NULL
          FROM done WHERE a.step_id = done.id AND a.lease_token = :tok
    ), ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, next_attempt_at,
                                 published_at, status, lease_token, lease_owner, lease_until,
                                 attempts, started_at)
        SELECT :run, :next_stage, :next_name, 0, :next_max, now(), now(), 'running', :next_tok,
               :owner, now() + make_interval(secs => :ttl), 1, now()
          FROM done
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, now() AS claimed_at
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :next_stage, current_step = :next_label,
               updated_at = now()
         WHERE id = :run AND EXISTS (SELECT FROM done)
    ), attempt AS (
        INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker)
        SELECT id, 1, :next_tok, :owner FROM ins
    )
    SELECT done.id, ins.id AS next_id, ins.claimed_at FROM done LEFT JOIN ins ON true
    """
)

SUCCEED_AND_FINISH = text(
    """
    WITH me AS MATERIALIZED (
        SELECT id, run_id FROM engine.step
         WHERE id = :id AND lease_token = :tok AND status = 'running'
           FOR UPDATE
    ), run AS MATERIALIZED (
        SELECT r.id FROM engine.task_run r JOIN me ON r.id = me.run_id
         WHERE r.current_stage = :stage AND r.cancel_requested_at IS NULL
           AND r.status NOT IN ('succeeded', 'failed', 'canceled') AND r.parent_run_id IS NULL
           FOR UPDATE OF r
    ), done AS (
        UPDATE engine.step s SET status = 'succeeded', result = CAST(:result AS jsonb),
               finished_at = now(), lease_token = NULL, lease_until = NULL, progress = NULL
          FROM run
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), closed AS (
        UPDATE engine.step_attempt a SET outcome = 'succeeded', ended_at = now(), error = NULL
          FROM done WHERE a.step_id = done.id AND a.lease_token = :tok
    ), finished AS (
        UPDATE engine.task_run t
           SET status = 'succeeded', result = CAST(:result AS jsonb), current_stage = :end_stage,
               current_step = NULL, finished_at = now(), updated_at = now()
          FROM done WHERE t.id = done.run_id
     RETURNING t.id, t.kind, t.version, t.trace, t.created_at, t.finished_at,
               pg_notify('engine_run_finished', t.id::text)::text AS notified
    )
    SELECT * FROM finished
    """
)

FAIL_OR_RETRY = text(
    """
    UPDATE engine.step
       SET status = CASE WHEN :final THEN 'failed' ELSE 'pending' END,
           next_attempt_at = now() + make_interval(secs => :delay),
           error = CAST(:err AS jsonb), lease_token = NULL, lease_until = NULL,
           published_at = NULL,
           finished_at = CASE WHEN :final THEN now() ELSE NULL END
     WHERE id = :id AND lease_token = :tok AND status = 'running'
    RETURNING id
    """
)

RECORD_RETRY_ERROR = text(
    "UPDATE engine.task_run SET last_error = CAST(:err AS jsonb), updated_at = now() WHERE id = :run"
)

CANCEL_STEP = text(
    """
    UPDATE engine.step SET status = 'canceled', lease_token = NULL, lease_until = NULL,
           finished_at = now()
     WHERE id = :id AND lease_token = :tok AND status = 'running'
    RETURNING id
    """
)

CLOSE_ATTEMPT = text(
    """
    UPDATE engine.step_attempt SET outcome = :outcome, ended_at = now(), error = CAST(:error AS jsonb)
     WHERE step_id = :id AND lease_token = :tok
    """
)

# Guard: only a live run becomes a dead letter (a finished one stays as it finished).
FAIL_RUN = text(
    """
    UPDATE engine.task_run SET status = 'failed', last_error = CAST(:err AS jsonb),
           finished_at = now(), updated_at = now()
     WHERE id = :run AND status NOT IN ('succeeded', 'failed', 'canceled')
    RETURNING id, kind, version, trace, created_at, finished_at, parent_run_id,
              pg_notify('engine_run_finished', id::text)::text AS notified
    """
)
