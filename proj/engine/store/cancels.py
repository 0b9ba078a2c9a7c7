"""Cancel is business first (invariant 8), and operators' decisions on dead letters.

`REQUEST_CANCEL` only records the request; a running step is never killed. `FINALIZE` moves a
run whose request is recorded to `canceled` once no step holds a live lease: every open step
(pending, waiting, or running with an expired lease) becomes `canceled` with its lease cleared,
the one way a step is canceled outside its own fenced commit (`commits.cancel_step`).

Each function runs the statement named like it in capitals (`cancel_run`: `CANCEL_RUN`).

| function | from | to |
|---|---|---|
| `lock_run_to_cancel` | | run row locked |
| `request_cancel` | run live | `cancel_requested_at` set (kept if set), reason, whether by its parent |
| `live_leases` | open steps locked, skipping held ones | steps under a live lease or held (a cancel waits) |
| `cancel_open_steps` | steps pending, waiting, running | canceled, lease cleared |
| `cancel_run` | run live | canceled |
| `retry_failed_steps` | failed run's failed/pending steps (no cancel, deadline ahead) | pending |
| `reopen_failed_run` | run failed (once `retry_failed_steps` sent a step back) | running |
| `abandon_failed_run` | run failed | running with a cancel request (then finalized, compensation) |

Proofs: `tests/integration/test_waits_cancel.py`, `tests/integration/test_admin.py`.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.status import RunStatus
from proj.engine.store.rows import StepRef, changed

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
           canceled_by_parent = CASE WHEN cancel_requested_at IS NULL THEN :by_parent
                                     ELSE canceled_by_parent END,
           updated_at = now()
     WHERE id = :id AND status IN ('pending', 'running', 'waiting')
    """
)

# The open steps are locked before they are counted: a claim that raced the cancel (it read the
# run before the cancel request committed) holds its step's lock until it commits, so no claim
# can start on a step once it is locked here, and a step that another transaction holds right now
# counts as live. Counted without the locks, such a step was claimed between the count and
# `CANCEL_OPEN_STEPS`, which then canceled it under a body that had just started
# (`tests/integration/test_waits_cancel.py::test_a_cancel_counts_a_claim_that_raced_it`).
# The locks are taken with SKIP LOCKED, never waited for: the cancel holds the run row, and a
# claim of a waiting run's step or a commit holds its step and then waits for the run, so waiting
# here was a deadlock (`test_a_cancel_does_not_deadlock_with_a_claim_of_a_waiting_run`). A step
# skipped is in flight; the run is finalized when that step ends, or by the sweeper.
LIVE_LEASES = text(
    """
    WITH mine AS MATERIALIZED (
        SELECT id, status, lease_until FROM engine.step
         WHERE run_id = :id AND status IN ('pending', 'waiting', 'running')
           FOR UPDATE SKIP LOCKED
    )
    SELECT count(*) FILTER (WHERE m.id IS NULL OR (m.status = 'running' AND m.lease_until > now()))
      FROM engine.step s LEFT JOIN mine m ON m.id = s.id
     WHERE s.run_id = :id AND s.status IN ('pending', 'waiting', 'running')
    """
)

# A running step's attempt is logged as an orphan (`outcome` NULL): its body is not stopped, and
# its commit will be refused (`engine.attempt`, migration 0011).
CANCEL_OPEN_STEPS = text(
    """
    WITH open AS MATERIALIZED (
        SELECT id, status, attempts, lease_token, lease_owner, claimed_at FROM engine.step
         WHERE run_id = :id AND status IN ('pending', 'waiting', 'running')
           FOR UPDATE
    ), orphaned AS (
        INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker, started_at)
        SELECT id, attempts, lease_token, lease_owner, coalesce(claimed_at, now()) FROM open
         WHERE status = 'running' AND lease_token IS NOT NULL
    )
    UPDATE engine.step s SET status = 'canceled', lease_token = NULL, lease_until = NULL,
           finished_at = now()
      FROM open
     WHERE s.id = open.id
    """
)

CANCEL_RUN = text(
    """
    UPDATE engine.task_run SET status = 'canceled', finished_at = now(), updated_at = now()
     WHERE id = :id AND status IN ('pending', 'running', 'waiting')
    RETURNING finished_at, parent_run_id,
              CASE WHEN result_awaited THEN pg_notify('engine_run_finished', id::text)::text END AS notified
    """
)

# Guard: only a dead letter that can run again. Not one past its deadline (no step of it may
# start, and its compensation ran when it expired), nor one asked to cancel (a cancel request is
# never withdrawn: reopened, the run was canceled at once): abandon is the decision left for
# those (`tests/integration/test_ops_review.py`).
RETRY_FAILED_STEPS = text(
    """
    UPDATE engine.step s SET status = 'pending', attempts = 0, outages = 0, outage_since = NULL,
           next_attempt_at = now(), published_at = now(), finished_at = NULL
      FROM engine.task_run r
     WHERE s.run_id = :id AND s.status IN ('failed', 'pending')
       AND r.id = s.run_id AND r.status = 'failed' AND r.cancel_requested_at IS NULL
       AND (r.deadline_at IS NULL OR r.deadline_at > now())
    RETURNING s.id, s.name
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


class RunToCancel(NamedTuple):
    """The run row locked for a cancel: what the cancel hook, the span and the compensation need."""

    id: uuid.UUID
    kind: str
    version: int
    input: dict[str, Any]
    status: RunStatus
    cancel_reason: str | None
    trace: dict[str, Any] | None
    created_at: datetime
    parent_run_id: uuid.UUID | None


class CanceledRun(NamedTuple):
    finished_at: datetime
    parent_run_id: uuid.UUID | None


def lock_run_to_cancel(s: Session, run_id: uuid.UUID) -> RunToCancel | None:
    """Lock the run row (None: no such run)."""
    r = s.execute(LOCK_RUN_TO_CANCEL, {"id": run_id}).first()
    if r is None:
        return None
    status = RunStatus(r.status)
    return RunToCancel(
        r.id, r.kind, r.version, r.input, status, r.cancel_reason, r.trace, r.created_at, r.parent_run_id
    )


def request_cancel(s: Session, run_id: uuid.UUID, reason: str, *, by_parent: bool = False) -> bool:
    """Record the request on a live run; False: the run had finished. `by_parent`: the request
    comes from the run's parent's end (kept only when it is the first request)."""
    params = {"reason": reason, "id": run_id, "by_parent": by_parent}
    return changed(s.execute(REQUEST_CANCEL, params)) > 0


def live_leases(s: Session, run_id: uuid.UUID) -> int:
    """The run's steps running under a live lease, or locked by another transaction (a claim or
    a commit in flight): a cancel waits for them to stop. Locks the run's other open steps until
    the transaction ends, so none is claimed before they are canceled; never waits for a lock."""
    return int(s.scalar(LIVE_LEASES, {"id": run_id}) or 0)


def cancel_open_steps(s: Session, run_id: uuid.UUID) -> int:
    """Cancel every open step of the run (leases cleared); how many."""
    return changed(s.execute(CANCEL_OPEN_STEPS, {"id": run_id}))


def cancel_run(s: Session, run_id: uuid.UUID) -> CanceledRun | None:
    """The live run ends `canceled`; None: it had finished (nothing written)."""
    r = s.execute(CANCEL_RUN, {"id": run_id}).first()
    return None if r is None else CanceledRun(r.finished_at, r.parent_run_id)


def retry_failed_steps(s: Session, run_id: uuid.UUID) -> list[StepRef]:
    """The failed run's failed and pending steps get fresh attempts; returns them (to send).
    Empty when the run may not run again (asked to cancel, past its deadline): nothing written."""
    return [StepRef(*r) for r in s.execute(RETRY_FAILED_STEPS, {"id": run_id})]


def reopen_failed_run(s: Session, run_id: uuid.UUID) -> bool:
    """The failed run is `running` again; False: it was not failed."""
    return changed(s.execute(REOPEN_FAILED_RUN, {"id": run_id})) > 0


def abandon_failed_run(s: Session, run_id: uuid.UUID, reason: str) -> bool:
    """The failed run is `running` with a cancel request (finalizing it compensates); False:
    it was not failed."""
    return changed(s.execute(ABANDON_FAILED_RUN, {"reason": reason, "id": run_id})) > 0
