"""What operators read of the engine (/admin, `proj runs`/`show`, `proj demo`): lists, counts and
one run's stages, progress and parked step. Read only: no statement here changes a row.

The runs list takes its filters as nullable parameters (NULL: any), so the statement is one and
whole whatever the operator filters on.

Each function runs the statement named like it in capitals (`list_runs`: `LIST_RUNS`) and returns
typed rows: statuses as `RunStatus` / `StepStatus` (a `StrEnum`: it prints, compares and
serialises as its text), field names as the statement's columns, so templates read them alike.

| function | reads |
|---|---|
| `list_runs` | runs newest first, filtered by kind, version, status and a run id or key search |
| `run_kinds`, `run_versions` | the kinds and versions present (the filters' drop-downs) |
| `status_counts` | runs per status |
| `run` | one run, every column (None: no such run) |
| `run_exists` | whether a run id names a run |
| `run_progress` | one run's status, current step and last update (the run page's poll) |
| `running_progress` | a run's running steps that report progress |
| `stage_counts` | a run's steps per stage, name and status, with their attempts |
| `parked_step` | a waiting run's parked step: topic, timer, wake-ups |
| `dead_letters` | failed runs, latest first, every column |
| `failed_steps` | a run's failed steps and their errors |
| `version_matrix` | runs per kind, version and status, and the oldest live one |
| `parked_runs` | waiting steps with their run, soonest timer first |
| `parked_topics` | per topic waited on: how many wait, the next timer, the last signal |
| `run_with_clock` | one run's status and outcome, with the database's clock (`proj demo`) |
| `steps_of_run` | a run's steps in order (`proj demo`) |
| `steps_named_by_key` | one step's items of the run with a key (`proj demo`: copy progress) |
| `ended_badly_by_keys` | the runs with these keys that failed or were canceled (`proj demo`) |
| `first_signal` | when a topic was first signalled (`proj demo`: the on-finish hook) |
| `runs_with_open_steps_by_keys` | the runs with these keys and their unfinished steps (`proj demo`) |
| `step_errors_by_keys` | every step error of the runs with these keys (`proj demo`) |

Proofs: `tests/integration/test_admin.py`, `tests/integration/test_cli.py`,
`tests/integration/test_demo.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Row, text
from sqlalchemy.orm import Session

from proj.engine.status import RunStatus, StepStatus

LIST_RUNS = text(
    """
    SELECT id, kind, version, status, current_step, idempotency_key, created_at, updated_at,
           finished_at, cancel_requested_at, last_error
      FROM engine.task_run
     WHERE (CAST(:kind AS text) IS NULL OR kind = :kind)
       AND (CAST(:version AS int) IS NULL OR version = :version)
       AND (CAST(:status AS text) IS NULL OR status = :status)
       AND (CAST(:rid AS uuid) IS NULL OR id = :rid OR idempotency_key LIKE :holding)
       AND (CAST(:pat AS text) IS NULL OR id::text LIKE :prefix OR idempotency_key ILIKE :pat)
     ORDER BY created_at DESC, id
     LIMIT :limit OFFSET :offset
    """
)

RUN_KINDS = text("SELECT DISTINCT kind FROM engine.task_run ORDER BY kind")
RUN_VERSIONS = text("SELECT DISTINCT version FROM engine.task_run ORDER BY version")
STATUS_COUNTS = text("SELECT status, count(*) FROM engine.task_run GROUP BY status")

RUN = text("SELECT * FROM engine.task_run WHERE id = :id")
RUN_PROGRESS = text("SELECT status, current_step, updated_at FROM engine.task_run WHERE id = :id")

RUNNING_PROGRESS = text(
    """
    SELECT name, item_index, status, progress FROM engine.step
     WHERE run_id = :id AND progress IS NOT NULL AND status = 'running'
     ORDER BY stage, item_index
    """
)

STAGE_COUNTS = text(
    """
    SELECT stage, name, status, count(*) AS n, max(attempts - outages) AS attempts,
           max(max_attempts) AS max_attempts, max(outages) AS outages
      FROM engine.step WHERE run_id = :id
     GROUP BY stage, name, status ORDER BY stage, name
    """
)

PARKED_STEP = text(
    """
    SELECT name, wait_topic, wait_until, wait_since, wakeups FROM engine.step
     WHERE run_id = :id AND status = 'waiting' ORDER BY stage LIMIT 1
    """
)

DEAD_LETTERS = text(
    """
    SELECT * FROM engine.task_run WHERE status = 'failed'
     ORDER BY finished_at DESC NULLS LAST, created_at DESC LIMIT :limit
    """
)

FAILED_STEPS = text(
    """
    SELECT name, item_index, attempts - outages AS attempts, max_attempts, error, finished_at, outages
      FROM engine.step
     WHERE run_id = :id AND status = 'failed' ORDER BY stage, item_index
    """
)

VERSION_MATRIX = text(
    """
    SELECT kind, version, status, count(*) AS n,
           min(created_at) FILTER (WHERE status IN ('pending','running','waiting')) AS oldest_active
      FROM engine.task_run GROUP BY kind, version, status ORDER BY kind, version
    """
)

PARKED_RUNS = text(
    """
    SELECT r.id AS run_id, r.kind, r.version, r.idempotency_key, s.name, s.wait_topic,
           s.wait_until, s.wait_since, s.wakeups
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE s.status = 'waiting' ORDER BY s.wait_until NULLS LAST LIMIT :limit
    """
)

PARKED_TOPICS = text(
    """
    SELECT s.wait_topic AS topic, count(*) AS n, min(s.wait_until) AS next_timer,
           (SELECT max(created_at) FROM engine.task_signal g WHERE g.topic = s.wait_topic) AS last_signal
      FROM engine.step s WHERE s.status = 'waiting'
     GROUP BY s.wait_topic ORDER BY n DESC, topic
    """
)

RUN_EXISTS = text("SELECT 1 FROM engine.task_run WHERE id = :id")

# What `proj demo` follows on screen: one run with the database's clock, its steps, and the runs
# of a request named by their keys.
RUN_WITH_CLOCK = text(
    """
    SELECT status, result, last_error, created_at, finished_at, clock_timestamp() AS now
      FROM engine.task_run WHERE id = :id
    """
)

STEPS_OF_RUN = text(
    """
    SELECT stage, name, item_index, item, status, attempts, started_at, finished_at
      FROM engine.step WHERE run_id = :id ORDER BY stage, item_index
    """
)

STEPS_NAMED_BY_KEY = text(
    """
    SELECT s.item_index, s.item, s.status, s.progress, s.finished_at
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE r.idempotency_key = :key AND s.name = :step ORDER BY s.item_index
    """
)

ENDED_BADLY_BY_KEYS = text(
    """
    SELECT kind, status, last_error FROM engine.task_run
     WHERE idempotency_key = ANY(:keys) AND status IN ('failed', 'canceled')
    """
)

FIRST_SIGNAL = text("SELECT min(created_at) FROM engine.task_signal WHERE topic = :topic")

RUNS_WITH_OPEN_STEPS_BY_KEYS = text(
    """
    SELECT kind, status, last_error,
           (SELECT string_agg(s.name || ' ' || s.status, ', ' ORDER BY s.stage, s.item_index)
              FROM engine.step s WHERE s.run_id = r.id AND s.status <> 'succeeded') AS open_steps
      FROM engine.task_run r WHERE idempotency_key = ANY(:keys) ORDER BY created_at
    """
)

STEP_ERRORS_BY_KEYS = text(
    """
    SELECT r.kind, s.name, s.item_index, s.status, s.attempts, s.error
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE r.idempotency_key = ANY(:keys) AND s.error IS NOT NULL ORDER BY s.id
    """
)

# ----------------------------------------------------------------------------------- rows


class RunListRow(NamedTuple):
    """`LIST_RUNS`'s row: one line of the runs list."""

    id: uuid.UUID
    kind: str
    version: int
    status: RunStatus
    current_step: str | None
    idempotency_key: str
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    last_error: dict[str, Any] | None


class StatusCount(NamedTuple):
    status: RunStatus
    n: int


class Run(NamedTuple):
    """A whole `engine.task_run` row (`RUN`, `DEAD_LETTERS`), columns in the table's order."""

    id: uuid.UUID
    kind: str
    version: int
    idempotency_key: str
    input: dict[str, Any]
    input_hash: str
    status: RunStatus
    current_stage: int
    current_step: str | None
    result: Any
    last_error: dict[str, Any] | None
    priority: int
    concurrency_key: str | None
    cancel_requested_at: datetime | None
    cancel_reason: str | None
    trace: dict[str, Any] | None
    available_at: datetime
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    parent_run_id: uuid.UUID | None
    deadline_at: datetime | None
    result_awaited: bool
    canceled_by_parent: bool


class RunProgress(NamedTuple):
    status: RunStatus
    current_step: str | None
    updated_at: datetime


class StepProgress(NamedTuple):
    """A running step's `progress` (done/total/message, as the step reported it)."""

    name: str
    item_index: int
    status: StepStatus
    progress: dict[str, Any] | None


class StageCount(NamedTuple):
    """How many of a stage's items are in one status, the most attempts any of them spent, and
    the most it tried during outages, not spent (`errors.Unavailable`, migration 0014)."""

    stage: int
    name: str
    status: StepStatus
    n: int
    attempts: int | None
    max_attempts: int | None
    outages: int | None = None


class ParkedStep(NamedTuple):
    name: str
    wait_topic: str | None
    wait_until: datetime | None
    wait_since: datetime | None
    wakeups: int


class FailedStep(NamedTuple):
    """A failed step: the attempts it spent, and those tried during outages (not spent)."""

    name: str
    item_index: int
    attempts: int
    max_attempts: int
    error: dict[str, Any] | None
    finished_at: datetime | None
    outages: int = 0


class VersionCount(NamedTuple):
    """Runs of one kind@version in one status; `oldest_active`: the oldest live one's creation."""

    kind: str
    version: int
    status: RunStatus
    n: int
    oldest_active: datetime | None


class ParkedRun(NamedTuple):
    """A waiting step and its run."""

    run_id: uuid.UUID
    kind: str
    version: int
    idempotency_key: str
    name: str
    wait_topic: str | None
    wait_until: datetime | None
    wait_since: datetime | None
    wakeups: int


class ParkedTopic(NamedTuple):
    topic: str | None
    n: int
    next_timer: datetime | None
    last_signal: datetime | None


class RunWithClock(NamedTuple):
    """One run's status and outcome, and `now`: the database's clock when it was read."""

    status: RunStatus
    result: Any
    last_error: dict[str, Any] | None
    created_at: datetime
    finished_at: datetime | None
    now: datetime


class StepLine(NamedTuple):
    """`STEPS_OF_RUN`'s row: one step of a run, as `proj demo` draws it."""

    stage: int
    name: str
    item_index: int
    item: Any
    status: StepStatus
    attempts: int
    started_at: datetime | None
    finished_at: datetime | None


class KeyedStep(NamedTuple):
    """`STEPS_NAMED_BY_KEY`'s row: one item of a named step of the run with a key."""

    item_index: int
    item: Any
    status: StepStatus
    progress: dict[str, Any] | None
    finished_at: datetime | None


class EndedBadly(NamedTuple):
    kind: str
    status: RunStatus
    last_error: dict[str, Any] | None


class RunWithOpenSteps(NamedTuple):
    """A run and its unfinished steps as `name status, ...` (None: every step succeeded)."""

    kind: str
    status: RunStatus
    last_error: dict[str, Any] | None
    open_steps: str | None


class StepError(NamedTuple):
    kind: str
    name: str
    item_index: int
    status: StepStatus
    attempts: int
    error: dict[str, Any] | None


# ------------------------------------------------------------------------------ /admin, CLI


def list_runs(
    s: Session,
    *,
    kind: str | None = None,
    version: int | None = None,
    status: RunStatus | None = None,
    search: str = "",
    limit: int,
    offset: int = 0,
) -> list[RunListRow]:
    """Runs newest first; None (or an empty `search`): any. `search` is a whole id (that run, and
    the runs whose key holds it: a request's `acquire:<id>` and `import:<id>`), else a run id's
    prefix or part of an idempotency key."""
    q = search.strip()
    exact = _uuid(q) if q else None
    like = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    params: dict[str, Any] = {
        "limit": limit,
        "offset": offset,
        "kind": kind,
        "version": version,
        "status": None if status is None else status.value,
        "rid": exact,
        "holding": "%" + like + "%",
        "prefix": like.lower() + "%",
        "pat": "%" + like + "%" if q and exact is None else None,
    }
    return [
        RunListRow(
            id=r.id,
            kind=r.kind,
            version=r.version,
            status=RunStatus(r.status),
            current_step=r.current_step,
            idempotency_key=r.idempotency_key,
            created_at=r.created_at,
            updated_at=r.updated_at,
            finished_at=r.finished_at,
            cancel_requested_at=r.cancel_requested_at,
            last_error=r.last_error,
        )
        for r in s.execute(LIST_RUNS, params)
    ]


def _uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def run_kinds(s: Session) -> list[str]:
    return list(s.scalars(RUN_KINDS).all())


def run_versions(s: Session) -> list[int]:
    return list(s.scalars(RUN_VERSIONS).all())


def status_counts(s: Session) -> list[StatusCount]:
    return [StatusCount(RunStatus(r[0]), int(r[1])) for r in s.execute(STATUS_COUNTS)]


def _run(r: Row[Any]) -> Run:
    m = r._mapping
    return Run(
        id=m["id"],
        kind=m["kind"],
        version=m["version"],
        idempotency_key=m["idempotency_key"],
        input=m["input"],
        input_hash=m["input_hash"],
        status=RunStatus(m["status"]),
        current_stage=m["current_stage"],
        current_step=m["current_step"],
        result=m["result"],
        last_error=m["last_error"],
        priority=m["priority"],
        concurrency_key=m["concurrency_key"],
        cancel_requested_at=m["cancel_requested_at"],
        cancel_reason=m["cancel_reason"],
        trace=m["trace"],
        available_at=m["available_at"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        started_at=m["started_at"],
        finished_at=m["finished_at"],
        parent_run_id=m["parent_run_id"],
        deadline_at=m["deadline_at"],
        result_awaited=m["result_awaited"],
        canceled_by_parent=m["canceled_by_parent"],
    )


def run(s: Session, run_id: uuid.UUID) -> Run | None:
    """One run, every column (None: no such run)."""
    r = s.execute(RUN, {"id": run_id}).first()
    return None if r is None else _run(r)


def run_exists(s: Session, run_id: uuid.UUID) -> bool:
    return s.scalar(RUN_EXISTS, {"id": run_id}) is not None


def run_progress(s: Session, run_id: uuid.UUID) -> RunProgress | None:
    """What the run page polls (None: no such run)."""
    r = s.execute(RUN_PROGRESS, {"id": run_id}).first()
    return None if r is None else RunProgress(RunStatus(r.status), r.current_step, r.updated_at)


def running_progress(s: Session, run_id: uuid.UUID) -> list[StepProgress]:
    """The run's running steps that report progress, in stage and item order."""
    return [
        StepProgress(r.name, r.item_index, StepStatus(r.status), r.progress)
        for r in s.execute(RUNNING_PROGRESS, {"id": run_id})
    ]


def stage_counts(s: Session, run_id: uuid.UUID) -> list[StageCount]:
    """The run's steps per stage, name and status, in stage order."""
    return [
        StageCount(r.stage, r.name, StepStatus(r.status), int(r.n), r.attempts, r.max_attempts, r.outages)
        for r in s.execute(STAGE_COUNTS, {"id": run_id})
    ]


def parked_step(s: Session, run_id: uuid.UUID) -> ParkedStep | None:
    """The run's (first) waiting step (None: none is waiting)."""
    r = s.execute(PARKED_STEP, {"id": run_id}).first()
    return None if r is None else ParkedStep(r.name, r.wait_topic, r.wait_until, r.wait_since, r.wakeups)


def dead_letters(s: Session, limit: int) -> list[Run]:
    """Up to `limit` failed runs, the latest to finish first."""
    return [_run(r) for r in s.execute(DEAD_LETTERS, {"limit": limit})]


def failed_steps(s: Session, run_id: uuid.UUID) -> list[FailedStep]:
    """The run's failed steps, in stage and item order."""
    return [
        FailedStep(r.name, r.item_index, r.attempts, r.max_attempts, r.error, r.finished_at, r.outages)
        for r in s.execute(FAILED_STEPS, {"id": run_id})
    ]


def version_matrix(s: Session) -> list[VersionCount]:
    """Runs per kind, version and status, by kind and version."""
    return [
        VersionCount(r.kind, r.version, RunStatus(r.status), int(r.n), r.oldest_active)
        for r in s.execute(VERSION_MATRIX)
    ]


def parked_runs(s: Session, limit: int) -> list[ParkedRun]:
    """Up to `limit` waiting steps and their runs, the soonest timer first (none: last)."""
    return [
        ParkedRun(
            run_id=r.run_id,
            kind=r.kind,
            version=r.version,
            idempotency_key=r.idempotency_key,
            name=r.name,
            wait_topic=r.wait_topic,
            wait_until=r.wait_until,
            wait_since=r.wait_since,
            wakeups=r.wakeups,
        )
        for r in s.execute(PARKED_RUNS, {"limit": limit})
    ]


def parked_topics(s: Session) -> list[ParkedTopic]:
    """Per topic waited on: how many steps wait, the next timer, the last signal; most first."""
    return [ParkedTopic(r.topic, int(r.n), r.next_timer, r.last_signal) for r in s.execute(PARKED_TOPICS)]


# -------------------------------------------------------------------------------- proj demo


def run_with_clock(s: Session, run_id: uuid.UUID) -> RunWithClock:
    """The run's status and outcome, and the database's clock (the run exists: it was enqueued)."""
    r = s.execute(RUN_WITH_CLOCK, {"id": run_id}).one()
    return RunWithClock(RunStatus(r.status), r.result, r.last_error, r.created_at, r.finished_at, r.now)


def steps_of_run(s: Session, run_id: uuid.UUID) -> list[StepLine]:
    """The run's steps, in stage and item order."""
    return [
        StepLine(
            stage=r.stage,
            name=r.name,
            item_index=r.item_index,
            item=r.item,
            status=StepStatus(r.status),
            attempts=r.attempts,
            started_at=r.started_at,
            finished_at=r.finished_at,
        )
        for r in s.execute(STEPS_OF_RUN, {"id": run_id})
    ]


def steps_named_by_key(s: Session, key: str, step: str) -> list[KeyedStep]:
    """The items of step `step` of the run(s) with idempotency key `key`, in item order."""
    return [
        KeyedStep(r.item_index, r.item, StepStatus(r.status), r.progress, r.finished_at)
        for r in s.execute(STEPS_NAMED_BY_KEY, {"key": key, "step": step})
    ]


def ended_badly_by_keys(s: Session, keys: Sequence[str]) -> list[EndedBadly]:
    """The runs with one of these idempotency keys that ended failed or canceled."""
    return [
        EndedBadly(r.kind, RunStatus(r.status), r.last_error)
        for r in s.execute(ENDED_BADLY_BY_KEYS, {"keys": list(keys)})
    ]


def first_signal(s: Session, topic: str) -> datetime | None:
    """When the first signal still stored on `topic` was sent (None: none is)."""
    at: datetime | None = s.scalar(FIRST_SIGNAL, {"topic": topic})
    return at


def runs_with_open_steps_by_keys(s: Session, keys: Sequence[str]) -> list[RunWithOpenSteps]:
    """The runs with one of these idempotency keys, oldest first, with their unfinished steps."""
    return [
        RunWithOpenSteps(r.kind, RunStatus(r.status), r.last_error, r.open_steps)
        for r in s.execute(RUNS_WITH_OPEN_STEPS_BY_KEYS, {"keys": list(keys)})
    ]


def step_errors_by_keys(s: Session, keys: Sequence[str]) -> list[StepError]:
    """Every step of the runs with these keys that holds an error (its last), in creation order."""
    return [
        StepError(r.kind, r.name, r.item_index, StepStatus(r.status), r.attempts, r.error)
        for r in s.execute(STEP_ERRORS_BY_KEYS, {"keys": list(keys)})
    ]
