"""Child runs, run deadlines and waiting for a run's result.

A child step enqueues its child (`stages.insert_run` with `parent_run_id`) and, in the same
transaction, parks on the topic `run-finished:<child id>` (`waits.park`) unless the child has
finished already (`child_state`, read under the topic's advisory lock). A run with a parent that
finishes (succeeded, failed, canceled) stores that signal and wakes the parked step in its own
finishing transaction (`waits.lock_topic`, `waits.store_signal`, `waits.wake_topic`).

`TaskEngine.result()` LISTENs on `engine_run_finished`, then marks the run awaited
(`mark_awaited`); every statement that finishes a run issues `pg_notify('engine_run_finished',
<run id>)`, delivered at commit, when the run is marked so. Why only then: a notification
serialises the committing transactions on Postgres' notify queue, and on every run it cost
about 3 % of a step (`bench/README.md`). No notification is missed: the mark and the finishing
statement update the same row, so either the finish sees the mark (and notifies), or the
waiter's read after its mark sees the run finished (`tests/integration/test_children.py`).

Each function runs the statement named like it in capitals (`claim`: `CLAIM`) unless
the table names others.

| function | from | to |
|---|---|---|
| `child_state` | | the child's status, result and error (under the topic lock) |
| `live_children` | | a run's unfinished children not asked to cancel yet, locked (the cascade) |
| `orphaned_children` | | live children of a failed or canceled parent that a cascade skipped |
| `past_deadline` | live runs past `deadline_at`, no live lease | locked for `expire_run` |
| `expire_run` | run live | failed with `DeadlineExceeded` |
| `listen`, `run_outcome` (psycopg) | | a run's status and outcome, for `result()` on its LISTEN session |
| `mark_awaited` (psycopg) | run not awaited | awaited: the statement that finishes it notifies |
| `family` (`PARENT_OF`, `DESCENDANTS`) | | a run's family tree (/admin run page, `proj show`) |

The cascade locks children after their parent, while a finishing child locks itself and then
wakes its parent: so the cascade skips a child locked right now (`SKIP LOCKED`, no deadlock),
and the sweeper cancels it on its next tick (`orphaned_children`) if it did not finish.

Proofs: `tests/integration/test_children.py`, `tests/faults/test_children_faults.py`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

import psycopg
from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.status import RunStatus
from proj.engine.store.rows import Known

RUN_FINISHED_CHANNEL = "engine_run_finished"


def finished_topic(run_id: object) -> str:
    """The stored signal a finishing child run leaves for its parent's parked step."""
    return f"run-finished:{run_id}"


CHILD_STATE = text(
    """
    SELECT id, kind, status, result, last_error, cancel_reason, canceled_by_parent
      FROM engine.task_run WHERE id = :id
    """
)

LIVE_CHILDREN = text(
    """
    SELECT id FROM engine.task_run
     WHERE parent_run_id = :id AND status IN ('pending', 'running', 'waiting')
       AND cancel_requested_at IS NULL
     ORDER BY created_at, id
       FOR UPDATE SKIP LOCKED
    """
)

# The sweeper's backstop for `LIVE_CHILDREN`'s SKIP LOCKED: a child still live, not asked to
# cancel, whose parent ended failed or canceled (through `task_run_live_child_idx`). Not a child
# whose own step in its parent is `failed`: the parent is a dead letter through that child, and
# the child lives again because an operator retried it (README: retry the child, then the
# parent, whose step finds it); the cascade never skipped it, since it had ended when the parent
# failed (`tests/integration/test_ops_review.py::
# test_a_failed_child_retried_under_a_dead_letter_parent_is_not_canceled_by_the_sweeper`).
ORPHANED_CHILDREN = text(
    """
    SELECT c.id FROM engine.task_run c JOIN engine.task_run p ON p.id = c.parent_run_id
     WHERE c.parent_run_id IS NOT NULL AND c.status IN ('pending', 'running', 'waiting')
       AND c.cancel_requested_at IS NULL AND p.status IN ('failed', 'canceled')
       AND NOT (p.status = 'failed' AND EXISTS (
               SELECT 1 FROM engine.step ps
                WHERE ps.run_id = p.id AND ps.status = 'failed'
                  AND (c.idempotency_key
                       = 'child:' || p.id::text || ':' || ps.name || ':' || ps.item_index::text
                       OR starts_with(c.idempotency_key,
                          'child:' || p.id::text || ':' || ps.name || ':' || ps.item_index::text
                          || ':after:'))))
       AND (c.kind, c.version) IN (SELECT * FROM unnest(CAST(:known_kinds AS text[]),
                                                        CAST(:known_versions AS int[])))
     LIMIT :n
       FOR UPDATE OF c SKIP LOCKED
    """
)

PAST_DEADLINE = text(
    """
    SELECT r.id FROM engine.task_run r
     WHERE r.deadline_at <= now() AND r.deadline_at IS NOT NULL
       AND r.status IN ('pending', 'running', 'waiting')
       AND NOT EXISTS (SELECT 1 FROM engine.step s
                        WHERE s.run_id = r.id AND s.status = 'running' AND s.lease_until > now())
       AND (r.kind, r.version) IN (SELECT * FROM unnest(CAST(:known_kinds AS text[]),
                                                        CAST(:known_versions AS int[])))
     ORDER BY r.deadline_at LIMIT :n
       FOR UPDATE OF r SKIP LOCKED
    """
)

# Guard: only a live run expires. Its open steps are canceled by `cancels.cancel_open_steps`.
EXPIRE_RUN = text(
    """
    UPDATE engine.task_run SET status = 'failed', last_error = CAST(:err AS jsonb),
           finished_at = now(), updated_at = now()
     WHERE id = :run AND status IN ('pending', 'running', 'waiting')
    RETURNING id, kind, version, input, trace, created_at, finished_at, parent_run_id,
              CASE WHEN result_awaited THEN pg_notify('engine_run_finished', id::text)::text END AS notified
    """
)

# psycopg SQL, run on `result()`'s own LISTEN connection.
LISTEN = "LISTEN engine_run_finished"
MARK_AWAITED = """
    UPDATE engine.task_run SET result_awaited = true WHERE id = %(id)s AND NOT result_awaited
"""
RUN_OUTCOME = """
    SELECT status, result, last_error, cancel_reason FROM engine.task_run WHERE id = %(id)s
"""

# The admin run page and `proj show`: the run's parent, and its descendants (depth-first order is
# built by `family`), a few levels deep.
PARENT_OF = text(
    """
    SELECT p.id, p.kind, p.version, p.status
      FROM engine.task_run r JOIN engine.task_run p ON p.id = r.parent_run_id
     WHERE r.id = :id
    """
)

DESCENDANTS = text(
    """
    WITH RECURSIVE tree AS (
        SELECT id, parent_run_id, kind, version, status, idempotency_key, created_at, 1 AS depth
          FROM engine.task_run WHERE parent_run_id = :id
        UNION ALL
        SELECT r.id, r.parent_run_id, r.kind, r.version, r.status, r.idempotency_key, r.created_at,
               t.depth + 1
          FROM engine.task_run r JOIN tree t ON r.parent_run_id = t.id
         WHERE t.depth < :max_depth
    )
    SELECT id, parent_run_id, kind, version, status, idempotency_key, depth FROM tree
     ORDER BY depth, created_at, id
    """
)


class ChildState(NamedTuple):
    id: uuid.UUID
    kind: str
    status: RunStatus
    result: Any
    last_error: dict[str, Any] | None
    cancel_reason: str | None
    canceled_by_parent: bool  # stopped by its parent's end, not by an operator


class ExpiredRun(NamedTuple):
    """A run that passed its deadline and ended `failed`: what its span and its compensation need."""

    id: uuid.UUID
    kind: str
    version: int
    input: dict[str, Any]
    trace: dict[str, Any] | None
    created_at: datetime
    finished_at: datetime
    parent_run_id: uuid.UUID | None


class RunOutcome(NamedTuple):
    status: RunStatus
    result: Any
    last_error: dict[str, Any] | None
    cancel_reason: str | None


def child_state(s: Session, run_id: uuid.UUID) -> ChildState:
    """The child's status and outcome (it exists: the caller just enqueued or found it)."""
    r = s.execute(CHILD_STATE, {"id": run_id}).one()
    return ChildState(
        r.id, r.kind, RunStatus(r.status), r.result, r.last_error, r.cancel_reason, r.canceled_by_parent
    )


def live_children(s: Session, run_id: uuid.UUID) -> list[uuid.UUID]:
    """The run's unfinished children not asked to cancel yet, locked (one locked now is skipped)."""
    return list(s.scalars(LIVE_CHILDREN, {"id": run_id}).all())


def orphaned_children(s: Session, n: int, known: Known) -> list[uuid.UUID]:
    """Up to `n` live children of a `known` version whose failed or canceled parent's cascade
    skipped them, locked."""
    return list(s.scalars(ORPHANED_CHILDREN, {"n": n, **known.params()}).all())


def past_deadline(s: Session, n: int, known: Known) -> list[uuid.UUID]:
    """Up to `n` live runs of a `known` version past their deadline with no step under a live
    lease, locked."""
    return list(s.scalars(PAST_DEADLINE, {"n": n, **known.params()}).all())


def expire_run(s: Session, run_id: uuid.UUID, err: Mapping[str, Any]) -> ExpiredRun | None:
    """End a live run `failed` with `err`; None: it had ended already (nothing written)."""
    r = s.execute(EXPIRE_RUN, {"err": json.dumps(err), "run": run_id}).first()
    if r is None:
        return None
    return ExpiredRun(r.id, r.kind, r.version, r.input, r.trace, r.created_at, r.finished_at, r.parent_run_id)


def listen(conn: psycopg.Connection[Any]) -> None:
    """On `result()`'s own autocommit connection: be told of every run that finishes."""
    conn.execute(LISTEN)


def mark_awaited(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> None:
    """After `listen`: the run's finishing statement is to notify (before the outcome is read)."""
    conn.execute(MARK_AWAITED, {"id": run_id})


def run_outcome(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> RunOutcome | None:
    """A run's status and outcome, on `result()`'s LISTEN connection (None: no such run)."""
    row = conn.execute(RUN_OUTCOME, {"id": run_id}).fetchone()
    return None if row is None else RunOutcome(RunStatus(row[0]), row[1], row[2], row[3])


class RunNode(NamedTuple):
    """One run of a family tree: its depth below the run shown (0: the parent above it)."""

    id: uuid.UUID
    kind: str
    version: int
    status: RunStatus
    depth: int
    step: str | None  # the parent's child step that started it (and its item index)


class Family(NamedTuple):
    parent: RunNode | None
    children: list[RunNode]


def family(s: Session, run_id: uuid.UUID, max_depth: int = 4) -> Family:
    """A run's parent and its descendants, depth first (each child under the one that started it)."""
    p = s.execute(PARENT_OF, {"id": run_id}).first()
    parent = RunNode(p.id, p.kind, p.version, RunStatus(p.status), 0, None) if p is not None else None
    rows = s.execute(DESCENDANTS, {"id": run_id, "max_depth": max_depth}).all()
    by_parent: dict[uuid.UUID, list[Any]] = {}
    for r in rows:
        by_parent.setdefault(r.parent_run_id, []).append(r)
    out: list[RunNode] = []

    def walk(of: uuid.UUID) -> None:
        for r in by_parent.get(of, []):
            out.append(
                RunNode(r.id, r.kind, r.version, RunStatus(r.status), r.depth, _step_of(r.idempotency_key))
            )
            walk(r.id)

    walk(run_id)
    return Family(parent, out)


def _step_of(key: str) -> str | None:
    """`child:<parent>:<step>:<item>` → `step[item]` (`children.child_key`)."""
    parts = key.split(":")
    if len(parts) == 4 and parts[0] == "child":
        return f"{parts[2]}[{parts[3]}]"
    return None
