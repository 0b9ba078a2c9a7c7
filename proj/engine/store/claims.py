"""Claiming a step: the lease is taken, the attempt stamped on the step row (`claimed_at`: the
attempt that runs lives there, `engine.attempt` shows it) and the run marked started, in one
statement (lock order: the step row, then the run row).

Guard of every claim: the step is `pending` and due, its run is live, nobody asked to cancel
it and its deadline (if any) has not passed. No row back: a duplicate message, a finished
step, a canceled run: the delivery is a no-op (invariant 1). `(… ) IS TRUE` around the step's
state keeps the planner on the primary key: a plain `status = 'pending'` lets it pick the
partial `step_due_idx` and filter it by id, which statistics taken before a backlog built up
make look cheap, and which is O(backlog) per claim
(`tests/integration/test_limits.py::test_a_claim_reads_its_step_by_primary_key_under_a_backlog`).
The run's status is wrapped the same way, and the run row to start is named by a subquery (an
index condition on the primary key): with a plain `status IN (…)` the planner walked
`task_run_live_idx`, every live run, per claim whenever statistics said few runs waited — the
state of a mass wake, whose woken runs stay `waiting` until their claims
(`tests/integration/test_wake_batches.py::test_a_claim_among_many_waiting_runs_reaches_its_run_by_primary_key`).

Each function runs the statement named like it in capitals (`claim`: `CLAIM`) unless
the table names others.

| function | from | to |
|---|---|---|
| `claim` | step pending, due; run live | step running (token, lease, `claimed_at`); run running |
| `claim_start` | the same, for a start step | the best pending run's start step instead, if better |
| `release_start_siblings` | run's first-stage items > 0 held back | published now |
| `claim_batch` | the steps of a batched message, each as `claim` | each running under its own token |

**One durable commit per step.** Every claiming statement sets `synchronous_commit=off` for its
own transaction (`relaxed`): the claim is visible at once but does not wait for its WAL flush.
A step message then costs one flush, its commit's, instead of two (DESIGN §8;
`bench.throughput` prints WAL flushes per step). A crash can lose only what was not flushed:
- **What a crash can lose.** A crash of Postgres (of its processes or of its host) within
  about `wal_writer_delay` (200 ms) after the claim can lose it. That leaves what a crash just
  before the claim would have left: the step `pending`, with no lease and no attempt. The
  sweeper then re-sends it, as it re-sends a message the broker lost (`republish_after_s`).
- **The body under a lost claim is fenced.** Its fenced writes and its commit need the step
  `running` under its token, so they are refused.
- **Nothing durable can depend on a lost claim.** WAL is flushed in order, so any synchronous
  commit after the claim (a fenced business write, a ledger record, a heartbeat, the step's
  commit) makes the claim durable first.
- **Commits keep their flush.** The setting ends with the claim's transaction: the step's commit
  (invariant 1), on the same pooled connection next, waits for its flush.
- **Limited kinds.** Their whole admission transaction, whose last write is the claim, commits
  the same way. If lost, its slot is lost with the claim.

Proof: `tests/integration/test_claim_durability.py` (the setting's scope, and a lost claim
broken on purpose) and `tests/unit/test_durable_commits.py` (no other statement relaxes it).

A claim runs on the autocommit path (`db.autocommit()`: one round trip, no BEGIN/COMMIT) when it
is the transaction's only statement, or inside the admission transaction of a limited kind; the
functions take either and return `ClaimedRow` (None: nothing claimed).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import TextClause, text
from sqlalchemy.orm import Session

from proj import db
from proj.engine.store.rows import StepRef

CLAIM = text(
    """
    WITH claimed AS (
        UPDATE engine.step s
           SET status = 'running', lease_token = :tok, lease_owner = :owner,
               lease_until = now() + make_interval(secs => :ttl),
               attempts = s.attempts + 1, started_at = coalesce(s.started_at, now()), claimed_at = now(),
               blocked_reason = NULL, blocked_on = NULL, blocked_at = NULL
          FROM engine.task_run r
         WHERE s.id = :id AND r.id = s.run_id
           AND (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE
           AND (r.status IN ('pending', 'running', 'waiting')) IS TRUE AND r.cancel_requested_at IS NULL
           AND (r.deadline_at IS NULL OR r.deadline_at > now())
     RETURNING s.id, s.run_id, s.stage, s.name, s.item_index, s.item, s.attempts, s.max_attempts,
               r.kind, r.version, r.input, r.priority, r.concurrency_key, r.trace,
               r.parent_run_id, r.deadline_at, now() AS claimed_at, s.outages
    ), started AS (
        UPDATE engine.task_run t
           SET status = 'running', current_step = (SELECT name FROM claimed), updated_at = now(),
               started_at = coalesce(t.started_at, now())
         WHERE t.id = (SELECT run_id FROM claimed) AND (t.status IN ('pending', 'waiting')) IS TRUE
    ), relaxed AS (
        SELECT set_config('synchronous_commit', 'off', true)
    )
    SELECT claimed.* FROM claimed, relaxed
    """
)

# Starting a run in priority order (kinds with a `start_step`): the start messages of a kind (its
# first stage's item 0) are interchangeable, so a delivery claims the pending run that should
# start first instead of its own when that one has a strictly higher priority. A delivery whose
# own step is taken already (it was claimed by such a swap, or it is a duplicate) starts the best
# pending run in its place, so the swapped-out run loses no message. Equal priorities keep the
# broker's FIFO order and cost one probe of `task_run_start_idx` that finds nothing.
# `me` is materialized and read through scalar subqueries so that kind, version and the priority
# bound reach `task_run_start_idx` as index conditions even in the generic plan of a prepared
# statement (psycopg prepares after 5 runs); joined instead, they were a filter over every run of
# the kind, finished ones included (`tests/integration/test_limits.py::test_a_start_claim_probes_only_…`).
# `better` keeps the guard of `claimed`: a run asked to cancel or past its deadline can start no
# step, and chosen anyway it made the claim take nothing, so the delivery's own run waited for
# the sweeper's re-send (`REPUBLISH_AFTER_S`) though a worker held its message
# (`tests/integration/test_step_path_review.py::
# test_a_start_message_skips_a_better_run_past_its_deadline`).
CLAIM_START = text(
    """
    WITH me AS MATERIALIZED (
        SELECT r.kind, r.version,
               CASE WHEN s.status <> 'pending' THEN -2147483648  -- taken: any pending run
                    WHEN r.status = 'pending' THEN r.priority      -- mine: only a better one
                    ELSE 2147483647 END AS above                   -- a started run: none
          FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
         WHERE s.id = :id AND s.stage = 0 AND s.item_index = 0
    ), better AS (
        SELECT s2.id
          FROM engine.task_run r2
          JOIN engine.step s2 ON s2.run_id = r2.id AND s2.stage = 0 AND s2.item_index = 0
         WHERE r2.kind = (SELECT kind FROM me) AND r2.version = (SELECT version FROM me)
           AND r2.status = 'pending' AND r2.priority > (SELECT above FROM me)
           AND r2.cancel_requested_at IS NULL AND (r2.deadline_at IS NULL OR r2.deadline_at > now())
           AND (s2.status = 'pending' AND s2.next_attempt_at <= now()) IS TRUE
         ORDER BY r2.priority DESC, r2.created_at, r2.id
         LIMIT 1
           FOR UPDATE OF s2 SKIP LOCKED
    ), claimed AS (
        UPDATE engine.step s
           SET status = 'running', lease_token = :tok, lease_owner = :owner,
               lease_until = now() + make_interval(secs => :ttl),
               attempts = s.attempts + 1, started_at = coalesce(s.started_at, now()), claimed_at = now(),
               blocked_reason = NULL, blocked_on = NULL, blocked_at = NULL
          FROM engine.task_run r
         WHERE s.id = coalesce((SELECT id FROM better), :id) AND r.id = s.run_id
           AND (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE
           AND (r.status IN ('pending', 'running', 'waiting')) IS TRUE AND r.cancel_requested_at IS NULL
           AND (r.deadline_at IS NULL OR r.deadline_at > now())
     RETURNING s.id, s.run_id, s.stage, s.name, s.item_index, s.item, s.attempts, s.max_attempts,
               r.kind, r.version, r.input, r.priority, r.concurrency_key, r.trace,
               r.parent_run_id, r.deadline_at, now() AS claimed_at, s.outages
    ), started AS (
        UPDATE engine.task_run t
           SET status = 'running', current_step = (SELECT name FROM claimed), updated_at = now(),
               started_at = coalesce(t.started_at, now())
         WHERE t.id = (SELECT run_id FROM claimed) AND (t.status IN ('pending', 'waiting')) IS TRUE
    ), relaxed AS (
        SELECT set_config('synchronous_commit', 'off', true)
    )
    SELECT claimed.* FROM claimed, relaxed
    """
)

# The run just claimed by its start step: the rest of its first stage, held back at enqueue so
# that they could not start a run out of priority order (`Kind.holds_start_siblings`).
RELEASE_START_SIBLINGS = text(
    """
    UPDATE engine.step SET published_at = now()
     WHERE run_id = :run AND stage = 0 AND item_index > 0 AND (status = 'pending') IS TRUE
    RETURNING id, name
    """
)


# The steps of one batched message (a mass wake: `dispatch.batched`) claimed together, each under
# its own token, in one statement instead of one each. The guard is `CLAIM`'s, row by row; the
# step rows are locked in id order first (`want`), so two deliveries of overlapping batches (a
# duplicate message) wait for each other instead of deadlocking, and the later one finds the
# rows taken and claims nothing for them (`tests/integration/test_wake_batches.py`).
CLAIM_BATCH = text(
    """
    WITH want AS MATERIALIZED (
        SELECT s.id, w.tok
          FROM unnest(CAST(:ids AS bigint[]), CAST(:toks AS uuid[])) AS w(id, tok)
          JOIN engine.step s ON s.id = w.id
         WHERE (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE
         ORDER BY s.id
           FOR UPDATE OF s
    ), claimed AS (
        UPDATE engine.step s
           SET status = 'running', lease_token = w.tok, lease_owner = :owner,
               lease_until = now() + make_interval(secs => :ttl),
               attempts = s.attempts + 1, started_at = coalesce(s.started_at, now()), claimed_at = now(),
               blocked_reason = NULL, blocked_on = NULL, blocked_at = NULL
          FROM want w, engine.task_run r
         WHERE s.id = w.id AND r.id = s.run_id
           AND (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE
           AND (r.status IN ('pending', 'running', 'waiting')) IS TRUE AND r.cancel_requested_at IS NULL
           AND (r.deadline_at IS NULL OR r.deadline_at > now())
     RETURNING s.id, s.run_id, s.stage, s.name, s.item_index, s.item, s.attempts, s.max_attempts,
               r.kind, r.version, r.input, r.priority, r.concurrency_key, r.trace,
               r.parent_run_id, r.deadline_at, now() AS claimed_at, s.outages, s.lease_token
    ), started AS (
        UPDATE engine.task_run t
           SET status = 'running', current_step = c.name, updated_at = now(),
               started_at = coalesce(t.started_at, now())
          FROM claimed c
         WHERE t.id = ANY (ARRAY(SELECT run_id FROM claimed)) AND t.id = c.run_id
           AND (t.status IN ('pending', 'waiting')) IS TRUE
    ), relaxed AS (
        SELECT set_config('synchronous_commit', 'off', true)
    )
    SELECT claimed.* FROM claimed, relaxed ORDER BY claimed.id
    """
)


class ClaimedRow(NamedTuple):
    """The claimed step and what its run says, in `CLAIM`'s RETURNING order (built from the
    driver's row positionally: the hot path pays for one small tuple)."""

    id: int
    run_id: uuid.UUID
    stage: int
    name: str
    item_index: int
    item: Any
    attempts: int
    max_attempts: int
    kind: str
    version: int
    input: dict[str, Any]
    priority: int
    concurrency_key: str | None
    trace: dict[str, Any] | None
    parent_run_id: uuid.UUID | None
    deadline_at: datetime | None
    claimed_at: datetime
    outages: int


Executor = db.Autocommit | Session


def _claim(ex: Executor, stmt: TextClause, params: dict[str, Any]) -> ClaimedRow | None:
    row = ex.first(stmt, params) if isinstance(ex, db.Autocommit) else ex.execute(stmt, params).first()
    return None if row is None else ClaimedRow(*row)


def claim(ex: Executor, *, step_id: int, token: uuid.UUID, owner: str, ttl: float) -> ClaimedRow | None:
    """Take step `step_id` under `token` if it is pending and due and its run live; None: a
    duplicate or stale message, a canceled or late run (nothing written)."""
    return _claim(ex, CLAIM, {"id": step_id, "tok": token, "owner": owner, "ttl": ttl})


def claim_start(ex: Executor, *, step_id: int, token: uuid.UUID, owner: str, ttl: float) -> ClaimedRow | None:
    """`claim` for a start step: the best-ordered pending run of the kind starts, which may be
    another run's start step than `step_id`'s."""
    return _claim(ex, CLAIM_START, {"id": step_id, "tok": token, "owner": owner, "ttl": ttl})


def claim_batch(
    conn: db.Autocommit, *, step_ids: list[int], tokens: list[uuid.UUID], owner: str, ttl: float
) -> list[tuple[ClaimedRow, uuid.UUID]]:
    """Take those of `step_ids` that `claim` would take, the i-th under `tokens[i]`, in one
    statement: each claimed row with its token, in id order (none: all taken or stale)."""
    rows = conn.all(CLAIM_BATCH, {"ids": step_ids, "toks": tokens, "owner": owner, "ttl": ttl})
    return [(ClaimedRow(*row[:-1]), row[-1]) for row in rows]


def release_start_siblings(ex: Executor, run_id: uuid.UUID) -> list[StepRef]:
    """Mark the run's held-back first-stage siblings published; returns them (to send)."""
    params = {"run": run_id}
    rows = (
        ex.all(RELEASE_START_SIBLINGS, params)
        if isinstance(ex, db.Autocommit)
        else ex.execute(RELEASE_START_SIBLINGS, params).all()
    )
    return [StepRef(*r) for r in rows]
