"""Waiting (invariant 7): stored signals, parking a step, and waking it by topic or timer.

A signal is stored before anyone is woken, under the topic's advisory lock (`LOCK_TOPIC`), and a
park checks, under the same lock, for a signal stored since its check began (`SIGNAL_SINCE`):
a signal racing a park is never lost. Each wake is one statement: the parked steps go back to
`pending` (marked published: the caller sends their messages after commit), in one round trip.
Only steps still `waiting` move (the guard in the WHERE clause). A run shows `running` again
when a worker claims its woken step: every claim moves a `waiting` run to `running`
(`store.claims`), so the wake itself writes no run row. Proofs:
`tests/integration/test_waits_cancel.py`, `tests/integration/test_wake_batches.py`.

Each function runs the statement named like it in capitals (`park`: `PARK`).

| function | from | to |
|---|---|---|
| `lock_topic` | | the topic's advisory lock, held to the commit |
| `store_signal` | | a signal row (kept until purged) |
| `latest_signal`, `any_signal` | | the newest signal, whether any is stored |
| `signal_since`, `reached` | | a signal stored since a time, a timer due |
| `park` | step running (fenced by its token) | waiting (topic, timer), or pending if a signal raced it |
| `run_waiting` (`LOCK_RUN`, `RUN_WAITING`) | run running, no step running or pending | waiting |
| `run_waiting_locked` (`RUN_WAITING`) | the same, the run row locked by the caller | waiting |
| `wake_topic` | steps waiting on the topic | pending, published (runs: at their claim) |
| `wake_due_timers` | steps waiting past `wait_until` | pending, published (runs: at their claim) |
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.store.rows import changed

# The topic's lock is held to the commit: a holder frozen inside its transaction (SIGSTOP, a paused
# VM) would stop every signal and park of the topic for as long as it stayed frozen, and a park
# goes on to lock its step row, which the sweeper then skips. So the lock bounds its transaction's
# idle time, as `leases.FENCE` does
# (`tests/integration/test_idle_bounds.py::test_engine_locks_bound_their_transaction`).
LOCK_TOPIC = text(
    "SELECT pg_advisory_xact_lock(hashtext(:topic)),"
    " set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)"
)

STORE_SIGNAL = text(
    "INSERT INTO engine.task_signal (topic, payload) VALUES (:topic, CAST(:payload AS jsonb))"
)

LATEST_SIGNAL = text("SELECT payload FROM engine.task_signal WHERE topic = :topic ORDER BY id DESC LIMIT 1")

# Under the topic lock: every signal committed before the park, whenever its transaction began
# (`created_at` is that start, so `SIGNAL_SINCE` misses one that began before the claim).
ANY_SIGNAL = text("SELECT EXISTS (SELECT 1 FROM engine.task_signal WHERE topic = :topic)")

SIGNAL_SINCE = text(
    "SELECT EXISTS (SELECT 1 FROM engine.task_signal WHERE topic = :topic AND created_at >= :since)"
)

# A timer in the database's clock (never the worker's: `tests/faults/test_clock.py`).
REACHED = text("SELECT now() >= :until")

# Waiting gives the attempt back: it does not count against the retry policy.
PARK = text(
    """
    UPDATE engine.step
       SET status = CASE WHEN :raced THEN 'pending' ELSE 'waiting' END,
           attempts = attempts - 1, wakeups = wakeups + 1,
           wait_topic = :topic, wait_since = :since,
           wait_until = coalesce(:until, now() + make_interval(secs => :timeout)),
           next_attempt_at = now(), lease_token = NULL, lease_until = NULL,
           published_at = CASE WHEN :raced THEN now() END
     WHERE id = :id AND lease_token = :tok AND status = 'running'
    RETURNING id
    """
)

# The run row is locked first, in a statement of its own: sibling steps parking at once (a
# fan-out) each saw the other still `running` in their one statement's snapshot, and neither
# marked the run. Locked first, the second park waits for the first's commit, and its
# `RUN_WAITING`, a later statement, reads it (`tests/integration/test_children.py::
# test_sibling_steps_parking_at_once_leave_the_run_waiting`).
LOCK_RUN = text("SELECT 1 FROM engine.task_run WHERE id = :run FOR NO KEY UPDATE")

RUN_WAITING = text(
    """
    UPDATE engine.task_run SET status = 'waiting', updated_at = now()
     WHERE id = :run AND status = 'running'
       AND NOT EXISTS (SELECT 1 FROM engine.step WHERE run_id = :run AND status IN ('running', 'pending'))
    """
)


class Woken(NamedTuple):
    """A step sent back to work, with what its message needs."""

    id: int
    run_id: uuid.UUID
    name: str
    kind: str
    version: int
    priority: int


# A signal's first wake records when it woke the step (`signalled_at`): the start of
# `proj_signal_wake_seconds`, whose end is the step's next claim (`store.stats`). Later wakes
# keep it: a wait whose check does not hold yet parks again, and overwriting it took the step
# out of the histogram until its next claim (its count went down, a counter reset to
# Prometheus) and lost the first observation
# (`tests/integration/test_observability_review.py::test_a_second_signal_…`).
# The wake writes the steps only. It used to move their runs to `running` in a second CTE
# joined to the woken steps; whenever the statistics were taken while few runs waited (a mass
# wake minutes after its runs parked, before autovacuum analyzes again) the planner estimated
# that CTE at one row and rescanned it once per waiting run: 0.32 s of a 1,000-run wake
# (`tests/integration/test_wake_batches.py::test_a_mass_wake_finds_its_runs_by_primary_key`). The claim
# moves each run to `running` anyway, one primary-key row at a time.
WAKE_TOPIC = text(
    """
    UPDATE engine.step s
       SET status = 'pending', next_attempt_at = now(), published_at = now(),
           signalled_at = coalesce(s.signalled_at, now())
      FROM engine.task_run r
     WHERE r.id = s.run_id AND s.status = 'waiting' AND s.wait_topic = :topic
    RETURNING s.id, s.run_id, s.name, r.kind, r.version, r.priority
    """
)

WAKE_DUE_TIMERS = text(
    """
    UPDATE engine.step s
       SET status = 'pending', next_attempt_at = now(), published_at = now()
      FROM engine.task_run r
     WHERE r.id = s.run_id AND s.status = 'waiting'
       AND s.id IN (SELECT id FROM engine.step
                     WHERE status = 'waiting' AND wait_until <= now() LIMIT :limit)
    RETURNING s.id, s.run_id, s.name, r.kind, r.version, r.priority
    """
)


def wake_topic(s: Session, topic: str) -> list[Woken]:
    """Wake every step parked on `topic`; returns the ones that moved (none: nobody waited)."""
    return [Woken(*row) for row in s.execute(WAKE_TOPIC, {"topic": topic}).all()]


def wake_due_timers(s: Session, limit: int) -> list[Woken]:
    """Wake up to `limit` steps whose `wait_until` has passed (the sweeper's timer pass)."""
    return [Woken(*row) for row in s.execute(WAKE_DUE_TIMERS, {"limit": limit}).all()]


class Signal(NamedTuple):
    payload: Any  # the stored JSON (None for a signal sent without one)


def lock_topic(s: Session, topic: str, *, idle_ms: int) -> None:
    """Serialise signals and parks of `topic` to the commit (no signal lost to a racing park), in
    a transaction that may sit idle for at most `idle_ms`."""
    s.execute(LOCK_TOPIC, {"topic": topic, "idle_ms": idle_ms})


def store_signal(s: Session, topic: str, payload: str) -> None:
    """Store a signal of `topic` with `payload` (JSON), before anyone is woken."""
    s.execute(STORE_SIGNAL, {"topic": topic, "payload": payload})


def latest_signal(s: Session, topic: str) -> Signal | None:
    """The newest signal of `topic` (None: none was ever stored, or it was purged)."""
    row = s.execute(LATEST_SIGNAL, {"topic": topic}).first()
    return None if row is None else Signal(row.payload)


def any_signal(s: Session, topic: str) -> bool:
    """Whether any signal of `topic` is stored (under the topic's lock: a bare wait's park)."""
    return bool(s.scalar(ANY_SIGNAL, {"topic": topic}))


def signal_since(s: Session, topic: str, since: datetime) -> bool:
    """Whether a signal of `topic` was stored at or after `since` (under the topic's lock)."""
    return bool(s.scalar(SIGNAL_SINCE, {"topic": topic, "since": since}))


def reached(s: Session, until: datetime) -> bool:
    """Whether the database's clock has reached `until`."""
    return bool(s.scalar(REACHED, {"until": until}))


def park(
    s: Session,
    *,
    step_id: int,
    token: uuid.UUID,
    topic: str,
    since: datetime,
    until: datetime | None,
    timeout_s: float,
    raced: bool,
) -> bool:
    """Park the step on `topic` until a signal or its timer (`until`, else now + `timeout_s`),
    or send it straight back to work when a signal `raced` the park; False: refused."""
    params = {
        "raced": raced,
        "topic": topic,
        "since": since,
        "until": until,
        "timeout": timeout_s,
        "id": step_id,
        "tok": token,
    }
    return s.execute(PARK, params).first() is not None


def run_waiting(s: Session, run_id: uuid.UUID) -> bool:
    """The run shows `waiting` if none of its steps runs or is pending; False: it does not.
    Locks the run row first (`LOCK_RUN`), so parks of sibling steps see each other."""
    s.execute(LOCK_RUN, {"run": run_id})
    return run_waiting_locked(s, run_id)


def run_waiting_locked(s: Session, run_id: uuid.UUID) -> bool:
    """`run_waiting` for a caller that holds the run row's lock already (`chain.advance`)."""
    return changed(s.execute(RUN_WAITING, {"run": run_id})) > 0
