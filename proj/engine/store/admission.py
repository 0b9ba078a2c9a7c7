"""Slots of limited kinds (`global_limit`, `concurrency_limit` per key), counted in Postgres
across all workers, and the line of steps waiting for one.

A claim of a limited kind takes the gate's advisory lock (`LOCK_GATE`, held to the commit, always
global before key, so claims never deadlock), counts the holders, and either claims or is refused
(`DENY`: the step stays `pending` with its reason). Slots are counted in runs: fan-out items of a
run that holds one share it. A run holds its slot while a step of it is `running`, also past
its lease, until the sweeper takes the lease back: a late heartbeat may still renew it. Waiters
are pending, due steps of live runs refused recently (`blocked_at` is renewed at each refusal);
`:prio`, `:created`, `:run` NULL means the whole line, set means only those ordered before that
run. Proof: `tests/integration/test_limits.py`.

Each function runs the statement named like it in capitals (`claim`: `CLAIM`) unless
the table names others.

| function | from | to |
|---|---|---|
| `slot_of` | | the run of a pending, due step of a live run (by primary key) |
| `lock_gate` | | the gate's advisory lock, held to the commit |
| `holders` (`HOLDERS_GLOBAL`, `HOLDERS_KEY`) | | runs with a step running, and whether this run is one |
| `waiters` (`WAITERS_GLOBAL`, `WAITERS_KEY`) | | the line, best first |
| `deny` | step pending | pending, with `blocked_reason`/`blocked_on`/`blocked_at`, re-published later |
| `nudge_waiters` | waiters pending, not locked | published now (their message goes out) |
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.store.rows import changed

SLOT_OF = text(
    """
    SELECT r.id AS run_id, r.kind, r.version, r.concurrency_key, r.priority, r.created_at
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE s.id = :id AND (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE  -- by pkey
       AND r.status IN ('pending', 'running', 'waiting') AND r.cancel_requested_at IS NULL
    """
)

# Held to the commit: a claimer frozen holding it (SIGSTOP, a paused VM) would stop every claim
# of the gate for as long as it stayed frozen, so it bounds its transaction's idle time, as
# `leases.FENCE` does (`tests/integration/test_idle_bounds.py`).
LOCK_GATE = text(
    "SELECT pg_advisory_xact_lock(hashtext(:lock)),"
    " set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)"
)

# A holder is a step `running` under its token, expired lease or not: until the sweeper takes
# the lease back (`recovery.EXPIRE_LEASES`, which then hands the slot on) a late heartbeat
# renews it and the holder goes on and commits. Counting only unexpired leases admitted a
# second run in that window, and both ran to the end (`tests/integration/test_limits.py::
# test_a_holder_whose_heartbeat_was_late_keeps_its_slot_until_the_sweeper_takes_it`).
HOLDERS_GLOBAL = text(
    """
    SELECT count(DISTINCT h.run_id) AS runs,
           coalesce(bool_or(h.run_id = CAST(:run AS uuid)), false) AS mine
      FROM engine.step h JOIN engine.task_run hr ON hr.id = h.run_id
     WHERE h.status = 'running' AND hr.kind = :kind
    """
)

HOLDERS_KEY = text(
    """
    SELECT count(DISTINCT h.run_id) AS runs,
           coalesce(bool_or(h.run_id = CAST(:run AS uuid)), false) AS mine
      FROM engine.step h JOIN engine.task_run hr ON hr.id = h.run_id
     WHERE h.status = 'running' AND hr.kind = :kind
       AND hr.concurrency_key = :key
    """
)

# For the global gate only steps refused by the global limit count: one refused by its own key
# could not use a global slot anyway. Nor can one whose key is full now (`:key_limit`, the kind's
# `concurrency_limit`), unless its own run holds that key's slot: it was refused by the global
# gate first, which is checked first, and a freed global slot handed to it was refused by its
# key and sat idle until the sweeper's re-send, while a run of another key waited behind it
# (`tests/integration/test_limits.py::
# test_a_freed_global_slot_is_not_left_idle_behind_a_waiter_whose_key_is_full`). The full keys
# are read from the kind's running steps, which its global limit keeps few.
WAITERS_GLOBAL = text(
    """
    WITH full_keys AS MATERIALIZED (
        SELECT hr.concurrency_key AS key
          FROM engine.step h JOIN engine.task_run hr ON hr.id = h.run_id
         WHERE h.status = 'running' AND hr.kind = :kind AND hr.concurrency_key IS NOT NULL
           AND CAST(:key_limit AS int) IS NOT NULL
         GROUP BY hr.concurrency_key
        HAVING count(DISTINCT h.run_id) >= CAST(:key_limit AS int)
    )
    SELECT w.id, w.name, wr.kind, wr.version, wr.priority
      FROM engine.step w JOIN engine.task_run wr ON wr.id = w.run_id
     WHERE w.status = 'pending' AND w.blocked_at IS NOT NULL AND w.next_attempt_at <= now()
       AND w.blocked_at > now() - make_interval(secs => :fresh)
       AND wr.kind = :kind AND w.blocked_on = 'global'
       AND wr.status IN ('pending', 'running', 'waiting') AND wr.cancel_requested_at IS NULL
       AND (wr.concurrency_key IS NULL
            OR wr.concurrency_key NOT IN (SELECT key FROM full_keys)
            OR EXISTS (SELECT 1 FROM engine.step o WHERE o.run_id = wr.id AND o.status = 'running'))
       AND (CAST(:prio AS int) IS NULL
            OR (-wr.priority, wr.created_at, wr.id)
               < (-CAST(:prio AS int), CAST(:created AS timestamptz), CAST(:run AS uuid)))
     ORDER BY wr.priority DESC, wr.created_at, wr.id, w.id
     LIMIT :n
    """
)

WAITERS_KEY = text(
    """
    SELECT w.id, w.name, wr.kind, wr.version, wr.priority
      FROM engine.step w JOIN engine.task_run wr ON wr.id = w.run_id
     WHERE w.status = 'pending' AND w.blocked_at IS NOT NULL AND w.next_attempt_at <= now()
       AND w.blocked_at > now() - make_interval(secs => :fresh)
       AND wr.kind = :kind AND wr.concurrency_key = :key
       AND wr.status IN ('pending', 'running', 'waiting') AND wr.cancel_requested_at IS NULL
       AND (CAST(:prio AS int) IS NULL
            OR (-wr.priority, wr.created_at, wr.id)
               < (-CAST(:prio AS int), CAST(:created AS timestamptz), CAST(:run AS uuid)))
     ORDER BY wr.priority DESC, wr.created_at, wr.id, w.id
     LIMIT :n
    """
)

DENY = text(
    """
    UPDATE engine.step
       SET blocked_reason = :reason, blocked_on = :scope, blocked_at = now(), published_at = now()
     WHERE id = :id AND (status = 'pending') IS TRUE
    """
)

# A locked row is being claimed already: skip it, never wait.
NUDGE_WAITERS = text(
    """
    UPDATE engine.step SET published_at = now()
     WHERE id IN (SELECT id FROM engine.step
                   WHERE id = ANY(:ids) AND (status = 'pending') IS TRUE FOR UPDATE SKIP LOCKED)
    RETURNING id
    """
)


class Slot(NamedTuple):
    """The run a limited claim counts for, and its place in line."""

    run_id: uuid.UUID
    kind: str
    version: int
    concurrency_key: str | None
    priority: int
    created_at: datetime


class Holders(NamedTuple):
    runs: int  # runs with a step running (its lease not taken back)
    mine: bool  # the asking run is one of them


class Waiter(NamedTuple):
    """A step in line for a slot, with what its message needs."""

    id: int
    name: str
    kind: str
    version: int
    priority: int


def slot_of(s: Session, step_id: int) -> Slot | None:
    """The run of step `step_id` if the step is pending and due and its run live; else None."""
    row = s.execute(SLOT_OF, {"id": step_id}).first()
    return None if row is None else Slot(*row)


def lock_gate(s: Session, lock: str, *, idle_ms: int) -> None:
    """Serialise the claims of one gate (kind, or kind and key) to the commit, in a transaction
    that may sit idle for at most `idle_ms`."""
    s.execute(LOCK_GATE, {"lock": lock, "idle_ms": idle_ms})


def holders(s: Session, *, kind: str, key: str | None, run_id: uuid.UUID | None) -> Holders:
    """Runs of `kind` (and of its concurrency `key`, when given) holding a slot now."""
    stmt = HOLDERS_GLOBAL if key is None else HOLDERS_KEY
    row = s.execute(stmt, {"kind": kind, "key": key, "run": run_id}).one()
    return Holders(int(row.runs), bool(row.mine))


def waiters(
    s: Session,
    *,
    kind: str,
    key: str | None,
    n: int,
    fresh: float,
    before: Slot | None,
    key_limit: int | None = None,
) -> list[Waiter]:
    """Up to `n` steps in line for `kind`'s global gate (`key` None) or its `key` gate, best
    first; with `before`, only those ordered before that run. In the global line, `key_limit`
    (the kind's limit per key) leaves out a waiter whose key is full."""
    params: dict[str, Any] = {
        "kind": kind,
        "key": key,
        "key_limit": key_limit,
        "n": n,
        "fresh": fresh,
        "prio": None if before is None else before.priority,
        "created": None if before is None else before.created_at,
        "run": None if before is None else before.run_id,
    }
    return [Waiter(*r) for r in s.execute(WAITERS_GLOBAL if key is None else WAITERS_KEY, params)]


def deny(s: Session, *, step_id: int, reason: str, scope: str) -> bool:
    """Leave the step pending with its reason and scope; False: it is no longer pending."""
    return changed(s.execute(DENY, {"reason": reason, "scope": scope, "id": step_id})) > 0


def nudge_waiters(s: Session, ids: Sequence[int]) -> set[int]:
    """Mark these waiters published now; returns those that were (a locked one is skipped)."""
    return set(s.scalars(NUDGE_WAITERS, {"ids": list(ids)}).all())
