"""Cancel is business first (invariant 8), and operators' decisions on dead letters.

`REQUEST_CANCEL` only records the request; a running step is never killed. `FINALIZE` moves a
run whose request is recorded to `canceled` once no step holds a live lease: every open step
(pending, waiting, or running with an expired lease) becomes `canceled` with its lease cleared,
the one way a step is canceled outside its own fenced commit (`commits.CANCEL_STEP`).

| statement | from | to |
|---|---|---|
| `LOCK_RUN_TO_CANCEL` | | run row locked |
| `REQUEST_CANCEL` | run live | `cancel_requested_at` set (kept if set), reason |
| `LIVE_LEASES` | | steps running under a live lease (a cancel waits for them) |
| `CANCEL_OPEN_STEPS` | steps pending, waiting, running | canceled, lease cleared |
| `CANCEL_RUN` | run live | canceled |
| `RETRY_FAILED_STEPS` | run failed: its failed/pending steps | pending, fresh attempts |
| `REOPEN_FAILED_RUN` | run failed | running |
| `ABANDON_FAILED_RUN` | run failed | running with a cancel request (then `FINALIZE`, compensation) |

Proofs: `tests/integration/test_waits_cancel.py`, `tests/integration/test_admin.py`.
"""

from __future__ import annotations

from sqlalchemy import text

LOCK_RUN_TO_CANCEL = text(
    """
    SELECT id, kind, version, input, status, cancel_reason, trace, created_at, parent_run_id
      FROM engine.task_run WHERE id = :id
       FOR UPDATE
    """
)

REQUEST_CANCEL = text(
    """
    UPDATE engine.task_run
       SET cancel_requested_at = coalesce(cancel_requested_at, now()), cancel_reason = :reason,
           updated_at = now()
     WHERE id = :id AND status IN ('pending', 'running', 'waiting')
    """
)

LIVE_LEASES = text(
    "SELECT count(*) FROM engine.step WHERE run_id = :id AND status = 'running' AND lease_until > now()"
)

CANCEL_OPEN_STEPS = text(
    """
    UPDATE engine.step SET status = 'canceled', lease_token = NULL, lease_until = NULL,
           finished_at = now()
     WHERE run_id = :id AND status IN ('pending', 'waiting', 'running')
    """
)

CANCEL_RUN = text(
    """
    UPDATE engine.task_run SET status = 'canceled', finished_at = now(), updated_at = now()
     WHERE id = :id AND status IN ('pending', 'running', 'waiting')
    RETURNING finished_at, parent_run_id, pg_notify('engine_run_finished', id::text)::text AS notified
    """
)

RETRY_FAILED_STEPS = text(
    """
    UPDATE engine.step SET status = 'pending', attempts = 0, next_attempt_at = now(),
           published_at = now(), finished_at = NULL
     WHERE run_id = :id AND status IN ('failed', 'pending')
    RETURNING id, name
    """
)

REOPEN_FAILED_RUN = text(
    """
    UPDATE engine.task_run SET status = 'running', finished_at = NULL, updated_at = now()
     WHERE id = :id AND status = 'failed'
    """
)

ABANDON_FAILED_RUN = text(
    """
    UPDATE engine.task_run SET status = 'running', cancel_requested_at = now(), cancel_reason = :reason
     WHERE id = :id AND status = 'failed'
    """
)
