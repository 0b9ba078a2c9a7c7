"""The sweeper's statements: Postgres decides what must run, the broker is only told.

One sweep at a time per database (`LOCK_SWEEP`/`TRY_LOCK_SWEEP`, transaction-level), so two
beats are harmless. Proofs: `tests/faults/test_engine_faults.py`, `tests/faults/test_recovery_fast.py`.

| statement | from | to |
|---|---|---|
| `EXPIRE_LEASES` | step running, lease past | pending (attempts left) or failed: `LeaseExpired` |
| `CANCELS_TO_FINISH` | | live runs with a cancel request (each then `chain.finalize_cancel`) |
| `PUBLISH_DUE` | step pending, due, never published or its message seemingly lost | published now |
| `SLOTS_OF_RUNS` | | the (kind, version, key) slots of runs whose step lost its lease |
"""

from __future__ import annotations

from sqlalchemy import text

SWEEP_LOCK = 0x5EE9_0001
LOCK_SWEEP = text("SELECT pg_advisory_xact_lock(:k)")
TRY_LOCK_SWEEP = text("SELECT pg_try_advisory_xact_lock(:k)")

EXPIRE_LEASES = text(
    """
    UPDATE engine.step
       SET status = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'pending' END,
           error = jsonb_build_object('type', 'LeaseExpired', 'message',
                   'worker ' || coalesce(lease_owner, '?') || ' stopped renewing its lease'),
           lease_token = NULL, lease_until = NULL, published_at = NULL,
           next_attempt_at = now()
     WHERE id IN (SELECT id FROM engine.step WHERE status = 'running'
                   AND lease_until < now() ORDER BY lease_until LIMIT :n
                   FOR UPDATE SKIP LOCKED)
    RETURNING id, run_id, status, name, attempts, error
    """
)

CANCELS_TO_FINISH = text(
    """
    SELECT id FROM engine.task_run
     WHERE cancel_requested_at IS NOT NULL AND status IN ('pending', 'running', 'waiting')
     LIMIT :n
    """
)

PUBLISH_DUE = text(
    """
    UPDATE engine.step s SET published_at = now()
      FROM engine.task_run r
     WHERE s.id IN (
            SELECT p.id FROM engine.step p JOIN engine.task_run pr ON pr.id = p.run_id
             WHERE p.status = 'pending' AND p.next_attempt_at <= now()
               AND (p.published_at IS NULL
                    OR p.published_at < now() - make_interval(secs => :again))
             ORDER BY pr.priority DESC, p.next_attempt_at LIMIT :n
             FOR UPDATE OF p SKIP LOCKED)
       AND r.id = s.run_id AND r.status IN ('pending', 'running', 'waiting')
       AND r.cancel_requested_at IS NULL
    RETURNING s.id, s.name, r.kind, r.version, r.priority, s.next_attempt_at
    """
)

SLOTS_OF_RUNS = text(
    "SELECT DISTINCT kind, version, concurrency_key FROM engine.task_run WHERE id = ANY(:ids)"
)

# A message that could not be sent: the next sweep sends the step at once.
MARK_UNPUBLISHED = text("UPDATE engine.step SET published_at = NULL WHERE id = ANY(:ids)")
