"""Run-level operations behind the port: enqueue, get, find, signal, cancel and operators'
decisions on dead letters.

All of them write Postgres first and publish after commit; steps themselves are committed only
by the execute ladder (`proj.engine.protocol`). Statements: `proj.engine.store`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from proj import db
from proj.engine import dispatch
from proj.engine.chain import ask_cancel, finalize_cancel, insert_run, insert_runs
from proj.engine.dispatch import Dispatch, step_dispatch
from proj.engine.errors import InvalidInput, PayloadTooLarge, RunCanceled, RunFailed
from proj.engine.heartbeat import lock_idle_ms
from proj.engine.inputs import (
    MAX_KEY_LEN,
    MAX_TOPIC_LEN,
    TOPIC_RE,
    canonical_input,
    check_key,
    check_reason,
    check_topic,
    to_json_text,
    unstorable,
)
from proj.engine.port import TaskRunRef, TaskRunView
from proj.engine.status import ACTIVE, RunStatus
from proj.engine.store import cancels as cancels_store
from proj.engine.store import children as children_store
from proj.engine.store import runs as store_runs
from proj.engine.store import waits
from proj.engine.store.waits import Woken
from proj.settings import get_settings, libpq_url


def enqueue(
    kind: str,
    input: Mapping[str, Any],
    *,
    idempotency_key: str,
    available_at: datetime | None = None,
    priority: int = 0,
    trace: Mapping[str, Any] | None = None,
    version: int | None = None,
    deadline_at: datetime | None = None,
) -> TaskRunRef:
    """Idempotent forever: the same `(kind, key)` always names the same run."""
    with db.transaction() as s:
        ref, out = insert_run(
            s,
            kind,
            input,
            idempotency_key=idempotency_key,
            available_at=available_at,
            priority=priority,
            trace=trace,
            version=version,
            deadline_at=deadline_at,
        )
    dispatch.publish_after_commit(out)
    return ref


def enqueue_many(
    kind: str,
    items: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    available_at: datetime | None = None,
    priority: int = 0,
    trace: Mapping[str, Any] | None = None,
    deadline_at: datetime | None = None,
) -> list[TaskRunRef]:
    """`enqueue` for each `(idempotency_key, input)`, all in one transaction: all or none.

    One statement per 1,000 runs writes the batch (`chain.insert_runs`): 200 runs take 15 ms
    instead of the 90 ms of 200 `insert_run` statements in one transaction. The first steps are
    published after the commit, as `enqueue` does."""
    with db.transaction() as s:
        refs, out = insert_runs(
            s, kind, items, available_at=available_at, priority=priority, trace=trace, deadline_at=deadline_at
        )
    dispatch.publish_after_commit(out)
    return refs


def get(run_id: uuid.UUID) -> TaskRunView | None:
    """The read-only projection of a run (and of its current step)."""
    with db.transaction() as s:
        row = store_runs.view(s, run_id)
    if row is None:
        return None
    return TaskRunView(
        id=row.id,
        kind=row.kind,
        version=row.version,
        status=row.status,
        current_step=row.current_step,
        attempts=row.step_attempts or 0,
        last_error=row.last_error,
        result=row.result,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        cancel_requested=row.cancel_requested_at is not None,
        wait_topic=row.wait_topic if _parked(row) else None,
        wait_until=row.wait_until if _parked(row) else None,
        pending_reason=_pending_reason(row),
        parent_run_id=row.parent_run_id,
        deadline_at=row.deadline_at,
    )


def find(kind: str, idempotency_key: str) -> TaskRunView | None:
    """The run a `(kind, idempotency_key)` names, if it was ever enqueued (invariant 5)."""
    with db.transaction() as s:
        found = store_runs.find_by_keys(s, [(kind, idempotency_key)])
    return get(found[0].id) if found else None


def live_ahead(run_id: uuid.UUID) -> uuid.UUID | None:
    """The oldest live (pending, running, waiting) run of the same kind and `concurrency_key`
    enqueued before `run_id`, or None when it is first in line.

    Why: a kind whose runs of one key must not overlap from first step to last (two relocates
    of one library item) asks this at its first step and refuses to start behind another.
    `concurrency_limit` counts running steps, so it cannot serialize whole runs. Proof:
    `tests/integration/test_relocate_overlap.py`.
    """
    with db.transaction() as s:
        return store_runs.live_ahead(s, run_id)


def _parked(row: store_runs.RunViewRow) -> bool:
    """Waiting on a signal or timer: a woken run shows `waiting` until its step is claimed, but
    its step is pending then (`due_at`), not parked."""
    return row.status == RunStatus.WAITING and row.due_at is None


def _pending_reason(row: store_runs.RunViewRow) -> str | None:
    """Why a run is not moving: an outage it waits out, a future start, a full concurrency
    limit, or no worker serving its version picked it up (a woken run's step included: the run
    shows `waiting` until then,
    `tests/integration/test_wake_batches.py::test_the_claim_moves_a_woken_run_to_running`)."""
    if row.status not in ACTIVE or row.due_at is None:
        return None
    if row.due_at > row.db_now and row.outage_since is not None:
        return (
            f"a service it needs is down (since {row.outage_since.isoformat()}): "
            f"next try at {row.due_at.isoformat()}"
        )
    if row.due_at > row.db_now:
        return f"scheduled for {row.due_at.isoformat()}"
    if row.blocked_reason:
        return str(row.blocked_reason)
    since = row.due_at if row.pending_since is None else max(row.due_at, row.pending_since)
    waited = (row.db_now - since).total_seconds()
    if waited > get_settings().republish_after_s:
        return (
            f"not picked up for {waited:.0f}s: is a worker serving {row.kind}@{row.version} "
            f"(queue {row.kind}.v{row.version}) running?"
        )
    return None


def signal(topic: str, payload: Any = None) -> int:
    """Store the signal, then wake every run parked on the topic; returns how many woke."""
    check_topic(topic)
    body = to_json_text(payload, "signal payload")
    if len(body) > get_settings().max_input_bytes:
        raise PayloadTooLarge("signal payload too large")
    with db.transaction() as s:
        waits.lock_topic(s, topic, idle_ms=lock_idle_ms())
        waits.store_signal(s, topic, body)
        out = woken_dispatches(waits.wake_topic(s, topic))
    # Many waiters on one topic travel WAKE_BATCH to a message (`dispatch.batched`).
    dispatch.publish_after_commit(dispatch.batched(out, dispatch.wake_batch_size()))
    return len(out)


def woken_dispatches(woken: Sequence[Woken]) -> list[Dispatch]:
    """The messages for steps a wake sent back to work."""
    return [step_dispatch(w.id, w.kind, w.version, w.name, w.priority) for w in woken]


class CancelOutcome(NamedTuple):
    """What `cancel` did: `landed`, the request was recorded on the live run (False: the run had
    finished, nothing written); `status`, the run's status when it was asked (its final one
    when the request did not land)."""

    landed: bool
    status: RunStatus


def cancel(run_id: uuid.UUID, reason: str) -> CancelOutcome:
    """Business first: record the request (and the kind's business hook), then stop the run.

    A running step is not killed; it sees `cancel_requested()` and stops itself, and the run is
    finalised when it does (or when its lease expires). Its unfinished child runs are canceled
    too (`chain.finalize_cancel`). Says whether the request landed, from what its guarded
    statement changed: a run that finished after the caller last looked is not canceled, and
    the caller must not say it is
    (`tests/integration/test_cli.py::test_cancel_of_a_run_that_finishes_before_it_lands_says_so`).
    KeyError: no such run.
    """
    check_reason(reason)
    with db.transaction() as s:
        asked = ask_cancel(s, run_id, reason)
    dispatch.publish_after_commit(asked.dispatches)
    return CancelOutcome(asked.landed, asked.status)


# How often `result()` re-reads the run without a notification (one lost with its session).
RESULT_RECHECK_S = 5.0


def result(run_id: uuid.UUID, timeout_s: float) -> Any:
    """Block until the run finishes or `timeout_s` passes: its result, or raise its error
    (`RunFailed`, `RunCanceled`, both with `last_error`) or `TimeoutError`.

    The waiter LISTENs on `engine_run_finished` on a connection of its own (outside the pool;
    one per waiting caller) and marks the run awaited, so the statement that finishes it
    notifies at commit (`store.children.mark_awaited`); the stored state is read after the mark
    (nothing finished before it is missed) and on each
    notification for this run, and every few seconds in case a notification is lost (the
    listening session was cut). KeyError: no such run.
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s < 0:
        raise InvalidInput(f"timeout_s must be a non-negative number, not {timeout_s!r}")
    deadline = time.monotonic() + float(timeout_s)
    wanted = str(run_id)
    with psycopg.connect(_conninfo(), autocommit=True, application_name="proj-result") as conn:
        children_store.listen(conn)
        children_store.mark_awaited(conn, run_id)
        while True:
            row = children_store.run_outcome(conn, run_id)
            if row is None:
                raise KeyError(f"no run {run_id}")
            status, value, last_error, reason = row
            if status == RunStatus.SUCCEEDED:
                return value
            if status == RunStatus.FAILED:
                raise RunFailed(run_id, last_error)
            if status == RunStatus.CANCELED:
                raise RunCanceled(run_id, reason, last_error)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run {run_id} is still {status} after {timeout_s}s")
            for note in conn.notifies(timeout=min(left, RESULT_RECHECK_S)):
                if note.payload == wanted:
                    break


def _conninfo() -> str:
    """Where `result()` LISTENs: a session of its own, so the direct `LIVENESS_DATABASE_URL` when
    one is set (LISTEN does not survive a transaction pooler), else DATABASE_URL, in libpq's
    form (multi-host lists included)."""
    s = get_settings()
    return libpq_url(s.liveness_database_url or s.require_database_url())


def retry_failed(run_id: uuid.UUID) -> int:
    """Operator decision on a dead letter: retry from the failed step(s) with fresh attempts;
    how many were sent back. 0 and nothing written when the run is not a dead letter, or one
    that may not run again: asked to cancel, or past its deadline (and compensated), which only
    abandon resolves (`tests/integration/test_ops_review.py`)."""
    with db.transaction() as s:
        run = cancels_store.lock_run_to_cancel(s, run_id)
        if run is None or run.status != RunStatus.FAILED:
            return 0
        rows = cancels_store.retry_failed_steps(s, run_id)
        if not rows:  # the run stays the dead letter it was: no run without a step to run
            return 0
        cancels_store.reopen_failed_run(s, run_id)
    dispatch.publish_after_commit([step_dispatch(r.id, run.kind, run.version, r.name) for r in rows])
    return len(rows)


def abandon(run_id: uuid.UUID, reason: str) -> bool:
    """Operator decision on a dead letter: give up, with the kind's compensation. False when the
    run is not a dead letter (any more): nothing is touched, so a stale page's abandon cannot
    cancel a run that another operator's retry brought back to life
    (`tests/integration/test_waits_cancel.py::test_abandon_touches_only_a_dead_letter`)."""
    check_reason(reason)
    with db.transaction() as s:
        if not cancels_store.abandon_failed_run(s, run_id, f"abandoned: {reason}"[:2000]):
            return False
        out = finalize_cancel(s, run_id)
    dispatch.publish_after_commit(out)
    return True


__all__ = [
    "MAX_KEY_LEN",
    "MAX_TOPIC_LEN",
    "TOPIC_RE",
    "abandon",
    "canonical_input",
    "cancel",
    "check_key",
    "check_reason",
    "check_topic",
    "enqueue",
    "find",
    "get",
    "insert_run",
    "result",
    "retry_failed",
    "signal",
    "to_json_text",
    "unstorable",
]
