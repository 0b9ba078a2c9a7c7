"""Runs and their stages: creating a run with its first stage, advancing to the next stage
under the run row lock (the fan-in is counted there), and finishing a run.

Each function runs the statement named like it in capitals (`insert_run`: `INSERT_RUN`).

| function | from | to |
|---|---|---|
| `insert_run` | no run of `(kind, key)` | run and its first stage's steps pending (None: key taken) |
| `insert_runs` | no run of each `(kind, key)` | each as `insert_run`, in one statement |
| `existing_runs` | | the runs that taken keys name, with their input hashes |
| `lock_run` | | run row locked for the advance |
| `open_in_stage` | | how many steps of the stage have not succeeded (0: advance), how many are parked |
| `create_stage` | run at stage n-1 | stage n's steps pending, the run pointed at n |
| `claim_next` | run at stage n-1 | stage n's single step inserted running for this process |
| `finish_run` | run live | succeeded, with its result (the one place a run succeeds in a transaction) |

`INSERT_RUN` also records the run's parent (a child step's run) and its deadline: the earliest of
`deadline_at`, the parent's deadline (a child inherits it) and `now() + deadline_s` of its kind,
in the database's clock (`least` ignores the ones not given). `LOCK_RUN` says whether the
deadline has passed: then no next stage is created and the run ends (`chain.expire_run`).
Every run that finishes notifies `engine_run_finished` (`store.children`).

Existing step rows are left alone (`ON CONFLICT DO NOTHING`): a stage is created once however
often its predecessor's commit is retried. Proofs: `tests/integration/test_engine_basics.py`,
`tests/integration/test_inline.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.status import RunStatus
from proj.engine.store.rows import StepRef

# The run and its first stage in one statement (the step arrays come from `chain.stage_rows`;
# an empty first stage inserts the run alone). No row back: the key names an existing run.
INSERT_RUN = text(
    """
    WITH run AS (
        INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash,
                                     priority, concurrency_key, available_at, trace,
                                     current_stage, current_step, parent_run_id, deadline_at)
        VALUES (:run, :kind, :version, :key, CAST(:input AS jsonb), :hash, :priority, :ckey,
                coalesce(:at, now()), CAST(:trace AS jsonb), :stage, :label, :parent,
                least(CAST(:deadline AS timestamptz), CAST(:inherited AS timestamptz),
                      now() + make_interval(secs => CAST(:deadline_s AS double precision))))
        ON CONFLICT (kind, idempotency_key) DO NOTHING
        RETURNING id
    ), ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, item, max_attempts,
                                 next_attempt_at, published_at)
        SELECT run.id, :stage, n.name, n.idx, CAST(n.item AS jsonb), n.max,
               coalesce(:at, now()), CASE WHEN :due THEN now() END
          FROM run, unnest(CAST(:names AS text[]), CAST(:idxs AS int[]), CAST(:items AS text[]),
                           CAST(:maxs AS int[])) AS n(name, idx, item, max)
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, name, item_index
    )
    SELECT run.id AS run_id, ins.id, ins.name FROM run LEFT JOIN ins ON true ORDER BY ins.item_index
    """
)

# A batch of runs and their first stages in one statement (`chain.insert_runs`): `INSERT_RUN`
# row by row (one run alone takes `INSERT_RUN`: planned for one row, it costs 0.45 ms where this
# costs 0.6). A key taken already, or twice in one batch, inserts nothing for that run (its row
# is missing from the result; the caller looks the key up).
INSERT_RUNS = text(
    """
    WITH run AS (
        INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash,
                                     priority, concurrency_key, available_at, trace,
                                     current_stage, current_step, parent_run_id, deadline_at)
        SELECT r.id, r.kind, r.version, r.key, CAST(r.input AS jsonb), r.hash, r.priority, r.ckey,
               coalesce(r.at, now()), CAST(r.trace AS jsonb), 0, r.label, r.parent,
               least(r.deadline, r.inherited, now() + make_interval(secs => r.deadline_s))
          FROM unnest(CAST(:runs AS uuid[]), CAST(:kinds AS text[]), CAST(:versions AS int[]),
                      CAST(:keys AS text[]), CAST(:inputs AS text[]), CAST(:hashes AS text[]),
                      CAST(:priorities AS int[]), CAST(:ckeys AS text[]), CAST(:ats AS timestamptz[]),
                      CAST(:traces AS text[]), CAST(:labels AS text[]), CAST(:parents AS uuid[]),
                      CAST(:deadlines AS timestamptz[]), CAST(:inheriteds AS timestamptz[]),
                      CAST(:deadline_ss AS double precision[]))
               WITH ORDINALITY AS r(id, kind, version, key, input, hash, priority, ckey, at, trace,
                                    label, parent, deadline, inherited, deadline_s, ord)
         ORDER BY r.ord
        ON CONFLICT (kind, idempotency_key) DO NOTHING
        RETURNING id, available_at
    ), ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, item, max_attempts,
                                 next_attempt_at, published_at)
        SELECT run.id, 0, n.name, n.idx, CAST(n.item AS jsonb), n.max,
               run.available_at, CASE WHEN :due THEN now() END
          FROM unnest(CAST(:step_runs AS uuid[]), CAST(:names AS text[]), CAST(:idxs AS int[]),
                      CAST(:items AS text[]), CAST(:maxs AS int[])) AS n(run, name, idx, item, max)
          JOIN run ON run.id = n.run
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, run_id, name, item_index
    )
    SELECT run.id AS run_id, ins.id, ins.name
      FROM run LEFT JOIN ins ON ins.run_id = run.id
     ORDER BY run.id, ins.item_index
    """
)

EXISTING_RUNS = text(
    """
    SELECT idempotency_key, id, input_hash FROM engine.task_run
     WHERE kind = :kind AND idempotency_key = ANY(CAST(:keys AS text[]))
    """
)

LOCK_RUN = text(
    """
    SELECT id, kind, version, input, status, current_stage, cancel_requested_at, priority, trace,
           created_at, coalesce(deadline_at <= now(), false) AS past_deadline
      FROM engine.task_run WHERE id = :id
       FOR UPDATE
    """
)

# A statement of its own, after the run lock: its snapshot sees every committed sibling. It also
# counts the open steps that are parked, over the same rows: when all of them are, the committing
# step was the last one running and the run is `waiting` now (`chain.advance`).
OPEN_IN_STAGE = text(
    """
    SELECT count(*), count(*) FILTER (WHERE status = 'waiting') FROM engine.step
     WHERE run_id = :id AND stage = :stage AND status <> 'succeeded'
    """
)

# A stage's step rows and the run pointer in one statement (a data-modifying CTE always runs, so
# an empty fan-out still moves the pointer).
CREATE_STAGE = text(
    """
    WITH ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, item, max_attempts,
                                 next_attempt_at, published_at)
        SELECT :run, :stage, n.name, n.idx, CAST(n.item AS jsonb), n.max,
               coalesce(:at, now()), CASE WHEN :due THEN now() END
          FROM unnest(CAST(:names AS text[]), CAST(:idxs AS int[]), CAST(:items AS text[]),
                      CAST(:maxs AS int[])) AS n(name, idx, item, max)
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, name, item_index
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :stage, current_step = :label, updated_at = now()
         WHERE id = :run
    )
    SELECT id, name FROM ins ORDER BY item_index
    """
)

# The next stage's one step, inserted claimed for the committing process (`attempts.Carry`): the
# step row (its attempt stamped on it) and the run pointer, in a transaction that locked the run.
CLAIM_NEXT = text(
    """
    WITH ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, next_attempt_at,
                                 published_at, status, lease_token, lease_owner, lease_until,
                                 attempts, started_at, claimed_at)
        SELECT :run, :next_stage, :next_name, 0, :next_max, now(), now(), 'running', :next_tok,
               :owner, now() + make_interval(secs => :ttl), 1, now(), now()
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, now() AS claimed_at
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :next_stage, current_step = :next_label,
               updated_at = now()
         WHERE id = :run
    )
    SELECT id, claimed_at FROM ins
    """
)

FINISH_RUN = text(
    """
    UPDATE engine.task_run
       SET status = 'succeeded', result = CAST(:result AS jsonb), current_stage = :end_stage,
           current_step = NULL, finished_at = now(), updated_at = now()
     WHERE id = :id AND status IN ('pending', 'running', 'waiting')
    RETURNING id, kind, version, trace, created_at, finished_at, parent_run_id,
              CASE WHEN result_awaited THEN pg_notify('engine_run_finished', id::text)::text END AS notified
    """
)


class StageRows(NamedTuple):
    """A stage's step rows as the array parameters of `INSERT_RUN`/`CREATE_STAGE`: one entry per
    static step, or one per item of a fan-out (none for an empty one)."""

    names: list[str]
    idxs: list[int]
    items: list[str | None]  # each item as JSON (None: a static step)
    maxs: list[int]


class NewRun(NamedTuple):
    """What `insert_run` writes: the run's row (`run_id`, ...) and its first stage."""

    run_id: uuid.UUID
    kind: str
    version: int
    idempotency_key: str
    input_json: str
    input_hash: str
    priority: int
    concurrency_key: str | None
    available_at: datetime | None
    trace_json: str | None
    label: str
    parent_run_id: uuid.UUID | None
    deadline_at: datetime | None
    inherited_deadline: datetime | None
    deadline_s: float | None


class ExistingRun(NamedTuple):
    id: uuid.UUID
    input_hash: str


class LockedRun(NamedTuple):
    """The run row locked for an advance (`LOCK_RUN`, `commits.SUCCEED_AND_LOCK_RUN`: the same
    columns in the same order)."""

    id: uuid.UUID
    kind: str
    version: int
    input: dict[str, Any]
    status: RunStatus
    current_stage: int
    cancel_requested_at: datetime | None
    priority: int
    trace: dict[str, Any] | None
    created_at: datetime
    past_deadline: bool

    @classmethod
    def of(cls, r: Any) -> LockedRun:
        return cls(
            r.id,
            r.kind,
            r.version,
            r.input,
            RunStatus(r.status),
            r.current_stage,
            r.cancel_requested_at,
            r.priority,
            r.trace,
            r.created_at,
            r.past_deadline,
        )


class NextStep(NamedTuple):
    """The next stage's single step, to insert claimed under `token` for this process
    (`attempts.Carry`): `CLAIM_NEXT` and `commits.SUCCEED_AND_CLAIM_NEXT`."""

    run_id: uuid.UUID
    stage: int
    name: str
    label: str
    max_attempts: int
    token: uuid.UUID
    owner: str
    ttl: float

    def params(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "next_stage": self.stage,
            "next_name": self.name,
            "next_label": self.label,
            "next_max": self.max_attempts,
            "next_tok": self.token,
            "owner": self.owner,
            "ttl": self.ttl,
        }


class ClaimedNext(NamedTuple):
    id: int
    claimed_at: datetime


class EndedRun(NamedTuple):
    """A run that just finished (succeeded or failed): what its span and its parent need."""

    id: uuid.UUID
    kind: str
    version: int
    trace: dict[str, Any] | None
    created_at: datetime
    finished_at: datetime
    parent_run_id: uuid.UUID | None


def insert_run(s: Session, run: NewRun, first: StageRows, *, due: bool) -> list[StepRef] | None:
    """Insert the run and its first stage (published now if `due`); None: the key names a run
    already (nothing written). The steps come back in item order (none: an empty stage)."""
    rows = s.execute(
        INSERT_RUN,
        {
            "run": run.run_id,
            "kind": run.kind,
            "version": run.version,
            "key": run.idempotency_key,
            "input": run.input_json,
            "hash": run.input_hash,
            "priority": run.priority,
            "ckey": run.concurrency_key,
            "at": run.available_at,
            "trace": run.trace_json,
            "stage": 0,
            "label": run.label,
            **first._asdict(),
            "due": due,
            "parent": run.parent_run_id,
            "deadline": run.deadline_at,
            "inherited": run.inherited_deadline,
            "deadline_s": run.deadline_s,
        },
    ).all()
    if not rows:
        return None
    return [StepRef(r.id, r.name) for r in rows if r.id is not None]


def insert_runs(
    s: Session, runs: Sequence[NewRun], firsts: Sequence[StageRows], *, due: bool
) -> dict[uuid.UUID, list[StepRef]]:
    """Insert the runs and their first stages (published now if `due`) in one statement; the
    runs inserted, each with its steps in item order (none: an empty stage). A run missing from
    the result was not written: its key names a run already, or an earlier one in the batch."""
    steps = [(run.run_id, first) for run, first in zip(runs, firsts, strict=True)]
    params = {
        "runs": [r.run_id for r in runs],
        "kinds": [r.kind for r in runs],
        "versions": [r.version for r in runs],
        "keys": [r.idempotency_key for r in runs],
        "inputs": [r.input_json for r in runs],
        "hashes": [r.input_hash for r in runs],
        "priorities": [r.priority for r in runs],
        "ckeys": [r.concurrency_key for r in runs],
        "ats": [r.available_at for r in runs],
        "traces": [r.trace_json for r in runs],
        "labels": [r.label for r in runs],
        "parents": [r.parent_run_id for r in runs],
        "deadlines": [r.deadline_at for r in runs],
        "inheriteds": [r.inherited_deadline for r in runs],
        "deadline_ss": [r.deadline_s for r in runs],
        "step_runs": [run_id for run_id, first in steps for _ in first.names],
        "names": [n for _, first in steps for n in first.names],
        "idxs": [i for _, first in steps for i in first.idxs],
        "items": [i for _, first in steps for i in first.items],
        "maxs": [m for _, first in steps for m in first.maxs],
        "due": due,
    }
    out: dict[uuid.UUID, list[StepRef]] = {}
    for r in s.execute(INSERT_RUNS, params):
        got = out.setdefault(r.run_id, [])
        if r.id is not None:
            got.append(StepRef(r.id, r.name))
    return out


def existing_runs(s: Session, kind: str, keys: Sequence[str]) -> dict[str, ExistingRun]:
    """The runs that taken keys name (the caller's insert found them taken), by key, each with
    its input hash: one lookup for a whole batch."""
    if not keys:
        return {}
    rows = s.execute(EXISTING_RUNS, {"kind": kind, "keys": list(keys)})
    return {r.idempotency_key: ExistingRun(r.id, r.input_hash) for r in rows}


def lock_run(s: Session, run_id: uuid.UUID) -> LockedRun | None:
    """Lock the run row for an advance (the fan-in is counted under it)."""
    row = s.execute(LOCK_RUN, {"id": run_id}).first()
    return None if row is None else LockedRun.of(row)


class OpenSteps(NamedTuple):
    """A stage's steps not succeeded yet (`open`, 0: the stage is complete), and how many of
    those are parked (`parked`)."""

    open: int
    parked: int


def open_in_stage(s: Session, run_id: uuid.UUID, stage: int) -> OpenSteps:
    """Steps of the stage not succeeded yet, and the parked ones among them, seen after the run
    lock."""
    row = s.execute(OPEN_IN_STAGE, {"id": run_id, "stage": stage}).one()
    return OpenSteps(int(row[0]), int(row[1]))


def create_stage(
    s: Session,
    *,
    run_id: uuid.UUID,
    stage: int,
    label: str,
    rows: StageRows,
    available_at: datetime | None,
    due: bool,
) -> list[StepRef]:
    """Insert the stage's steps (published now if `due`) and point the run at it; returns the
    steps inserted (one existing already is left alone)."""
    params = {"run": run_id, "stage": stage, "label": label, **rows._asdict(), "at": available_at, "due": due}
    return [StepRef(*r) for r in s.execute(CREATE_STAGE, params)]


def claim_next(s: Session, step: NextStep) -> ClaimedNext | None:
    """Insert the next stage's single step claimed under `step.token`; None: it exists already."""
    row = s.execute(CLAIM_NEXT, step.params()).first()
    return None if row is None else ClaimedNext(*row)


def finish_run(s: Session, run_id: uuid.UUID, *, result: str, end_stage: int) -> EndedRun | None:
    """The run succeeded with `result` (JSON); None: it was not live (nothing written)."""
    r = s.execute(FINISH_RUN, {"result": result, "end_stage": end_stage, "id": run_id}).first()
    return None if r is None else EndedRun(*r[:7])
