"""Waking parked steps (invariant 7): by a signal's topic, or by their timer.

Each wake is one statement, written out whole: the parked steps go back to `pending` (marked
published: the caller sends their messages after commit) and their runs show `running` again,
in one round trip. Only steps still `waiting` move (the guard in the WHERE clause), so two
wakes of one step, by a signal and its timer at once, wake it once. Proofs:
`tests/integration/test_waits_cancel.py`, `tests/integration/test_wake_batches.py`.
"""

from __future__ import annotations

import uuid
from typing import NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session


class Woken(NamedTuple):
    """A step sent back to work, with what its message needs."""

    id: int
    run_id: uuid.UUID
    name: str
    kind: str
    version: int
    priority: int


# A signal's wake records when it woke the step (`signalled_at`): the start of
# `proj_signal_wake_seconds`, whose end is the step's next claim (`store.stats`).
WAKE_TOPIC = text(
    """
    WITH woken AS (
        UPDATE engine.step s
           SET status = 'pending', next_attempt_at = now(), published_at = now(),
               signalled_at = now()
          FROM engine.task_run r
         WHERE r.id = s.run_id AND s.status = 'waiting' AND s.wait_topic = :topic
     RETURNING s.id, s.run_id, s.name, r.kind, r.version, r.priority
    ), running AS (
        UPDATE engine.task_run SET status = 'running', updated_at = now()
         WHERE id IN (SELECT run_id FROM woken) AND status = 'waiting'
    )
    SELECT id, run_id, name, kind, version, priority FROM woken
    """
)

WAKE_DUE_TIMERS = text(
    """
    WITH woken AS (
        UPDATE engine.step s
           SET status = 'pending', next_attempt_at = now(), published_at = now()
          FROM engine.task_run r
         WHERE r.id = s.run_id AND s.status = 'waiting'
           AND s.id IN (SELECT id FROM engine.step
                         WHERE status = 'waiting' AND wait_until <= now() LIMIT :limit)
     RETURNING s.id, s.run_id, s.name, r.kind, r.version, r.priority
    ), running AS (
        UPDATE engine.task_run SET status = 'running', updated_at = now()
         WHERE id IN (SELECT run_id FROM woken) AND status = 'waiting'
    )
    SELECT id, run_id, name, kind, version, priority FROM woken
    """
)


def wake_topic(s: Session, topic: str) -> list[Woken]:
    """Wake every step parked on `topic`; returns the ones that moved (none: nobody waited)."""
    return [Woken(*row) for row in s.execute(WAKE_TOPIC, {"topic": topic}).all()]


def wake_due_timers(s: Session, limit: int) -> list[Woken]:
    """Wake up to `limit` steps whose `wait_until` has passed (the sweeper's timer pass)."""
    return [Woken(*row) for row in s.execute(WAKE_DUE_TIMERS, {"limit": limit}).all()]
