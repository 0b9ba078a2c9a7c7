"""Reading runs: the port's view of one, and runs by what business code knows of them (their
kind and idempotency key).

Business code (acquisition, admin, CLI) names its runs by key (`acquire:<request id>`), never
by reading `engine.task_run` itself; this is that read, in the caller's transaction when it has
one. `(kind, idempotency_key)` is unique for all time (invariant 5), so a pair names one run.

| function | reads |
|---|---|
| `view` (`VIEW`) | one run, with what its current stage's steps say, and the database's clock |
| `find_by_keys` (`FIND_BY_KEYS`) | the runs named by `(kind, idempotency_key)` pairs |
| `live_ahead` (`LIVE_AHEAD`) | the oldest live run of a run's kind and concurrency key enqueued before it |
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.status import RunStatus

# The port's `get`: the run, with what its current stage's steps say (attempts spent, the topic
# and timer it waits on, why it is not moving: an outage it waits out, migration 0014).
VIEW = text(
    """
    SELECT r.*, st.attempts AS step_attempts, st.wait_topic, st.wait_until,
           st.pending_since, st.due_at, st.blocked_reason, st.outage_since, now() AS db_now
      FROM engine.task_run r
      LEFT JOIN LATERAL (
           SELECT max(attempts - outages) AS attempts, max(wait_topic) AS wait_topic,
                  min(wait_until) AS wait_until,
                  min(created_at) FILTER (WHERE status = 'pending') AS pending_since,
                  min(next_attempt_at) FILTER (WHERE status = 'pending') AS due_at,
                  max(blocked_reason) FILTER (WHERE status = 'pending') AS blocked_reason,
                  min(outage_since) FILTER (WHERE status = 'pending') AS outage_since
             FROM engine.step
            WHERE run_id = r.id AND stage = r.current_stage) st ON true
     WHERE r.id = :id
    """
)


class RunViewRow(NamedTuple):
    """`VIEW`'s row: the run, and its current stage's attempts, wait and pending reason."""

    id: uuid.UUID
    kind: str
    version: int
    status: RunStatus
    current_step: str | None
    step_attempts: int | None
    last_error: dict[str, Any] | None
    result: Any
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    wait_topic: str | None
    wait_until: datetime | None
    parent_run_id: uuid.UUID | None
    deadline_at: datetime | None
    pending_since: datetime | None
    due_at: datetime | None
    blocked_reason: str | None
    outage_since: datetime | None
    db_now: datetime


def view(s: Session, run_id: uuid.UUID) -> RunViewRow | None:
    """The port's view of one run (None: no such run)."""
    r = s.execute(VIEW, {"id": run_id}).first()
    if r is None:
        return None
    return RunViewRow(
        id=r.id,
        kind=r.kind,
        version=r.version,
        status=RunStatus(r.status),
        current_step=r.current_step,
        step_attempts=r.step_attempts,
        last_error=r.last_error,
        result=r.result,
        created_at=r.created_at,
        updated_at=r.updated_at,
        started_at=r.started_at,
        finished_at=r.finished_at,
        cancel_requested_at=r.cancel_requested_at,
        wait_topic=r.wait_topic,
        wait_until=r.wait_until,
        parent_run_id=r.parent_run_id,
        deadline_at=r.deadline_at,
        pending_since=r.pending_since,
        due_at=r.due_at,
        blocked_reason=r.blocked_reason,
        outage_since=r.outage_since,
        db_now=r.db_now,
    )


class RunByKey(NamedTuple):
    id: uuid.UUID
    kind: str
    idempotency_key: str
    version: int
    status: RunStatus
    created_at: datetime


FIND_BY_KEYS = text(
    """
    SELECT r.id, r.kind, r.idempotency_key, r.version, r.status, r.created_at
      FROM engine.task_run r
      JOIN unnest(CAST(:kinds AS text[]), CAST(:keys AS text[])) AS k(kind, key)
        ON r.kind = k.kind AND r.idempotency_key = k.key
     ORDER BY r.created_at, r.id
    """
)


def find_by_keys(s: Session, pairs: Sequence[tuple[str, str]]) -> list[RunByKey]:
    """The runs named by `(kind, idempotency_key)` pairs that exist, oldest first."""
    if not pairs:
        return []
    rows = s.execute(FIND_BY_KEYS, {"kinds": [k for k, _ in pairs], "keys": [key for _, key in pairs]})
    return [
        RunByKey(r.id, r.kind, r.idempotency_key, r.version, RunStatus(r.status), r.created_at) for r in rows
    ]


# Runs of one kind and concurrency key in the order they were enqueued (`created_at`, then `id`
# for runs enqueued in one transaction): the first still live before `:run`, if any. Statuses
# only move from live to terminal, so two runs never both see the other ahead.
LIVE_AHEAD = text(
    """
    SELECT o.id
      FROM engine.task_run me
      JOIN engine.task_run o
        ON o.kind = me.kind AND o.concurrency_key = me.concurrency_key
     WHERE me.id = :run
       AND o.status IN ('pending', 'running', 'waiting')
       AND (o.created_at, o.id) < (me.created_at, me.id)
     ORDER BY o.created_at, o.id
     LIMIT 1
    """
)


def live_ahead(s: Session, run_id: uuid.UUID) -> uuid.UUID | None:
    """The oldest live run of `run_id`'s kind and concurrency key enqueued before it (None: it
    is first in line, or has no concurrency key)."""
    found: uuid.UUID | None = s.scalar(LIVE_AHEAD, {"run": run_id})
    return found
