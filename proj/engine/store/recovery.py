"""The sweeper's statements: Postgres decides what must run, the broker is only told.

One sweep at a time per database (`LOCK_SWEEP`/`TRY_LOCK_SWEEP`, transaction-level), so two
beats are harmless. Proofs: `tests/faults/test_engine_faults.py`, `tests/faults/test_recovery_fast.py`.

Each function runs the statement named like it in capitals (`claim`: `CLAIM`) unless
the table names others.

| function | from | to |
|---|---|---|
| `lock_sweep`, `try_lock_sweep` | | the sweep's lock, to the commit |
| `expire_leases` | step running, lease past | pending (attempts left) or failed: `LeaseExpired` |
| `cancels_to_finish` | | live runs with a cancel request (each then `chain.finalize_cancel`) |
| `publish_due` | step pending, due, unsent or its message seemingly lost (to a consumed queue) | published |
| `slots_of_runs` | | the (kind, version, key) slots of runs whose step lost its lease |
| `mark_unpublished` | steps whose message could not be sent | unpublished (the next sweep sends them) |
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.status import StepStatus
from proj.engine.store.leases import CONSUMER_LOCK_NS
from proj.engine.store.rows import Known, changed

SWEEP_LOCK = 0x5EE9_0001
# The sweep's lock is held to its commit, and every other sweep skips or queues behind it. A
# sweeper frozen inside its transaction (SIGSTOP, a paused VM) would hold it past any lease (for
# as long as it stayed frozen behind a transaction pooler, else up to the session's
# `DB_IDLE_IN_TRANSACTION_S`), and no lease would be expired anywhere meanwhile, the liveness fast path's
# included (it sweeps behind the lock). So the lock also bounds its transaction's idle time, as
# `leases.FENCE` does (`idle_in_transaction_session_timeout`, local to the transaction): Postgres
# ends a frozen sweeper's session, and recovery goes on
# (`tests/faults/test_recovery_fast.py::test_a_frozen_sweeper_stops_recovery_briefly`).
LOCK_SWEEP = text(
    "SELECT pg_advisory_xact_lock(:k),"
    " set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)"
)
TRY_LOCK_SWEEP = text(
    "SELECT pg_try_advisory_xact_lock(:k),"
    " set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)"
)

# A step whose attempts are spent (`attempts - outages`: an attempt that waited out an outage is
# not spent, migration 0014) fails its run, which needs the run's kind: one of a version this
# process does not know is left expired for a sweep that knows it (failed here, its run stayed live
# with nothing to end it). One with attempts left only goes back to `pending`, whatever its kind.
# The expired attempts are logged as orphans (`outcome` NULL) from what their step rows said
# before the reset: their holder never ended them (`engine.attempt`, migration 0011).
EXPIRE_LEASES = text(
    """
    WITH gone AS MATERIALIZED (
        SELECT id, attempts, lease_token, lease_owner, claimed_at FROM engine.step st
         WHERE status = 'running' AND lease_until < now()
           AND (attempts - outages < max_attempts OR EXISTS (
                SELECT 1 FROM engine.task_run r
                 WHERE r.id = st.run_id
                   AND (r.kind, r.version) IN (SELECT * FROM unnest(CAST(:known_kinds AS text[]),
                                                                    CAST(:known_versions AS int[])))))
         ORDER BY lease_until LIMIT :n
           FOR UPDATE SKIP LOCKED
    ), orphaned AS (
        INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker, started_at)
        SELECT id, attempts, lease_token, lease_owner, coalesce(claimed_at, now()) FROM gone
         WHERE lease_token IS NOT NULL
    )
    UPDATE engine.step s
       SET status = CASE WHEN s.attempts - s.outages >= s.max_attempts THEN 'failed' ELSE 'pending' END,
           error = jsonb_build_object('type', 'LeaseExpired', 'message',
                   'worker ' || coalesce(s.lease_owner, '?') || ' stopped renewing its lease'),
           lease_token = NULL, lease_until = NULL, published_at = NULL,
           next_attempt_at = now()
      FROM gone
     WHERE s.id = gone.id
    RETURNING s.id, s.run_id, s.status, s.name, s.attempts, s.error
    """
)

CANCELS_TO_FINISH = text(
    """
    SELECT id FROM engine.task_run
     WHERE cancel_requested_at IS NOT NULL AND status IN ('pending', 'running', 'waiting')
       AND (kind, version) IN (SELECT * FROM unnest(CAST(:known_kinds AS text[]),
                                                    CAST(:known_versions AS int[])))
     LIMIT :n
    """
)

# The live-run filter sits inside the LIMIT: pending steps of a failed run (a dead letter keeps
# them for an operator's retry) are due forever, and filtered only outside it they took the
# batch's places on every sweep, so past `:n` of them nothing live was sent again
# (`tests/integration/test_limits.py::test_dead_letters_pending_steps_do_not_starve_the_sweeper`).
#
# A re-send (the step was published before) goes after `again` seconds to a version queue some
# live process says it consumes (`leases.serve_versions`), and only after `again_unconsumed` to
# any other: a message to a queue nobody reads is not lost, it waits there, and re-sending it
# every `again` seconds only grew that queue. Still re-sent, seldom: a worker that does not say
# what it consumes (an older release during a rollout) may serve it, and its message may really
# be lost (a Redis restart). When no process says anything (`REAP_INTERVAL_S=0`: no liveness
# sessions), every queue is re-sent after `again`, as before
# (`tests/integration/test_unserved_versions.py`).
PUBLISH_DUE = text(
    """
    WITH consumed AS MATERIALIZED (
        SELECT l.objid FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.classid = :ns AND l.objsubid = 2 AND l.granted
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    )
    UPDATE engine.step s SET published_at = now()
      FROM engine.task_run r
     WHERE s.id IN (
            SELECT p.id FROM engine.step p JOIN engine.task_run pr ON pr.id = p.run_id
             WHERE p.status = 'pending' AND p.next_attempt_at <= now()
               AND (p.published_at IS NULL
                    OR p.published_at < now() - make_interval(secs => :again_unconsumed)
                    OR (p.published_at < now() - make_interval(secs => :again)
                        AND (NOT EXISTS (SELECT 1 FROM consumed)
                             OR hashtext(pr.kind || '.v' || pr.version::text)::oid
                                IN (SELECT objid FROM consumed))))
               AND pr.status IN ('pending', 'running', 'waiting') AND pr.cancel_requested_at IS NULL
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


class ExpiredLease(NamedTuple):
    """A step whose lease the sweeper took back: `pending` again, or `failed` (attempts spent)."""

    id: int
    run_id: uuid.UUID
    status: StepStatus
    name: str
    attempts: int
    error: dict[str, Any]


class DueStep(NamedTuple):
    """A step the sweeper publishes, with what its message needs."""

    id: int
    name: str
    kind: str
    version: int
    priority: int
    next_attempt_at: datetime


class RunSlot(NamedTuple):
    kind: str
    version: int
    concurrency_key: str | None


def lock_sweep(s: Session, *, idle_ms: int) -> None:
    """Wait for the sweep in progress, then hold the sweep's lock to the commit, in a transaction
    that may sit idle for at most `idle_ms`."""
    s.execute(LOCK_SWEEP, {"k": SWEEP_LOCK, "idle_ms": idle_ms})


def try_lock_sweep(s: Session, *, idle_ms: int) -> bool:
    """Hold the sweep's lock to the commit (the transaction idle for at most `idle_ms`); False:
    another sweep runs (skip this tick)."""
    return bool(s.scalar(TRY_LOCK_SWEEP, {"k": SWEEP_LOCK, "idle_ms": idle_ms}))


def expire_leases(s: Session, n: int, known: Known) -> list[ExpiredLease]:
    """Take back up to `n` expired leases (skipping rows locked by a commit in flight); a step
    with no attempt left only when its run's version is `known` (its run is failed next)."""
    return [
        ExpiredLease(r.id, r.run_id, StepStatus(r.status), r.name, r.attempts, r.error)
        for r in s.execute(EXPIRE_LEASES, {"n": n, **known.params()})
    ]


def cancels_to_finish(s: Session, n: int, known: Known) -> list[uuid.UUID]:
    """Live runs of a `known` version with a cancel request, for `chain.finalize_cancel`."""
    return list(s.scalars(CANCELS_TO_FINISH, {"n": n, **known.params()}).all())


def publish_due(s: Session, *, again_s: float, again_unconsumed_s: float, n: int) -> list[DueStep]:
    """Mark up to `n` due steps published (never sent, or sent over `again_s` ago to a queue
    some process consumes, or over `again_unconsumed_s` ago), highest priority first in the
    selection; the rows come back unordered."""
    params = {"again": again_s, "again_unconsumed": again_unconsumed_s, "n": n, "ns": CONSUMER_LOCK_NS}
    return [DueStep(*r) for r in s.execute(PUBLISH_DUE, params)]


def slots_of_runs(s: Session, run_ids: Sequence[uuid.UUID]) -> list[RunSlot]:
    """The distinct (kind, version, key) of these runs."""
    return [RunSlot(*r) for r in s.execute(SLOTS_OF_RUNS, {"ids": list(run_ids)})]


def mark_unpublished(s: Session, step_ids: Sequence[int]) -> int:
    """These steps' messages were not sent: the next sweep sends them at once."""
    return changed(s.execute(MARK_UNPUBLISHED, {"ids": list(step_ids)}))
