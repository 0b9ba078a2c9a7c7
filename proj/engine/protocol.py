"""The step protocol — the one place where steps are claimed, fenced and committed.

Every delivery of a step message goes through `execute()`:

1. **claim**: one `UPDATE … WHERE status='pending' AND due` takes the step with a fresh lease
   token. A duplicate message, a completed step or a canceled run claims nothing: a no-op.
   A kind with limits (`global_limit`, `concurrency_limit` per `concurrency_key`) is admitted
   in the same transaction, under an advisory lock per kind and per key, only if a slot is free
   and no better-ordered run waits for it; otherwise the step stays `pending` with a reason.
   A kind without limits starts its runs in priority order: a delivery of its start step
   claims the pending run of higher priority, if any, instead of its own (`_CLAIM_START`).
2. **heartbeat**: the process heartbeat renews the lease while the body runs.
3. **body**: the kind's function (or a wait check) runs with a `StepContext`.
4. **fenced commit**: `UPDATE … WHERE id=? AND lease_token=?`. Zero rows means another attempt
   took over; the commit is refused and nothing is written. The same transaction advances the run
   (fan-in counted under the run row lock) and creates the next stage's steps.
5. **publish**: messages for the new steps are sent after commit; a failure leaves
   `published_at` NULL so the sweeper sends them (messages are hints, Postgres is the truth).
   A limited step that ends its attempt hands its slot to the head of the line (`handoff`).

Every attempt is an OpenTelemetry span in its run's trace (`proj.engine.tracing`).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic_core import to_jsonable_python
from sqlalchemy import text
from sqlalchemy.orm import Session

from proj import db, logs
from proj.engine import dispatch, tracing
from proj.engine.context import PlanContext, StepContext
from proj.engine.dispatch import Dispatch
from proj.engine.errors import CancelRequested, LeaseLost, NonRetryable
from proj.engine.heartbeat import HEARTBEAT
from proj.engine.kind import Kind, RetryPolicy, StepDef, WaitSpec, all_kinds, get_kind
from proj.engine.status import TERMINAL
from proj.settings import get_settings

log = logging.getLogger(__name__)


# The claim is one statement: it takes the lease, marks the run started and opens the attempt
# record (same lock order as before: the step row, then the run row).
# `(… ) IS TRUE` around the step's state keeps the planner on the primary key: a plain
# `status = 'pending'` lets it pick the partial `step_due_idx` and filter it by id, which
# statistics taken before a backlog built up make look cheap, and which is O(backlog) per claim
# (`tests/integration/test_limits.py::test_a_claim_reads_its_step_by_primary_key_under_a_backlog`).
_CLAIM_BODY = """
    claimed AS (
        UPDATE engine.step s
           SET status = 'running', lease_token = :tok, lease_owner = :owner,
               lease_until = now() + make_interval(secs => :ttl),
               attempts = s.attempts + 1, started_at = coalesce(s.started_at, now()),
               blocked_reason = NULL, blocked_on = NULL, blocked_at = NULL
          FROM engine.task_run r
         WHERE s.id = {target} AND r.id = s.run_id
           AND (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE
           AND r.status IN ('pending', 'running', 'waiting') AND r.cancel_requested_at IS NULL
     RETURNING s.id, s.run_id, s.stage, s.name, s.item_index, s.item, s.attempts, s.max_attempts,
               r.kind, r.version, r.input, r.priority, r.concurrency_key, r.trace,
               now() AS claimed_at
    ), started AS (
        UPDATE engine.task_run t
           SET status = 'running', current_step = c.name, updated_at = now(),
               started_at = coalesce(t.started_at, now())
          FROM claimed c
         WHERE t.id = c.run_id AND t.status IN ('pending', 'waiting')
    ), attempt AS (
        INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker)
        SELECT id, attempts, :tok, :owner FROM claimed
    )
    SELECT * FROM claimed
"""
_CLAIM = text("WITH" + _CLAIM_BODY.format(target=":id"))
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
_CLAIM_START = text(
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
           AND r2.cancel_requested_at IS NULL
           AND (s2.status = 'pending' AND s2.next_attempt_at <= now()) IS TRUE
         ORDER BY r2.priority DESC, r2.created_at, r2.id
         LIMIT 1
           FOR UPDATE OF s2 SKIP LOCKED
    ),"""
    + _CLAIM_BODY.format(target="coalesce((SELECT id FROM better), :id)")
)
_CLOSE_ATTEMPT = text(
    "UPDATE engine.step_attempt SET outcome = :outcome, ended_at = now(), "
    "error = CAST(:error AS jsonb) WHERE step_id = :id AND lease_token = :tok"
)
# A step's fenced success: its result, and its attempt record closed. No `done` row means the
# lease is gone. `{source}` is empty, or `FROM run` where a statement also gates it on the run.
_STEP_SUCCEEDED = """
    done AS (
        UPDATE engine.step s SET status = 'succeeded', result = CAST(:result AS jsonb),
               finished_at = now(), lease_token = NULL, lease_until = NULL, progress = NULL
          {source}
         WHERE s.id = :id AND s.lease_token = :tok AND s.status = 'running'
     RETURNING s.id, s.run_id
    ), closed AS (
        UPDATE engine.step_attempt a SET outcome = 'succeeded', ended_at = now(), error = NULL
          FROM done WHERE a.step_id = done.id AND a.lease_token = :tok
    )"""
# The fenced commit of a result also locks the run row (for `advance`) in one statement.
_SUCCEED = text(
    "WITH"
    + _STEP_SUCCEEDED.format(source="")
    + """
    SELECT r.id, r.kind, r.version, r.input, r.status, r.current_stage, r.cancel_requested_at,
           r.priority, r.trace, r.created_at
      FROM done JOIN engine.task_run r ON r.id = done.run_id
       FOR UPDATE OF r
    """
)


@dataclass(frozen=True)
class Claim:
    """A claimed attempt: everything the body needs, read in the claiming statement."""

    step_id: int
    run_id: uuid.UUID
    stage: int
    name: str
    item_index: int
    item: Any
    attempt: int
    max_attempts: int
    kind: str
    version: int
    input: dict[str, Any]
    claimed_at: datetime
    token: uuid.UUID
    priority: int = 0
    concurrency_key: str | None = None
    trace: dict[str, Any] | None = None


@dataclass
class Carry:
    """Leave to claim the run's next step inside the committing transaction and run it here.

    A linear chain continues in the same process: the next step row is inserted already
    `running` under a fresh lease token (with its attempt record), so it needs no message and no
    second claim. Fencing is unchanged: the lease is taken in the transaction that commits the
    previous step, and a crash leaves a running step whose lease expires for the sweeper.
    """

    parent: Claim
    token: uuid.UUID = field(default_factory=uuid.uuid4)
    claim: Claim | None = None


class InlineBudget:
    """How far one delivery may continue a chain inline (`inline_steps`, `inline_budget_s`), so a
    long chain still yields its process to other queues and shows up in Flower now and then."""

    def __init__(self) -> None:
        settings = get_settings()
        self.steps_left = settings.inline_steps
        self.deadline = time.monotonic() + settings.inline_budget_s

    def carry(self, c: Claim, kind: Kind) -> Carry | None:
        # Limited kinds go back to the admission line between steps (`handoff` keeps its order).
        if self.steps_left <= 0 or kind.has_limits or time.monotonic() >= self.deadline:
            return None
        self.steps_left -= 1
        return Carry(parent=c)


def worker_id() -> str:
    """Who holds a lease: host and pid, and the liveness lock that says whether this process is
    still alive (`proj.engine.liveness`: a dead owner's steps are recovered without the lease)."""
    from proj.engine.liveness import LIVENESS

    return LIVENESS.owner()


def to_json(value: Any) -> str:
    """Serialise a step result (pydantic models, UUIDs, datetimes included)."""
    return json.dumps(to_jsonable_python(value))


def error_payload(exc: BaseException) -> dict[str, Any]:
    """A stored error: type, message and a short traceback for the dead-letter view."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": tb[-4000:]}


# --------------------------------------------------------------------------------------------
# claim


def _claim(step_id: int, starts_run: bool = False) -> tuple[Claim | None, list[Dispatch]]:
    """The claim transaction; also returns waiters to wake when a denial saw free slots.

    `starts_run`: the message is for the kind's `start_step` (a kind without limits), so it
    may start a better-ordered pending run instead (`_CLAIM_START`).
    """
    token = uuid.uuid4()
    kicks: list[Dispatch] = []
    params = {"id": step_id, "tok": token, "owner": worker_id(), "ttl": get_settings().lease_ttl_s}
    if starts_run or not any_limits():
        # Nothing to admit: the claim is a single statement, atomic on its own, so it runs in
        # autocommit and saves the BEGIN and COMMIT round trips.
        with db.autocommit() as conn:
            row = conn.first(_CLAIM_START if starts_run else _CLAIM, params)
            if row is None:
                return None, []
            if starts_run and row.stage == 0 and row.item_index == 0:
                kicks = _release_start_siblings(conn, row)
    else:
        with db.transaction() as s:
            slot = s.execute(_SLOT_OF, {"id": step_id}).first()
            if slot is None:
                return None, []
            gates = limit_gates(get_kind(slot.kind, slot.version), slot.concurrency_key)
            if gates:
                denial, kicks = _admit(s, slot, gates)
                if denial is not None:
                    return None, kicks + _deny(s, step_id, denial)
            row = s.execute(_CLAIM, params).first()
            if row is None:
                return None, []
    return Claim(
        step_id=row.id,
        run_id=row.run_id,
        stage=row.stage,
        name=row.name,
        item_index=row.item_index,
        item=row.item,
        attempt=row.attempts,
        max_attempts=row.max_attempts,
        kind=row.kind,
        version=row.version,
        input=row.input,
        claimed_at=row.claimed_at,
        token=token,
        priority=row.priority,
        concurrency_key=row.concurrency_key,
        trace=row.trace,
    ), kicks


_START_SIBLINGS = text(
    "UPDATE engine.step SET published_at = now() "
    "WHERE run_id = :run AND stage = 0 AND item_index > 0 AND (status = 'pending') IS TRUE "
    "RETURNING id, name"
)


def _release_start_siblings(conn: db.Autocommit, row: Any) -> list[Dispatch]:
    """The run just claimed by its start step: send the rest of its first stage, held back at
    enqueue so that they could not start a run out of priority order (`Kind.holds_start_siblings`).
    If this process dies before publishing, the sweeper re-sends them (`republish_after_s`)."""
    if not get_kind(row.kind, row.version).holds_start_siblings:
        return []
    rows = conn.all(_START_SIBLINGS, {"run": row.run_id})
    return [dispatch.step_dispatch(r.id, row.kind, row.version, r.name, row.priority) for r in rows]


# --------------------------------------------------------------------------------------------
# limits: slots counted in Postgres across all workers


@dataclass(frozen=True)
class Gate:
    """One limit a claim must pass: the kind's global limit, or its limit per concurrency key."""

    scope: str  # 'global' | 'key'
    kind: str
    limit: int
    key: str | None = None

    @property
    def lock(self) -> str:
        return f"gk:{self.kind}" if self.scope == "global" else f"ck:{self.kind}:{self.key}"

    def reason(self, held: int) -> str:
        if self.scope == "global":
            return f"waiting for a slot: {self.kind} has {held}/{self.limit} runs in a step (global limit)"
        return (
            f"waiting for a slot: concurrency key {self.key!r} of {self.kind} has "
            f"{held}/{self.limit} runs in a step"
        )


@dataclass(frozen=True)
class Denial:
    """Why a claim was refused."""

    gate: Gate
    held: int


def any_limits() -> bool:
    """Whether any kind known to this process declares a limit."""
    return any(k.global_limit is not None or k.concurrency_limit is not None for k in all_kinds())


def limit_gates(kind: Kind, concurrency_key: str | None) -> list[Gate]:
    """The limits of a kind, global first (the advisory lock order, so claims never deadlock).

    Keys are scoped to the kind (and shared by its versions). A run without a key (the kind's
    function returned None) is only under the global limit.
    """
    gates: list[Gate] = []
    if kind.global_limit is not None:
        gates.append(Gate("global", kind.name, kind.global_limit))
    if kind.concurrency_limit is not None and concurrency_key is not None:
        gates.append(Gate("key", kind.name, kind.concurrency_limit, concurrency_key))
    return gates


_SLOT_OF = text(
    """
    SELECT r.id AS run_id, r.kind, r.version, r.concurrency_key, r.priority, r.created_at
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE s.id = :id AND (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE  -- by pkey
       AND r.status IN ('pending', 'running', 'waiting') AND r.cancel_requested_at IS NULL
    """
)
# Slots are counted in runs: fan-out items of a run that already holds one share it.
_HOLDERS = """
    SELECT count(DISTINCT h.run_id) AS runs, coalesce(bool_or(h.run_id = CAST(:run AS uuid)), false) AS mine
      FROM engine.step h JOIN engine.task_run hr ON hr.id = h.run_id
     WHERE h.status = 'running' AND h.lease_until > now() AND hr.kind = :kind {key}
"""
# Waiters: pending, due steps of live runs that were refused recently (`blocked_at` is renewed
# at each refusal, at least every `republish_after_s`; a step nobody retries loses its place).
_WAITERS = """
    SELECT w.id, w.name, wr.kind, wr.version, wr.priority
      FROM engine.step w JOIN engine.task_run wr ON wr.id = w.run_id
     WHERE w.status = 'pending' AND w.blocked_at IS NOT NULL AND w.next_attempt_at <= now()
       AND w.blocked_at > now() - make_interval(secs => :fresh)
       AND wr.kind = :kind {key} AND wr.status IN ('pending', 'running', 'waiting')
       AND wr.cancel_requested_at IS NULL {better}
     ORDER BY wr.priority DESC, wr.created_at, wr.id, w.id
     LIMIT :n
"""
_BETTER = "AND (-wr.priority, wr.created_at, wr.id) < (-CAST(:prio AS int), :created, CAST(:run AS uuid))"


def _holders(s: Session, gate: Gate, run_id: uuid.UUID | None = None) -> tuple[int, bool]:
    """How many runs hold a slot of `gate`, and whether `run_id` is one of them."""
    key = "AND hr.concurrency_key = :key" if gate.scope == "key" else ""
    row = s.execute(text(_HOLDERS.format(key=key)), {"kind": gate.kind, "key": gate.key, "run": run_id}).one()
    return int(row.runs), bool(row.mine)


def _waiters(s: Session, gate: Gate, n: int, before: Any = None) -> list[Any]:
    """Blocked steps in line for `gate`, best first (priority desc, then the oldest run).

    For the global gate only steps refused by the global limit count: one refused by its own
    key could not use a global slot anyway.
    """
    if n <= 0:
        return []
    key = "AND wr.concurrency_key = :key" if gate.scope == "key" else "AND w.blocked_on = 'global'"
    params: dict[str, Any] = {"kind": gate.kind, "key": gate.key, "n": n, "fresh": blocked_fresh_s()}
    better = ""
    if before is not None:
        better = _BETTER
        params.update(prio=before.priority, created=before.created_at, run=before.run_id)
    return list(s.execute(text(_WAITERS.format(key=key, better=better)), params).all())


def blocked_fresh_s() -> float:
    """How long a refused step keeps its place in line without being retried."""
    return 3.0 * get_settings().republish_after_s + 2.0 * get_settings().sweep_interval_s


def _admit(s: Session, slot: Any, gates: list[Gate]) -> tuple[Denial | None, list[Dispatch]]:
    """Pass every gate, or say which one refused; also the better-ordered waiters to wake.

    Runs inside the claim transaction, before its UPDATE. The advisory lock (taken before any
    row lock, so claims never deadlock) serialises claims of one kind/key and is held to the
    commit, so the count sees every earlier claim. Releases need no lock: they only free slots.
    A slot goes to this step only if fewer better-ordered waiters than free slots are in line.
    """
    kicks: list[Dispatch] = []
    for gate in gates:
        s.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": gate.lock})
        held, mine = _holders(s, gate, slot.run_id)
        if mine:
            continue  # a sibling of this run holds the slot already
        if held >= gate.limit:
            return Denial(gate, held), kicks
        free = gate.limit - held
        better = _waiters(s, gate, free, before=slot)
        kicks += _wake(s, better)  # slots are free for them: do not wait for the sweeper
        if len(better) >= free:
            return Denial(gate, held), kicks
    return None, kicks


def _deny(s: Session, step_id: int, denial: Denial) -> list[Dispatch]:
    """Leave the step pending with its reason; no busy loop: it is retried by a hand-off, or
    by the sweeper after `republish_after_s` (its `published_at` is reset now)."""
    s.execute(
        text(
            "UPDATE engine.step SET blocked_reason = :reason, blocked_on = :scope, blocked_at = now(),"
            " published_at = now() WHERE id = :id AND (status = 'pending') IS TRUE"
        ),
        {"reason": denial.gate.reason(denial.held), "scope": denial.gate.scope, "id": step_id},
    )
    log.debug("step %s refused: %s", step_id, denial.gate.reason(denial.held))
    return []


def _wake(s: Session, rows: list[Any]) -> list[Dispatch]:
    """Send waiters a message now. A locked row is being claimed already: skip it, never wait."""
    if not rows:
        return []
    woken = set(
        s.scalars(
            text(
                "UPDATE engine.step SET published_at = now() WHERE id IN (SELECT id FROM engine.step "
                "WHERE id = ANY(:ids) AND (status = 'pending') IS TRUE FOR UPDATE SKIP LOCKED) RETURNING id"
            ),
            {"ids": [r.id for r in rows]},
        ).all()
    )
    return [
        dispatch.step_dispatch(r.id, r.kind, r.version, r.name, r.priority) for r in rows if r.id in woken
    ]


def handoff(s: Session, kind: Kind, concurrency_key: str | None) -> list[Dispatch]:
    """A holder of `kind`/`key` let go (commit, park, cancel, lease expiry): wake the head of
    the line for each freed slot so the order holds and the latency is a message, not a sweep."""
    heads: dict[int, Any] = {}
    for gate in limit_gates(kind, concurrency_key):
        for row in _waiters(s, gate, gate.limit - _holders(s, gate)[0]):
            heads.setdefault(row.id, row)
    return _wake(s, list(heads.values()))


# --------------------------------------------------------------------------------------------
# execute


def execute(
    step_id: int,
    starts_run: bool = False,
    more: Sequence[int] = (),
    task: tuple[str, str] | None = None,
) -> str:
    """Run one delivery of a step message, and the chain after it while the inline budget
    lasts; returns the outcome of the last step run (for logs and tests).

    `more`: the other steps of a batched message (`dispatch.batched`, mass wakes), run one
    after another, each claimed and committed as if it had its own message. Past
    `INLINE_BUDGET_S` the rest go back to the broker as one message (`task`: its name and
    queue), so one delivery never holds a worker slot much longer than an inline chain.
    """
    outcome = _deliver(step_id, starts_run)
    began = time.monotonic()
    rest = list(more)
    while rest:
        if time.monotonic() - began > get_settings().inline_budget_s and task is not None:
            name, queue = task
            dispatch.publish_after_commit([Dispatch(rest[0], name, queue, 0, tuple(rest[1:]))])
            break
        outcome = _deliver(rest.pop(0), starts_run)
    return outcome


def _deliver(step_id: int, starts_run: bool) -> str:
    """One step message's worth of work: claim, run, and the inline chain after it."""
    c, kicks = _claim(step_id, starts_run)
    dispatch.publish_after_commit(kicks)
    outcome = "noop"
    budget = InlineBudget()
    while c is not None:
        outcome, c = _run_claimed(c, budget)
    return outcome


def _run_claimed(c: Claim, budget: InlineBudget) -> tuple[str, Claim | None]:
    """One attempt of a claimed step: span, body, fenced commit, hand-off, publish.

    Lines logged during the attempt carry its run, kind, step, attempt and worker
    (`proj.logs`, `LOG_FORMAT=json`; `tests/integration/test_json_logs.py`)."""
    kind = get_kind(c.kind, c.version)
    carry = budget.carry(c, kind)
    fields = logs.StepFields(str(c.run_id), c.kind, c.name, c.attempt, worker_id())
    with (
        logs.step_fields(fields),
        tracing.step_span(
            c.trace,
            kind=c.kind,
            version=c.version,
            run_id=c.run_id,
            step=c.name,
            attempt=c.attempt,
            item_index=c.item_index if c.item is not None else None,
        ) as span,
    ):
        outcome, to_publish, error = _attempt(c, kind, carry)
        tracing.set_outcome(span, outcome, error)
    if limit_gates(kind, c.concurrency_key):
        try:
            with db.transaction() as s:
                to_publish = [*to_publish, *handoff(s, kind, c.concurrency_key)]
        except Exception as exc:  # the sweeper re-sends blocked steps anyway
            log.warning("hand-off after step %s failed: %s", c.step_id, exc)
    dispatch.publish_after_commit(to_publish)
    # Only a committed success carries on; otherwise a claimed next step (if its transaction
    # committed at all) is left to its lease and the sweeper.
    return outcome, carry.claim if carry is not None and outcome == "succeeded" else None


def _attempt(
    c: Claim, kind: Kind, carry: Carry | None = None
) -> tuple[str, list[Dispatch], BaseException | None]:
    """Body (or wait check) and its fenced commit, under the heartbeat."""
    sdef = kind.step_def(c.name)
    ctx = StepContext(
        run_id=c.run_id,
        kind=kind,
        raw_input=c.input,
        step_id=c.step_id,
        step=c.name,
        stage=c.stage,
        attempt=c.attempt,
        item=c.item,
        item_index=c.item_index,
    )
    outcome = "noop"
    to_publish: list[Dispatch] = []
    error: BaseException | None = None
    with HEARTBEAT.track(c.step_id, c.token) as lease:
        ctx.lease = lease
        try:
            if sdef.wait is not None:
                outcome, to_publish = _run_wait(c, ctx, kind, sdef.wait, carry)
            else:
                assert sdef.fn is not None
                ctx.commit_hook = lambda session, result: commit_success(c, kind, result, session, carry)
                result = sdef.fn(ctx)
                if ctx.finished is not None:
                    to_publish = ctx.finished
                else:
                    to_publish = commit_success(c, kind, result, carry=carry)
                outcome = "succeeded"
        except LeaseLost as exc:
            log.warning("step %s attempt %s: %s", c.step_id, c.attempt, exc)
            outcome, error = "lease_lost", exc
        except CancelRequested:
            outcome, to_publish = _commit_or_refuse(commit_canceled, c)
        except Exception as exc:
            policy = kind.policy_for(sdef)
            outcome, to_publish = _commit_or_refuse(commit_failure, c, policy, exc)
            error = exc
    return outcome, to_publish, error


def _commit_or_refuse(
    fn: Callable[..., tuple[str, list[Dispatch]]], *args: Any
) -> tuple[str, list[Dispatch]]:
    try:
        return fn(*args)
    except LeaseLost as exc:
        log.warning("commit refused: %s", exc)
        return "lease_lost", []


# --------------------------------------------------------------------------------------------
# commits (all fenced by the lease token)


def commit_success(
    c: Claim, kind: Kind, result: Any, session: Session | None = None, carry: Carry | None = None
) -> list[Dispatch]:
    """Store the result and advance the run, or refuse if the lease is gone.

    With `session` (from `StepContext.finish`), it joins the body's business transaction so
    the writes and the result commit together. With `carry`, a single next step is claimed in
    the same transaction for this process to run (`Carry`).
    """
    payload = to_json(result)
    if session is not None:
        return _succeed(session, c, payload, carry)
    alone = _commit_alone(c, kind, payload, carry)
    if alone is not None:
        return alone
    with db.transaction() as s:
        return _succeed(s, c, payload, carry)


def _succeed(s: Session, c: Claim, payload: str, carry: Carry | None = None) -> list[Dispatch]:
    run = s.execute(_SUCCEED, {"id": c.step_id, "tok": c.token, "result": payload}).first()
    if run is None:
        raise LeaseLost(f"step {c.step_id} attempt {c.attempt}: lease lost, result refused")
    return advance(s, c.run_id, run=run, stage=c.stage, carry=carry)


def commit_failure(c: Claim, policy: RetryPolicy, exc: BaseException) -> tuple[str, list[Dispatch]]:
    """Schedule the next attempt with backoff, or fail the run when attempts are exhausted."""
    err = error_payload(exc)
    final = isinstance(exc, NonRetryable) or c.attempt >= min(c.max_attempts, policy.max_attempts)
    delay = 0.0 if final else policy.backoff(c.attempt)
    with db.transaction() as s:
        row = s.execute(
            text(
                """
                UPDATE engine.step
                   SET status = CASE WHEN :final THEN 'failed' ELSE 'pending' END,
                       next_attempt_at = now() + make_interval(secs => :delay),
                       error = CAST(:err AS jsonb), lease_token = NULL, lease_until = NULL,
                       published_at = NULL,
                       finished_at = CASE WHEN :final THEN now() ELSE NULL END
                 WHERE id = :id AND lease_token = :tok AND status = 'running'
             RETURNING id
                """
            ),
            {
                "final": final,
                "delay": delay,
                "err": json.dumps(err),
                "id": c.step_id,
                "tok": c.token,
            },
        ).first()
        if row is None:
            raise LeaseLost(f"step {c.step_id} attempt {c.attempt}: lease lost, failure not recorded")
        _close_attempt(s, c, "failed" if final else "retry", err)
        if final:
            fail_run(s, c.run_id, {**err, "step": c.name, "attempts": c.attempt})
            return "failed", []
        s.execute(
            text(
                "UPDATE engine.task_run SET last_error = CAST(:err AS jsonb), updated_at = now() "
                "WHERE id = :run"
            ),
            {"err": json.dumps({**err, "step": c.name, "attempts": c.attempt}), "run": c.run_id},
        )
    log.info("step %s attempt %s failed, retry in %.1fs: %s", c.step_id, c.attempt, delay, exc)
    return "retry", []


def commit_canceled(c: Claim) -> tuple[str, list[Dispatch]]:
    """The body stopped itself on a cancel request: close the step, then finish the cancel."""
    with db.transaction() as s:
        row = s.execute(
            text(
                "UPDATE engine.step SET status = 'canceled', lease_token = NULL, lease_until = NULL,"
                " finished_at = now() WHERE id = :id AND lease_token = :tok AND status = 'running' "
                "RETURNING id"
            ),
            {"id": c.step_id, "tok": c.token},
        ).first()
        if row is None:
            raise LeaseLost(f"step {c.step_id}: lease lost, cancel not recorded")
        _close_attempt(s, c, "canceled")
        return "canceled", finalize_cancel(s, c.run_id)


def _close_attempt(s: Session, c: Claim, outcome: str, err: dict[str, Any] | None = None) -> None:
    s.execute(
        _CLOSE_ATTEMPT,
        {
            "outcome": outcome,
            "error": json.dumps(err) if err else None,
            "id": c.step_id,
            "tok": c.token,
        },
    )


def fail_run(s: Session, run_id: uuid.UUID, err: dict[str, Any]) -> None:
    """The run becomes a dead letter: `failed` with its error; pending siblings stop."""
    run = s.execute(
        text(
            "UPDATE engine.task_run SET status = 'failed', last_error = CAST(:err AS jsonb), "
            "finished_at = now(), updated_at = now() WHERE id = :run AND status NOT IN "
            "('succeeded', 'failed', 'canceled') "
            "RETURNING id, kind, version, trace, created_at, finished_at"
        ),
        {"err": json.dumps(err), "run": run_id},
    ).first()
    if run is not None:
        tracing.run_finished(s, run, "failed", run.finished_at)


# --------------------------------------------------------------------------------------------
# advancing the chain


def advance(
    s: Session, run_id: uuid.UUID, *, run: Any = None, stage: int | None = None, carry: Carry | None = None
) -> list[Dispatch]:
    """After a step committed: if its stage is complete, start the next one or finish the run.

    The run row lock serialises the fan-in, so exactly one committer advances a stage. `run` is
    the run row when the caller locked it already; `stage` the stage of the step it committed.
    """
    if run is None:
        run = s.execute(
            text(
                "SELECT id, kind, version, input, status, current_stage, cancel_requested_at, "
                "priority, trace, created_at FROM engine.task_run WHERE id = :id FOR UPDATE"
            ),
            {"id": run_id},
        ).first()
    if run is None or run.status in TERMINAL:
        return []
    kind = get_kind(run.kind, run.version)
    current = kind.canvas[run.current_stage] if run.current_stage < len(kind.canvas) else None
    # A stage of one static step has one row ((run_id, stage, item_index) is unique): if the
    # caller just committed it, nothing is left open and the count can be skipped.
    sole = current is not None and current.single
    if not (sole and stage == run.current_stage):
        # A statement of its own, after the lock: its snapshot sees every committed sibling.
        open_steps = s.scalar(
            text(
                "SELECT count(*) FROM engine.step WHERE run_id = :id AND stage = :stage "
                "AND status <> 'succeeded'"
            ),
            {"id": run_id, "stage": run.current_stage},
        )
        if open_steps:
            return []
    if run.cancel_requested_at is not None:
        return finalize_cancel(s, run_id)
    plan = PlanContext(run_id=run_id, kind=kind, raw_input=run.input, _session=s)
    stage = run.current_stage + 1
    while stage < len(kind.canvas):
        has_steps, created = create_stage(s, run_id, kind, stage, plan, priority=run.priority, carry=carry)
        if has_steps:
            return created
        stage += 1  # an empty fan-out: nothing to wait for
    last = kind.canvas[-1]
    result = plan.result(last.steps[-1].name) if len(last.steps) == 1 else None
    finished_at = s.scalar(
        text(
            "UPDATE engine.task_run SET status = 'succeeded', result = CAST(:r AS jsonb), "
            "current_stage = :stage, current_step = NULL, finished_at = now(), updated_at = now() "
            "WHERE id = :id RETURNING finished_at"
        ),
        {"r": to_json(result), "stage": len(kind.canvas), "id": run_id},
    )
    tracing.run_finished(s, run, "succeeded", finished_at)
    return []


# A stage's step rows from the arrays of `stage_rows`; rows that exist already are left alone.
# `{run}` names the run: the parameter, or `run.id` of a combined statement that has just
# inserted it (`{runs}` = "run," then: nothing is inserted if it inserted nothing).
STAGE_STEPS = """
        INSERT INTO engine.step (run_id, stage, name, item_index, item, max_attempts,
                                 next_attempt_at, published_at)
        SELECT {run}, :stage, n.name, n.idx, CAST(n.item AS jsonb), n.max,
               coalesce(:at, now()), CASE WHEN :due THEN now() END
          FROM {runs} unnest(CAST(:names AS text[]), CAST(:idxs AS int[]), CAST(:items AS text[]),
                      CAST(:maxs AS int[])) AS n(name, idx, item, max)
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, name, item_index"""
# A stage's step rows and the run pointer in one statement (a data-modifying CTE always runs, so
# an empty fan-out still moves the pointer).
_CREATE_STAGE = text(
    "WITH ins AS ("
    + STAGE_STEPS.format(run=":run", runs="")
    + """
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :stage, current_step = :label, updated_at = now()
         WHERE id = :run
    )
    SELECT id, name FROM ins ORDER BY item_index
    """
)


# The next stage's one step, inserted claimed for the committing process (`Carry`): the step row,
# the run pointer and the attempt record. `{source}` is empty in a transaction that locked the run
# already (one row), or `FROM done` inside a one-statement commit (a row only if it committed).
_NEXT_CLAIMED = """
    ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, next_attempt_at,
                                 published_at, status, lease_token, lease_owner, lease_until,
                                 attempts, started_at)
        SELECT :run, :next_stage, :next_name, 0, :next_max, now(), now(), 'running', :next_tok,
               :owner, now() + make_interval(secs => :ttl), 1, now()
          {source}
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, now() AS claimed_at
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :next_stage, current_step = :next_label,
               updated_at = now()
         WHERE id = :run {guard}
    ), attempt AS (
        INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker)
        SELECT id, 1, :next_tok, :owner FROM ins
    )"""
_CLAIM_NEXT = text("WITH" + _NEXT_CLAIMED.format(source="", guard="") + " SELECT id, claimed_at FROM ins")


def _next_params(carry: Carry, kind: Kind, stage: int) -> dict[str, Any]:
    sdef = kind.canvas[stage].steps[0]
    return {
        "run": carry.parent.run_id,
        "next_stage": stage,
        "next_name": sdef.name,
        "next_label": kind.canvas[stage].label,
        "next_max": kind.policy_for(sdef).max_attempts,
        "next_tok": carry.token,
        "owner": worker_id(),
        "ttl": get_settings().lease_ttl_s,
    }


def _carried(carry: Carry, params: dict[str, Any], step_id: int, claimed_at: datetime) -> None:
    """The claim of the step inserted under `carry.token`, for this process to run next."""
    carry.claim = replace(
        carry.parent,
        step_id=step_id,
        stage=params["next_stage"],
        name=params["next_name"],
        item_index=0,
        item=None,
        attempt=1,
        max_attempts=params["next_max"],
        claimed_at=claimed_at,
        token=carry.token,
    )


def _claim_next(s: Session, carry: Carry, kind: Kind, stage: int) -> bool:
    """Insert `stage`'s single step already claimed under `carry.token`; False if it exists."""
    params = _next_params(carry, kind, stage)
    row = s.execute(_CLAIM_NEXT, params).first()
    if row is None:
        return False
    _carried(carry, params, row.id, row.claimed_at)
    return True


# A linear chain's commit as one statement (`_commit_alone`): the fenced succeed, the run row
# lock (after the step's, the protocol's lock order) and the run's next move. `run` holds a row
# only if the run is where a plain advance expects it; otherwise nothing is written.
_ALONE_HEAD = (
    """
    WITH me AS MATERIALIZED (
        SELECT id, run_id FROM engine.step
         WHERE id = :id AND lease_token = :tok AND status = 'running'
           FOR UPDATE
    ), run AS MATERIALIZED (
        SELECT r.id FROM engine.task_run r JOIN me ON r.id = me.run_id
         WHERE r.current_stage = :stage AND r.cancel_requested_at IS NULL
           AND r.status NOT IN ('succeeded', 'failed', 'canceled')
           FOR UPDATE OF r
    ),"""
    + _STEP_SUCCEEDED.format(source="FROM run")
    + ","
)
_SUCCEED_AND_CLAIM_NEXT = text(
    _ALONE_HEAD
    + _NEXT_CLAIMED.format(source="FROM done", guard="AND EXISTS (SELECT FROM done)")
    + " SELECT done.id, ins.id AS next_id, ins.claimed_at FROM done LEFT JOIN ins ON true"
)
_SUCCEED_AND_FINISH = text(
    _ALONE_HEAD
    + """
    finished AS (
        UPDATE engine.task_run t
           SET status = 'succeeded', result = CAST(:result AS jsonb), current_stage = :end_stage,
               current_step = NULL, finished_at = now(), updated_at = now()
          FROM done WHERE t.id = done.run_id
     RETURNING t.id, t.kind, t.version, t.trace, t.created_at, t.finished_at
    )
    SELECT * FROM finished"""
)


def _commit_alone(c: Claim, kind: Kind, payload: str, carry: Carry | None) -> list[Dispatch] | None:
    """The commit of a linear chain's step in one statement, in autocommit: one round trip
    instead of four (BEGIN, succeed, advance, COMMIT), most of an inline step's cost.

    It applies when the step is its stage's only one and either the next stage is one plain step
    for this process to run (`carry`) or there is none and the run succeeds with this result.
    None: another shape, or the run is not as a plain advance expects (a cancel asked, the lease
    lost); nothing was written and the caller takes the general path, which sorts those out.
    """
    here = kind.canvas[c.stage]
    if not here.single:
        return None
    params: dict[str, Any] = {"id": c.step_id, "tok": c.token, "stage": c.stage, "result": payload}
    following = c.stage + 1
    if following == len(kind.canvas):
        with db.autocommit() as conn:
            run = conn.first(_SUCCEED_AND_FINISH, {**params, "end_stage": following})
        if run is None:
            return None
        tracing.run_span(run, "succeeded", run.finished_at)
        return []
    nxt = kind.canvas[following]
    if carry is None or not nxt.single:
        return None
    params |= _next_params(carry, kind, following)
    with db.autocommit() as conn:
        row = conn.first(_SUCCEED_AND_CLAIM_NEXT, params)
    if row is None:
        return None
    if row.next_id is not None:
        _carried(carry, params, row.next_id, row.claimed_at)
    return []


def create_stage(
    s: Session,
    run_id: uuid.UUID,
    kind: Kind,
    stage: int,
    plan: PlanContext,
    *,
    available_at: datetime | None = None,
    priority: int = 0,
    carry: Carry | None = None,
) -> tuple[bool, list[Dispatch]]:
    """Insert the step rows of `stage` and point the run at it.

    Returns whether the stage has any step (an empty fan-out has none) and what to publish now.
    A stage of one plain step under `carry` is inserted claimed instead, and published never.
    """
    st = kind.canvas[stage]
    inline = carry is not None and carry.parent.run_id == run_id and available_at is None
    if carry is not None and inline and st.single and _claim_next(s, carry, kind, stage):
        return True, []
    rows = stage_rows(kind, stage, plan)
    due_now = available_at is None
    inserted = s.execute(
        _CREATE_STAGE,
        {"run": run_id, "stage": stage, "label": st.label, **rows, "at": available_at, "due": due_now},
    ).all()
    return bool(rows["names"]), stage_dispatches(kind, inserted, priority) if due_now else []


def stage_dispatches(kind: Kind, inserted: Sequence[Any], priority: int) -> list[Dispatch]:
    """The messages for step rows a stage insert returned (`id`, `name`)."""
    return [dispatch.step_dispatch(r.id, kind.name, kind.version, r.name, priority) for r in inserted]


def stage_rows(kind: Kind, stage: int, plan: PlanContext) -> dict[str, list[Any]]:
    """The step rows of `stage` as the array parameters of `_CREATE_STAGE`: one per static
    step, or one per item of a fan-out (none for an empty one)."""
    st = kind.canvas[stage]
    rows: list[tuple[StepDef, int, str | None]]
    if st.over is not None:
        items = list(st.over(plan))
        rows = [(st.steps[0], i, to_json(item)) for i, item in enumerate(items)]
    else:
        rows = [(sd, i, None) for i, sd in enumerate(st.steps)]
    return {
        "names": [sd.name for sd, _, _ in rows],
        "idxs": [index for _, index, _ in rows],
        "items": [item for _, _, item in rows],
        "maxs": [kind.policy_for(sd).max_attempts for sd, _, _ in rows],
    }


# --------------------------------------------------------------------------------------------
# cancel


def finalize_cancel(s: Session, run_id: uuid.UUID) -> list[Dispatch]:
    """Mark a cancel-requested run `canceled` once no step runs; enqueue its compensation."""
    run = s.execute(
        text(
            "SELECT id, kind, version, input, status, cancel_reason, trace, created_at "
            "FROM engine.task_run WHERE id = :id FOR UPDATE"
        ),
        {"id": run_id},
    ).first()
    if run is None or run.status in TERMINAL:
        return []
    running = s.scalar(
        text(
            "SELECT count(*) FROM engine.step WHERE run_id = :id AND status = 'running' "
            "AND lease_until > now()"
        ),
        {"id": run_id},
    )
    if running:
        return []
    s.execute(
        text(
            "UPDATE engine.step SET status = 'canceled', lease_token = NULL, finished_at = now() "
            "WHERE run_id = :id AND status IN ('pending', 'waiting', 'running')"
        ),
        {"id": run_id},
    )
    finished_at = s.scalar(
        text(
            "UPDATE engine.task_run SET status = 'canceled', finished_at = now(), updated_at = now()"
            " WHERE id = :id RETURNING finished_at"
        ),
        {"id": run_id},
    )
    tracing.run_finished(s, run, "canceled", finished_at)
    return enqueue_compensation(s, run)


def enqueue_compensation(s: Session, run: Any) -> list[Dispatch]:
    """Compensation is an explicit kind, enqueued once (idempotent key) in the same transaction."""
    kind = get_kind(run.kind, run.version)
    if kind.compensation is None:
        return []
    from proj.engine import runs

    payload = (
        kind.compensation_input(run.id, run.input)
        if kind.compensation_input is not None
        else {"run_id": str(run.id), "kind": run.kind, "input": run.input}
    )
    _ref, out = runs.insert_run(s, kind.compensation, payload, idempotency_key=f"compensate:{run.id}")
    return out


# --------------------------------------------------------------------------------------------
# waits (invariant 7)


def _run_wait(
    c: Claim, ctx: StepContext, kind: Kind, spec: WaitSpec, carry: Carry | None = None
) -> tuple[str, list[Dispatch]]:
    """Check the business truth; commit if it holds, otherwise park the run on its topic.

    A wait that holds continues inline like any committed step (`carry`): a mass wake's next
    steps run in the delivery that re-checked, not after another trip through the broker.
    """
    topic = spec.topic(ctx)
    if spec.until is not None:
        until = spec.until(ctx)
        with db.transaction() as s:
            reached = bool(s.scalar(text("SELECT now() >= :u"), {"u": until}))
        if reached:
            return "succeeded", commit_success(c, kind, {"slept_until": until.isoformat()}, carry=carry)
        return park(c, topic, until=until)
    if spec.check is not None:
        value = spec.check(ctx)
        if value:
            return "succeeded", commit_success(c, kind, value, carry=carry)
    else:
        with db.transaction() as s:
            sig = s.execute(
                text("SELECT payload FROM engine.task_signal WHERE topic = :t ORDER BY id DESC LIMIT 1"),
                {"t": topic},
            ).first()
        if sig is not None:
            return "succeeded", commit_success(c, kind, {"signal": sig.payload}, carry=carry)
    timeout = spec.timeout_s(ctx) if callable(spec.timeout_s) else spec.timeout_s
    return park(c, topic, timeout_s=timeout)


def park(
    c: Claim, topic: str, *, timeout_s: float | None = None, until: datetime | None = None
) -> tuple[str, list[Dispatch]]:
    """Free the worker: the step waits in Postgres for a signal or its timer.

    Under the topic's advisory lock, a signal stored since this check started sends the step
    straight back to work, so a signal racing the park is never lost. Waiting gives the attempt
    back: it does not count against the retry policy.
    """
    with db.transaction() as s:
        s.execute(text("SELECT pg_advisory_xact_lock(hashtext(:t))"), {"t": topic})
        raced = s.scalar(
            text(
                "SELECT EXISTS (SELECT 1 FROM engine.task_signal WHERE topic = :t AND created_at >= :since)"
            ),
            {"t": topic, "since": c.claimed_at},
        )
        row = s.execute(
            text(
                """
                UPDATE engine.step
                   SET status = CASE WHEN :raced THEN 'pending' ELSE 'waiting' END,
                       attempts = attempts - 1, wakeups = wakeups + 1,
                       wait_topic = :t, wait_since = :since,
                       wait_until = coalesce(:until, now() + make_interval(secs => :timeout)),
                       next_attempt_at = now(), lease_token = NULL, lease_until = NULL,
                       published_at = CASE WHEN :raced THEN now() END
                 WHERE id = :id AND lease_token = :tok AND status = 'running'
             RETURNING id
                """
            ),
            {
                "raced": bool(raced),
                "t": topic,
                "since": c.claimed_at,
                "until": until,
                "timeout": timeout_s or 0.0,
                "id": c.step_id,
                "tok": c.token,
            },
        ).first()
        if row is None:
            raise LeaseLost(f"step {c.step_id}: lease lost while parking")
        _close_attempt(s, c, "parked")
        if raced:
            return "rechecking", [dispatch.step_dispatch(c.step_id, c.kind, c.version, c.name)]
        s.execute(
            text(
                "UPDATE engine.task_run SET status = 'waiting', updated_at = now() "
                "WHERE id = :run AND status = 'running' AND NOT EXISTS (SELECT 1 FROM engine.step "
                "WHERE run_id = :run AND status IN ('running', 'pending'))"
            ),
            {"run": c.run_id},
        )
    return "waiting", []
