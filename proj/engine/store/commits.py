"""Ending an attempt: every statement here is fenced by the lease token (invariant 3).

The guard `id = :id AND lease_token = :tok AND status = 'running'` sits in each WHERE clause;
no row back means another attempt owns the step now and the commit is refused, with nothing
written (`tests/faults/test_engine_faults.py`, `tests/integration/test_inline.py`).

Each function runs the statement named like it in capitals (`fail_run`: `FAIL_RUN`); a
fenced one returns None or False when the commit was refused.

| function | step from → to | run |
|---|---|---|
| `succeed_and_lock_run` | running → succeeded (result) | row locked for the advance |
| `succeed_and_claim_next` | running → succeeded; next stage's single step inserted running | pointer moved |
| `succeed_and_publish_next` | running → succeeded; next single step pending, published | pointer moved |
| `succeed_and_claim_next_batch` | each of a chunk as `succeed_and_claim_next` | each pointer moved |
| `succeed_and_finish` | running → succeeded | → succeeded with the result |
| `fail_or_retry` | running → failed (final, or attempts spent) or pending after a backoff | |
| `retry_outage` | running → pending after a backoff, the attempt not spent (an outage) | |
| `record_retry_error` | | `last_error` of the retried attempt (a live run only) |
| `cancel_step` | running → canceled (the body stopped on a cancel request) | |
| `fail_run` | | live, no cancel asked → failed (a dead letter) |
| `close_attempt` | an attempt that did not succeed is logged with its outcome (`step_attempt`) | |

A success writes no attempt row. The step keeps its `lease_token` and `lease_owner` (only
`lease_until` is cleared), and with `claimed_at` they record the attempt that succeeded
(`engine.attempt`, migration 0011). Every fence also requires `status = 'running'`, so a kept
token grants nothing.

The one-statement commits (`SUCCEED_AND_*`) are a linear chain's fast path in autocommit:
they write only when the run is where a plain advance expects it (its stage, no cancel asked,
live); otherwise nothing is written and the general path (`SUCCEED_AND_LOCK_RUN`) sorts it out.
`SUCCEED_AND_CLAIM_NEXT` claims no step past the run's deadline; `SUCCEED_AND_FINISH` leaves a
run with a parent to the general path, which stores the parent's wake-up signal
(`chain.notify_parent`). A run that finishes notifies `engine_run_finished` (`result()`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj import db
from proj.engine.status import StepStatus
from proj.engine.store.rows import changed
from proj.engine.store.stages import EndedRun, LockedRun, NextStep

# The commits that take a transaction of several statements (`SUCCEED_AND_LOCK_RUN`,
# `FAIL_OR_RETRY`, `RETRY_OUTAGE`, `CANCEL_STEP`) lock the step row first. A holder frozen before
# its COMMIT (SIGSTOP, a paused VM) would keep it locked past its lease (for as long as it stayed
# frozen behind a transaction pooler, else up to the session's `DB_IDLE_IN_TRANSACTION_S`), and
# the sweeper, which skips locked rows, would not take the step back meanwhile. So each bounds its
# transaction's idle time (`bounded`), as `leases.FENCE` does: Postgres ends a frozen holder's
# session, and with it the lock and the uncommitted change
# (`tests/integration/test_idle_bounds.py::test_engine_locks_bound_their_transaction`).
SUCCEED_AND_LOCK_RUN = text(
    """
    WITH bounded AS MATERIALIZED (
        SELECT set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)
    ), done AS (
        UPDATE engine.step s SET status = 'succeeded', result = CAST(:result AS jsonb),
               finished_at = now(), lease_until = NULL, progress = NULL, outage_since = NULL
          FROM bounded
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
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
               finished_at = now(), lease_until = NULL, progress = NULL, outage_since = NULL
          FROM run
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, next_attempt_at,
                                 published_at, status, lease_token, lease_owner, lease_until,
                                 attempts, started_at, claimed_at)
        SELECT :run, :next_stage, :next_name, 0, :next_max, now(), now(), 'running', :next_tok,
               :owner, now() + make_interval(secs => :ttl), 1, now(), now()
          FROM done
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, now() AS claimed_at
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :next_stage, current_step = :next_label,
               updated_at = now()
         WHERE id = :run AND EXISTS (SELECT FROM done)
    )
    SELECT done.id, ins.id AS next_id, ins.claimed_at FROM done LEFT JOIN ins ON true
    """
)

# The same commit when the next step travels as a message of its own (`INLINE_STEPS=0`, or a
# delivery past its inline budget): the next stage's single step is inserted `pending` and marked
# published (the caller publishes it after this statement; if it dies first, the sweeper re-sends
# it after `REPUBLISH_AFTER_S`). One round trip instead of BEGIN, succeed, insert, COMMIT.
SUCCEED_AND_PUBLISH_NEXT = text(
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
               finished_at = now(), lease_until = NULL, progress = NULL, outage_since = NULL
          FROM run
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, next_attempt_at,
                                 published_at)
        SELECT :run, :next_stage, :next_name, 0, :next_max, now(), now()
          FROM done
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :next_stage, current_step = :next_label,
               updated_at = now()
         WHERE id = :run AND EXISTS (SELECT FROM done)
    )
    SELECT done.id, ins.id AS next_id FROM done LEFT JOIN ins ON true
    """
)

# The commits of a chunk of wait steps whose checks held (a mass wake: `protocol._run_chunk`), in
# one statement: for each, what `SUCCEED_AND_CLAIM_NEXT` does for one, with the same guards row by
# row. Step rows are locked in id order, then run rows in id order (the protocol's lock order,
# step before run), so two chunk commits never deadlock; a row whose guard fails is left out and
# its step takes the general path (`tests/integration/test_wake_batches.py`).
SUCCEED_AND_CLAIM_NEXT_BATCH = text(
    """
    WITH w AS MATERIALIZED (
        SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:toks AS uuid[]), CAST(:stages AS int[]),
                             CAST(:results AS text[]), CAST(:next_names AS text[]),
                             CAST(:next_labels AS text[]), CAST(:next_maxs AS int[]),
                             CAST(:next_toks AS uuid[]))
               AS w(id, tok, stage, result, next_name, next_label, next_max, next_tok)
    ), me AS MATERIALIZED (
        SELECT s.id, s.run_id FROM engine.step s JOIN w ON w.id = s.id
         WHERE s.lease_token = w.tok AND s.status = 'running'
         ORDER BY s.id
           FOR UPDATE OF s
    ), run AS MATERIALIZED (
        SELECT r.id, me.id AS step_id FROM engine.task_run r
          JOIN me ON r.id = me.run_id JOIN w ON w.id = me.id
         WHERE r.current_stage = w.stage AND r.cancel_requested_at IS NULL
           AND r.status NOT IN ('succeeded', 'failed', 'canceled')
           AND (r.deadline_at IS NULL OR r.deadline_at > now())
         ORDER BY r.id
           FOR UPDATE OF r
    ), done AS (
        UPDATE engine.step s SET status = 'succeeded', result = CAST(w.result AS jsonb),
               finished_at = now(), lease_until = NULL, progress = NULL, outage_since = NULL
          FROM w, run
         WHERE s.id = w.id AND run.step_id = s.id AND s.lease_token = w.tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, next_attempt_at,
                                 published_at, status, lease_token, lease_owner, lease_until,
                                 attempts, started_at, claimed_at)
        SELECT done.run_id, w.stage + 1, w.next_name, 0, w.next_max, now(), now(), 'running',
               w.next_tok, :owner, now() + make_interval(secs => :ttl), 1, now(), now()
          FROM done JOIN w ON w.id = done.id
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, run_id, lease_token, now() AS claimed_at
    ), pointed AS (
        UPDATE engine.task_run t SET current_stage = w.stage + 1, current_step = w.next_label,
               updated_at = now()
          FROM done JOIN w ON w.id = done.id
         WHERE t.id = done.run_id
    )
    SELECT done.id, ins.id AS next_id, ins.claimed_at FROM done LEFT JOIN ins ON ins.run_id = done.run_id
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
               finished_at = now(), lease_until = NULL, progress = NULL, outage_since = NULL
          FROM run
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), finished AS (
        UPDATE engine.task_run t
           SET status = 'succeeded', result = CAST(:result AS jsonb), current_stage = :end_stage,
               current_step = NULL, finished_at = now(), updated_at = now()
          FROM done WHERE t.id = done.run_id
     RETURNING t.id, t.kind, t.version, t.trace, t.created_at, t.finished_at,
               CASE WHEN t.result_awaited THEN pg_notify('engine_run_finished', t.id::text)::text END
                 AS notified
    )
    SELECT * FROM finished
    """
)

# The attempt counts: the step fails when told to (`:final`) or when its spent attempts reach
# `:budget`, else it waits `:delay` seconds. Spent is `attempts - outages` (an attempt that waited
# out an outage is not spent, `RETRY_OUTAGE`). An error that is not an outage (`:outage` false)
# ends the outage the step was waiting out; one past its window keeps its start, so that every
# later attempt of that outage counts too (else each counted one would open a fresh window).
FAIL_OR_RETRY = text(
    """
    WITH bounded AS MATERIALIZED (
        SELECT set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)
    )
    UPDATE engine.step
       SET status = CASE WHEN :final OR attempts - outages >= :budget THEN 'failed' ELSE 'pending' END,
           next_attempt_at = CASE WHEN :final OR attempts - outages >= :budget THEN now()
                                  ELSE now() + make_interval(secs => :delay) END,
           error = CAST(:err AS jsonb), lease_token = NULL, lease_until = NULL,
           published_at = NULL, outage_since = CASE WHEN :outage THEN outage_since END,
           finished_at = CASE WHEN :final OR attempts - outages >= :budget THEN now() ELSE NULL END
      FROM bounded
     WHERE id = :id AND lease_token = :tok AND status = 'running'
    RETURNING status, attempts - outages AS spent
    """
)

# A service the step needs is down (`errors.Unavailable`): the step waits `:delay` seconds and
# the attempt is not spent (`outages` + 1), while the outage it is waiting out (`outage_since`,
# set by its first such attempt) is younger than `:window` seconds. No row back: the lease is
# gone, or the outage is older than its window and the attempt counts (`FAIL_OR_RETRY`).
RETRY_OUTAGE = text(
    """
    WITH bounded AS MATERIALIZED (
        SELECT set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)
    )
    UPDATE engine.step
       SET status = 'pending', next_attempt_at = now() + make_interval(secs => :delay),
           error = CAST(:err AS jsonb), lease_token = NULL, lease_until = NULL,
           published_at = NULL, outages = outages + 1, outage_since = coalesce(outage_since, now())
      FROM bounded
     WHERE id = :id AND lease_token = :tok AND status = 'running'
       AND (outage_since IS NULL OR outage_since > now() - make_interval(secs => :window))
    RETURNING outage_since, attempts - outages AS spent
    """
)

RECORD_RETRY_ERROR = text(
    """
    UPDATE engine.task_run SET last_error = CAST(:err AS jsonb), updated_at = now()
     WHERE id = :run AND status IN ('pending', 'running', 'waiting')
    """
)

CANCEL_STEP = text(
    """
    WITH bounded AS MATERIALIZED (
        SELECT set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)
    )
    UPDATE engine.step SET status = 'canceled', lease_token = NULL, lease_until = NULL,
           finished_at = now()
      FROM bounded
     WHERE id = :id AND lease_token = :tok AND status = 'running'
    RETURNING id
    """
)

# An attempt that ends other than in success gets its row in the log, from what its step row
# says of it (its holder, when it was claimed), in the transaction that moved the step on. A
# success writes none: the step row stands for it (`engine.attempt`, migration 0011).
CLOSE_ATTEMPT = text(
    """
    INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker, outcome, error,
                                     started_at, ended_at)
    SELECT s.id, :attempt, :tok, s.lease_owner, :outcome, CAST(:error AS jsonb),
           coalesce(s.claimed_at, now()), now()
      FROM engine.step s
     WHERE s.id = :id
    """
)

# Guard: only a live run becomes a dead letter (a finished one stays as it finished).
# A run asked to cancel is not failed: its cancel is finished instead (`commits.fail_run`).
FAIL_RUN = text(
    """
    UPDATE engine.task_run SET status = 'failed', last_error = CAST(:err AS jsonb),
           finished_at = now(), updated_at = now()
     WHERE id = :run AND status NOT IN ('succeeded', 'failed', 'canceled')
       AND cancel_requested_at IS NULL
    RETURNING id, kind, version, trace, created_at, finished_at, parent_run_id,
              CASE WHEN result_awaited THEN pg_notify('engine_run_finished', id::text)::text END AS notified
    """
)


class SucceededAndClaimed(NamedTuple):
    """`succeed_and_claim_next` landed: the step succeeded; `next_id` is the next step claimed
    for this process (None: it existed already, and is someone else's to run)."""

    id: int
    next_id: int | None
    claimed_at: datetime | None


def succeed_and_lock_run(
    s: Session, *, step_id: int, token: uuid.UUID, result: str, idle_ms: int
) -> LockedRun | None:
    """Store the step's `result` (JSON) and lock its run for the advance, in a transaction that
    may sit idle for at most `idle_ms` from here; None: refused."""
    params = {"id": step_id, "tok": token, "result": result, "idle_ms": idle_ms}
    row = s.execute(SUCCEED_AND_LOCK_RUN, params).first()
    return None if row is None else LockedRun.of(row)


def succeed_and_claim_next(
    conn: db.Autocommit, *, step_id: int, token: uuid.UUID, stage: int, result: str, next_step: NextStep
) -> SucceededAndClaimed | None:
    """The one-statement commit of a step whose next stage is one plain step for this process;
    None: refused, or the run is not where a plain advance expects it (nothing written)."""
    params = {"id": step_id, "tok": token, "stage": stage, "result": result, **next_step.params()}
    row = conn.first(SUCCEED_AND_CLAIM_NEXT, params)
    return None if row is None else SucceededAndClaimed(*row)


class NextMessage(NamedTuple):
    """The next stage's single step, to insert pending and send as a message of its own
    (`SUCCEED_AND_PUBLISH_NEXT`)."""

    run_id: uuid.UUID
    stage: int
    name: str
    label: str
    max_attempts: int


class SucceededAndQueued(NamedTuple):
    """`succeed_and_publish_next` landed: the step succeeded; `next_id` is the next step, to
    publish (None: it existed already, and its message is someone else's to send)."""

    id: int
    next_id: int | None


def succeed_and_publish_next(
    conn: db.Autocommit, *, step_id: int, token: uuid.UUID, stage: int, result: str, next_step: NextMessage
) -> SucceededAndQueued | None:
    """The one-statement commit of a step whose next stage is one step that travels as a
    message; None: refused, or the run is not where a plain advance expects it (nothing
    written)."""
    params = {
        "id": step_id,
        "tok": token,
        "stage": stage,
        "result": result,
        "run": next_step.run_id,
        "next_stage": next_step.stage,
        "next_name": next_step.name,
        "next_label": next_step.label,
        "next_max": next_step.max_attempts,
    }
    row = conn.first(SUCCEED_AND_PUBLISH_NEXT, params)
    return None if row is None else SucceededAndQueued(*row)


class BatchedSuccess(NamedTuple):
    """One step of `succeed_and_claim_next_batch`: its claim's token and stage, its result (JSON)
    and the next stage's single step to insert claimed under `next_step.token`."""

    step_id: int
    token: uuid.UUID
    stage: int
    result: str
    next_step: NextStep


def succeed_and_claim_next_batch(
    conn: db.Autocommit, items: list[BatchedSuccess], *, owner: str, ttl: float
) -> dict[int, SucceededAndClaimed]:
    """The one-statement commits of several steps at once; the steps that landed, by id (one
    left out was refused or its run was not where a plain advance expects: nothing written)."""
    params = {
        "ids": [i.step_id for i in items],
        "toks": [i.token for i in items],
        "stages": [i.stage for i in items],
        "results": [i.result for i in items],
        "next_names": [i.next_step.name for i in items],
        "next_labels": [i.next_step.label for i in items],
        "next_maxs": [i.next_step.max_attempts for i in items],
        "next_toks": [i.next_step.token for i in items],
        "owner": owner,
        "ttl": ttl,
    }
    return {row[0]: SucceededAndClaimed(*row) for row in conn.all(SUCCEED_AND_CLAIM_NEXT_BATCH, params)}


def succeed_and_finish(
    conn: db.Autocommit, *, step_id: int, token: uuid.UUID, stage: int, result: str, end_stage: int
) -> EndedRun | None:
    """The one-statement commit of a run's last step: the run succeeds with `result`; None:
    refused, or the run is not where a plain finish expects it (nothing written)."""
    params = {"id": step_id, "tok": token, "stage": stage, "result": result, "end_stage": end_stage}
    r = conn.first(SUCCEED_AND_FINISH, params)
    return (
        None if r is None else EndedRun(r.id, r.kind, r.version, r.trace, r.created_at, r.finished_at, None)
    )


class Failed(NamedTuple):
    """`FAIL_OR_RETRY`'s row: the step's new status (`failed`, or `pending` for its next
    attempt) and the attempts it has spent."""

    status: StepStatus
    spent: int


class Outage(NamedTuple):
    """`RETRY_OUTAGE`'s row: since when the step has been waiting out the outage, and the
    attempts it has spent (this one not among them)."""

    since: datetime
    spent: int


def fail_or_retry(
    s: Session,
    *,
    step_id: int,
    token: uuid.UUID,
    final: bool,
    budget: int,
    delay: float,
    err: Mapping[str, Any],
    idle_ms: int,
    outage: bool = False,
) -> Failed | None:
    """The attempt failed and counts: the step fails (`final`, or its spent attempts reached
    `budget`) or waits `delay` seconds for its next attempt; None: refused (nothing written).
    `outage`: the error was an outage past its window (it does not end the outage). The
    transaction may sit idle for at most `idle_ms` from here."""
    params = {
        "idle_ms": idle_ms,
        "final": final,
        "budget": budget,
        "delay": delay,
        "err": json.dumps(err),
        "id": step_id,
        "tok": token,
        "outage": outage,
    }
    row = s.execute(FAIL_OR_RETRY, params).first()
    return None if row is None else Failed(StepStatus(row.status), row.spent)


def retry_outage(
    s: Session,
    *,
    step_id: int,
    token: uuid.UUID,
    delay: float,
    window: float,
    err: Mapping[str, Any],
    idle_ms: int,
) -> Outage | None:
    """The attempt met an outage: the step waits `delay` seconds, the attempt not spent; None:
    refused, or the outage outlasted `window` seconds (then `fail_or_retry` decides). The
    transaction may sit idle for at most `idle_ms` from here."""
    params = {
        "delay": delay,
        "window": window,
        "err": json.dumps(err),
        "id": step_id,
        "tok": token,
        "idle_ms": idle_ms,
    }
    row = s.execute(RETRY_OUTAGE, params).first()
    return None if row is None else Outage(row.outage_since, row.spent)


def record_retry_error(s: Session, run_id: uuid.UUID, err: Mapping[str, Any]) -> bool:
    """Show the retried attempt's error on its live run; a run that ended keeps its own (a
    sibling's retry after a fan-out failed its run must not hide the dead letter's error,
    `tests/integration/test_engine_basics.py::test_a_retry_error_leaves_an_ended_runs_error`)."""
    return changed(s.execute(RECORD_RETRY_ERROR, {"err": json.dumps(err), "run": run_id})) > 0


def cancel_step(s: Session, *, step_id: int, token: uuid.UUID, idle_ms: int) -> bool:
    """The body stopped on a cancel request: the step is canceled (the transaction idle for at
    most `idle_ms` from here); False: refused."""
    return s.execute(CANCEL_STEP, {"id": step_id, "tok": token, "idle_ms": idle_ms}).first() is not None


def close_attempt(
    s: Session, *, step_id: int, token: uuid.UUID, attempt: int, outcome: str, err: Mapping[str, Any] | None
) -> None:
    """Log attempt `attempt` (under `token`) of the step as ended with `outcome` (and error)."""
    params = {
        "outcome": outcome,
        "error": json.dumps(err) if err else None,
        "id": step_id,
        "tok": token,
        "attempt": attempt,
    }
    s.execute(CLOSE_ATTEMPT, params)


def fail_run(s: Session, run_id: uuid.UUID, err: Mapping[str, Any]) -> EndedRun | None:
    """The run becomes a dead letter with `err`; None: it had finished already."""
    r = s.execute(FAIL_RUN, {"err": json.dumps(err), "run": run_id}).first()
    return None if r is None else EndedRun(*r[:7])
