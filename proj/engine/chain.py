"""Advancing a run along its canvas: a run's first stage at enqueue, the next stage once a stage
completes (the fan-in is counted under the run row lock), the inline carry of a linear chain,
the end of a run (succeeded, or canceled with its compensation). Statements:
`proj.engine.store.stages`, `proj.engine.store.commits` (the one-statement commits) and
`proj.engine.store.cancels`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, NamedTuple

from opentelemetry.trace import Span
from sqlalchemy.orm import Session

from proj import db
from proj.engine import dispatch, tracing
from proj.engine.attempts import Carry, Claim, Committed, to_json, worker_id
from proj.engine.context import PlanContext
from proj.engine.dispatch import Dispatch
from proj.engine.errors import IdempotencyConflict, InvalidInput, UnknownKind
from proj.engine.heartbeat import lock_idle_ms
from proj.engine.inputs import canonical_input, check_key
from proj.engine.kind import Kind, StepDef, get_kind
from proj.engine.port import TaskRunRef
from proj.engine.status import TERMINAL, RunStatus
from proj.engine.store import cancels as cancels_store
from proj.engine.store import children as children_store
from proj.engine.store import commits as commits_store
from proj.engine.store import stages as store
from proj.engine.store import waits as waits_store
from proj.engine.store.rows import StepRef
from proj.settings import get_settings

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# a new run and its first stage


def insert_run(
    s: Session,
    kind_name: str,
    input: Mapping[str, Any],
    *,
    idempotency_key: str,
    available_at: datetime | None = None,
    priority: int = 0,
    trace: Mapping[str, Any] | None = None,
    version: int | None = None,
    deadline_at: datetime | None = None,
    parent_run_id: uuid.UUID | None = None,
    inherited_deadline: datetime | None = None,
) -> tuple[TaskRunRef, list[Dispatch]]:
    """Create the run and its first stage inside the caller's transaction (or find its twin).

    `deadline_at` (or the kind's `deadline_s`, counted from now) is when the run must be done:
    past it no step starts, and the run ends `failed` with `DeadlineExceeded`. A deadline that
    has passed already is bad input; the run's deadline is the earliest of the two. `parent_run_id`:
    the run whose child step enqueues this one, whose deadline (`inherited_deadline`) binds it too.

    `version` pins an older version (an old build still enqueuing during a rollout); by default
    a run starts on the newest version this process knows, and keeps it to the end.
    `priority` (higher first, FIFO within one priority) orders the start of a kind's pending
    runs: in the admission line of a limited kind, by the claim of the start step otherwise
    (`store.claims.claim_start`, whatever order the broker delivers in), and the sweeper's
    re-sends. `trace` is a W3C carrier to parent the run's trace on; by default the caller's
    current span is the parent.
    """
    check_options(available_at, priority, deadline_at)
    kind = get_kind(kind_name, version)
    item = _prepare(kind, input, idempotency_key)
    run_id = uuid.uuid4()
    with tracing.enqueue_span(kind.name, kind.version, run_id, parent=trace) as (span, carrier):
        new = _new_run(
            kind,
            item,
            run_id,
            available_at,
            priority,
            carrier,
            deadline_at,
            parent_run_id=parent_run_id,
            inherited_deadline=inherited_deadline,
        )
        plan = _plan(s, kind, item, run_id)
        first = stage_rows(kind, 0, plan)
        steps = store.insert_run(s, new, first, due=available_at is None)
        found = steps if steps is not None else store.existing_runs(s, kind.name, [item.key])[item.key]
        ref, out = _inserted(s, kind, new, plan, first, found)
        _end_enqueue_span(span, ref)
    return ref, out


# Runs per `INSERT_RUNS` statement in a batch: a batch of any size is written in statements of
# a bounded size (and memory), all in the caller's transaction.
BATCH_ROWS = 1000


def insert_runs(
    s: Session,
    kind_name: str,
    items: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    available_at: datetime | None = None,
    priority: int = 0,
    trace: Mapping[str, Any] | None = None,
    deadline_at: datetime | None = None,
) -> tuple[list[TaskRunRef], list[Dispatch]]:
    """`insert_run` for each `(idempotency_key, input)` of `items`, with the same options, inside
    the caller's transaction: one ref per item, in order, and the messages to publish after it.

    Why: a batch costs one statement (`store.insert_runs`) instead of one round trip per run, so
    200 runs are written in 15 ms instead of 90 ms, and workers start that much sooner
    (`bench.throughput`). Every item is checked before anything is written; a key whose stored
    run has another input (`IdempotencyConflict`) fails the batch, and the caller's transaction
    rolls back. A key given twice names one run: the later item gets it with `created=False`
    (`tests/integration/test_enqueue_many.py`).
    """
    check_options(available_at, priority, deadline_at)
    kind = get_kind(kind_name, None)
    pairs = list(items)  # a generator is read once
    if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
        raise InvalidInput("items must be (idempotency_key, input) pairs")
    prepared = [_prepare(kind, input, key) for key, input in pairs]
    run_ids = [uuid.uuid4() for _ in prepared]
    with tracing.enqueue_spans(kind.name, kind.version, run_ids, parent=trace) as spans:
        news = [
            _new_run(kind, item, run_id, available_at, priority, carrier, deadline_at)
            for item, run_id, (_, carrier) in zip(prepared, run_ids, spans, strict=True)
        ]
        plans = [_plan(s, kind, item, run_id) for item, run_id in zip(prepared, run_ids, strict=True)]
        firsts = [stage_rows(kind, 0, plan) for plan in plans]
        inserted: dict[uuid.UUID, list[StepRef]] = {}
        for at in range(0, len(news), BATCH_ROWS):  # statements of bounded size, one transaction
            chunk = slice(at, at + BATCH_ROWS)
            inserted |= store.insert_runs(s, news[chunk], firsts[chunk], due=available_at is None)
        taken = [new.idempotency_key for new in news if new.run_id not in inserted]
        existing = store.existing_runs(s, kind.name, taken)  # one lookup for every taken key
        refs: list[TaskRunRef] = []
        out: list[Dispatch] = []
        for new, plan, first, (span, _) in zip(news, plans, firsts, spans, strict=True):
            steps = inserted.get(new.run_id)
            found = steps if steps is not None else existing[new.idempotency_key]
            ref, sent = _inserted(s, kind, new, plan, first, found)
            _end_enqueue_span(span, ref)
            refs.append(ref)
            out.extend(sent)
    return refs, out


def check_options(available_at: datetime | None, priority: int, deadline_at: datetime | None) -> None:
    """Bad input in a run's options raises `InvalidInput` before anything is written."""
    if available_at is not None and not isinstance(available_at, datetime):
        raise InvalidInput(f"available_at must be a datetime or None, not {type(available_at).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) < priority < 2**31:
        raise InvalidInput(f"priority must be a 32-bit integer, not {priority!r}")
    if deadline_at is not None:
        if not isinstance(deadline_at, datetime) or deadline_at.tzinfo is None:
            raise InvalidInput(f"deadline_at must be a timezone-aware datetime, not {deadline_at!r}")
        if deadline_at <= datetime.now(UTC):
            raise InvalidInput(f"deadline_at {deadline_at.isoformat()} is in the past")


class _Item(NamedTuple):
    """One run to enqueue, checked: its key, its input validated and canonical, the input's
    digest and the run's concurrency key."""

    key: str
    stored: dict[str, Any]
    digest: str
    ckey: str | None


def _prepare(kind: Kind, input: Mapping[str, Any], idempotency_key: str) -> _Item:
    check_key(idempotency_key)
    stored, digest = canonical_input(kind, input)
    ckey = kind.concurrency_key(kind.input_model.model_validate(stored)) if kind.concurrency_key else None
    return _Item(idempotency_key, stored, digest, None if ckey is None else str(ckey))


def _plan(s: Session, kind: Kind, item: _Item, run_id: uuid.UUID) -> PlanContext:
    return PlanContext(run_id=run_id, kind=kind, raw_input=item.stored, _session=s)


def _new_run(
    kind: Kind,
    item: _Item,
    run_id: uuid.UUID,
    available_at: datetime | None,
    priority: int,
    trace: Mapping[str, Any] | None,
    deadline_at: datetime | None,
    *,
    parent_run_id: uuid.UUID | None = None,
    inherited_deadline: datetime | None = None,
) -> store.NewRun:
    """The run's row (a parent only for a child run: `insert_run`)."""
    return store.NewRun(
        run_id=run_id,
        kind=kind.name,
        version=kind.version,
        idempotency_key=item.key,
        input_json=json.dumps(item.stored),
        input_hash=item.digest,
        priority=priority,
        concurrency_key=item.ckey,
        available_at=available_at,
        trace_json=json.dumps(dict(trace)) if trace else None,
        label=kind.canvas[0].label,
        parent_run_id=parent_run_id,
        deadline_at=deadline_at,
        inherited_deadline=inherited_deadline,
        deadline_s=kind.deadline_s,
    )


def _inserted(
    s: Session,
    kind: Kind,
    new: store.NewRun,
    plan: PlanContext,
    first: store.StageRows,
    found: list[StepRef] | store.ExistingRun,
) -> tuple[TaskRunRef, list[Dispatch]]:
    """What the insert of `new` came to: the new run and the messages of its first stage with
    steps (`found`: the steps inserted), or its twin when the key named a run already (`found`:
    that run; `IdempotencyConflict` if its input differs)."""
    if isinstance(found, store.ExistingRun):
        if found.input_hash != new.input_hash:
            raise IdempotencyConflict(kind.name, new.idempotency_key, found.id)
        return TaskRunRef(found.id, created=False), []
    steps = found
    ref = TaskRunRef(new.run_id, created=True)
    if first.names:
        out = stage_dispatches(kind, steps, new.priority) if new.available_at is None else []
        # With held siblings, item 0 starts the run; the rest go out when it is claimed.
        return ref, out[:1] if kind.holds_start_siblings else out
    for stage in range(1, len(kind.canvas)):  # the first stage was an empty fan-out
        has_steps, out, _ = create_stage(
            s, new.run_id, kind, stage, plan, available_at=new.available_at, priority=new.priority
        )
        if has_steps:
            return ref, out
    return ref, finish_run(s, new.run_id, kind, None)  # every stage was an empty fan-out


def _end_enqueue_span(span: Span, ref: TaskRunRef) -> None:
    span.set_attribute("engine.created", ref.created)
    if not ref.created:
        span.set_attribute("engine.run_id", str(ref.task_run_id))


# --------------------------------------------------------------------------------------------
# advancing the chain


def advance(
    s: Session,
    run_id: uuid.UUID,
    *,
    run: store.LockedRun | None = None,
    stage: int | None = None,
    carry: Carry | None = None,
) -> Committed:
    """After a step committed: if its stage is complete, start the next one or finish the run.

    The run row lock serialises the fan-in, so exactly one committer advances a stage. `run` is
    the run row when the caller locked it already; `stage` the stage of the step it committed.
    Under `carry`, a next stage of one plain step comes back claimed (`Committed.next`).
    """
    if run is None:
        run = store.lock_run(s, run_id)
    if run is None or run.status in TERMINAL:
        return Committed([])
    kind = get_kind(run.kind, run.version)
    current = kind.canvas[run.current_stage] if run.current_stage < len(kind.canvas) else None
    # A stage of one static step has one row ((run_id, stage, item_index) is unique): if the
    # caller just committed it, nothing is left open and the count can be skipped.
    sole = current is not None and current.single
    counted = not (sole and stage == run.current_stage)
    if counted:
        left = store.open_in_stage(s, run_id, run.current_stage)
        if left.open and run.cancel_requested_at is not None:
            # The last running step of a canceling run just committed: its open siblings
            # (pending, parked) are canceled with the run now, not at the next sweep
            # (`tests/integration/test_step_path_review.py::
            # test_a_cancel_asked_while_a_fan_out_item_runs_ends_the_run_at_that_items_commit`).
            return Committed(finalize_cancel(s, run_id))
        if left.open:
            if left.parked == left.open and run.status == RunStatus.RUNNING:
                # The step just committed was the last one running: its siblings are parked (a
                # fan-out of child runs), so the run is `waiting` until one of them is woken, as
                # a park leaves it (`tests/integration/test_step_path_review.py::
                # test_a_fan_out_item_that_succeeds_while_its_siblings_are_parked_leaves_the_run_waiting`).
                waits_store.run_waiting_locked(s, run_id)
            return Committed([])
    if run.cancel_requested_at is not None:
        return Committed(finalize_cancel(s, run_id))
    plan = PlanContext(run_id=run_id, kind=kind, raw_input=run.input, _session=s)
    stage = run.current_stage + 1
    if stage < len(kind.canvas) and run.past_deadline:  # no further step starts
        return Committed(expire_run(s, run_id))
    while stage < len(kind.canvas):
        has_steps, created, claimed = create_stage(
            s, run_id, kind, stage, plan, priority=run.priority, carry=carry
        )
        if has_steps:
            return Committed(created, claimed)
        stage += 1  # an empty fan-out: nothing to wait for
    last = kind.canvas[-1]
    result = plan.result(last.steps[-1].name) if len(last.steps) == 1 else None
    return Committed(finish_run(s, run_id, kind, result))


def finish_run(s: Session, run_id: uuid.UUID, kind: Kind, result: Any) -> list[Dispatch]:
    """The run succeeded with `result` (the last stage's single step's, or None); its span goes
    out after commit. The one-statement commit (`commit_alone`) is the only other way a run
    succeeds, and writes the same columns (for a run without a parent). A child run wakes its
    parent's parked step here: the messages are returned."""
    run = store.finish_run(s, run_id, result=to_json(result), end_stage=len(kind.canvas))
    if run is None:
        return []
    tracing.run_finished(s, run, RunStatus.SUCCEEDED, run.finished_at)
    return notify_parent(s, run_id, run.parent_run_id, RunStatus.SUCCEEDED)


def notify_parent(
    s: Session, run_id: uuid.UUID, parent_run_id: uuid.UUID | None, status: RunStatus
) -> list[Dispatch]:
    """A child run finished: store `run-finished:<id>` and wake the parent step parked on it, in
    the finishing transaction (under the topic lock, as `runs.signal` does, so a park racing it
    sees the child finished). Runs without a parent store nothing."""
    if parent_run_id is None:
        return []
    topic = children_store.finished_topic(run_id)
    waits_store.lock_topic(s, topic, idle_ms=lock_idle_ms())
    waits_store.store_signal(s, topic, json.dumps({"run_id": str(run_id), "status": status}))
    return [
        dispatch.step_dispatch(w.id, w.kind, w.version, w.name, w.priority)
        for w in waits_store.wake_topic(s, topic)
    ]


def expire_run(s: Session, run_id: uuid.UUID, err: Mapping[str, Any] | None = None) -> list[Dispatch]:
    """The run passed its deadline: `failed` with `DeadlineExceeded`, its open steps canceled
    (a running one's commit is refused), its unfinished children canceled, its parent woken and
    its compensation enqueued, in the caller's transaction."""
    error = dict(err) if err else {"type": "DeadlineExceeded", "message": f"run {run_id} passed its deadline"}
    run = children_store.expire_run(s, run_id, error)
    if run is None:
        return []
    cancels_store.cancel_open_steps(s, run_id)
    tracing.run_finished(s, run, RunStatus.FAILED, run.finished_at)
    out = cancel_children(s, run_id, f"parent run {run_id} passed its deadline")
    out += notify_parent(s, run_id, run.parent_run_id, RunStatus.FAILED)
    return out + enqueue_compensation(s, run)


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
) -> tuple[bool, list[Dispatch], Claim | None]:
    """Insert the step rows of `stage` and point the run at it.

    Returns whether the stage has any step (an empty fan-out has none), what to publish now, and
    the claim of a stage of one plain step under `carry`: it is inserted claimed instead, for
    this process to run, and published never.
    """
    st = kind.canvas[stage]
    inline = carry is not None and carry.parent.run_id == run_id and available_at is None
    if carry is not None and inline and st.single:
        claimed = _claim_next(s, carry, kind, stage)
        if claimed is not None:
            return True, [], claimed
    rows = stage_rows(kind, stage, plan)
    due_now = available_at is None
    inserted = store.create_stage(
        s, run_id=run_id, stage=stage, label=st.label, rows=rows, available_at=available_at, due=due_now
    )
    return bool(rows.names), stage_dispatches(kind, inserted, priority) if due_now else [], None


def stage_dispatches(kind: Kind, inserted: Sequence[StepRef], priority: int) -> list[Dispatch]:
    """The messages for step rows a stage insert returned."""
    return [dispatch.step_dispatch(r.id, kind.name, kind.version, r.name, priority) for r in inserted]


def stage_rows(kind: Kind, stage: int, plan: PlanContext) -> store.StageRows:
    """The step rows of `stage`: one per static step, or one per item of a fan-out (none for an
    empty one)."""
    st = kind.canvas[stage]
    rows: list[tuple[StepDef, int, str | None]]
    if st.over is not None:
        items = list(st.over(plan))
        rows = [(st.steps[0], i, to_json(item)) for i, item in enumerate(items)]
    else:
        rows = [(sd, i, None) for i, sd in enumerate(st.steps)]
    return store.StageRows(
        names=[sd.name for sd, _, _ in rows],
        idxs=[index for _, index, _ in rows],
        items=[item for _, _, item in rows],
        maxs=[kind.policy_for(sd).max_attempts for sd, _, _ in rows],
    )


# --------------------------------------------------------------------------------------------
# the inline carry of a linear chain


def _next_step(carry: Carry, kind: Kind, stage: int) -> store.NextStep:
    """`stage`'s single step, to insert claimed under `carry.token` for this process."""
    sdef = kind.canvas[stage].steps[0]
    return store.NextStep(
        run_id=carry.parent.run_id,
        stage=stage,
        name=sdef.name,
        label=kind.canvas[stage].label,
        max_attempts=kind.policy_for(sdef).max_attempts,
        token=carry.token,
        owner=worker_id(),
        ttl=get_settings().lease_ttl_s,
    )


def _carried(carry: Carry, nxt: store.NextStep, step_id: int, claimed_at: datetime) -> Claim:
    """The claim of the step inserted under `carry.token`, for this process to run next."""
    return replace(
        carry.parent,
        step_id=step_id,
        stage=nxt.stage,
        name=nxt.name,
        item_index=0,
        item=None,
        attempt=1,
        max_attempts=nxt.max_attempts,
        claimed_at=claimed_at,
        token=carry.token,
    )


def _claim_next(s: Session, carry: Carry, kind: Kind, stage: int) -> Claim | None:
    """Insert `stage`'s single step already claimed under `carry.token`; None if it exists."""
    nxt = _next_step(carry, kind, stage)
    row = store.claim_next(s, nxt)
    return None if row is None else _carried(carry, nxt, row.id, row.claimed_at)


def commit_together(held: list[tuple[Claim, Kind, Any]]) -> dict[int, Claim | None]:
    """Commit steps whose results are known, each with its next stage's single step claimed for
    this process, in one statement (`store.commits.succeed_and_claim_next_batch`): a mass wake's
    checks that held. Returns, by step id, the next step's claim (None: it existed already) for
    those that landed; a step left out was not written and takes the general path."""
    if not held:
        return {}
    owner, ttl = worker_id(), get_settings().lease_ttl_s
    carries = [(Carry(parent=c), kind, c, value) for c, kind, value in held]
    nexts = {c.step_id: _next_step(carry, kind, c.stage + 1) for carry, kind, c, _ in carries}
    items = [
        commits_store.BatchedSuccess(c.step_id, c.token, c.stage, to_json(value), nexts[c.step_id])
        for _, _, c, value in carries
    ]
    with db.autocommit() as conn:
        landed = commits_store.succeed_and_claim_next_batch(conn, items, owner=owner, ttl=ttl)
    out: dict[int, Claim | None] = {}
    for carry, _, c, _ in carries:
        row = landed.get(c.step_id)
        if row is None:
            continue
        if row.next_id is None or row.claimed_at is None:
            out[c.step_id] = None  # the next step existed already: not this process' to run
        else:
            out[c.step_id] = _carried(carry, nexts[c.step_id], row.next_id, row.claimed_at)
    return out


def commit_alone(c: Claim, kind: Kind, payload: str, carry: Carry | None) -> Committed | None:
    """The commit of a linear chain's step in one statement, in autocommit: one round trip
    instead of four (BEGIN, succeed, advance, COMMIT), most of an inline step's cost.

    It applies when the step is its stage's only one and either the next stage is one step
    (claimed for this process to run under `carry`, or else inserted pending and published) or
    there is none and the run succeeds with this result.
    None: another shape, or the run is not as a plain advance expects (a cancel asked, the lease
    lost); nothing was written and the caller takes the general path, which sorts those out.
    """
    here = kind.canvas[c.stage]
    if not here.single:
        return None
    if c.parent_run_id is not None and c.stage + 1 == len(kind.canvas):
        return None  # a child run's end wakes its parent: the general path (`finish_run`)
    following = c.stage + 1
    if following == len(kind.canvas):
        with db.autocommit() as conn:
            run = commits_store.succeed_and_finish(
                conn, step_id=c.step_id, token=c.token, stage=c.stage, result=payload, end_stage=following
            )
        if run is None:
            return None
        tracing.run_span(run, RunStatus.SUCCEEDED, run.finished_at)
        return Committed([])
    nxt = kind.canvas[following]
    if not nxt.single:
        return None
    if carry is None:
        return _commit_and_publish_next(c, kind, payload, following)
    next_step = _next_step(carry, kind, following)
    with db.autocommit() as conn:
        row = commits_store.succeed_and_claim_next(
            conn, step_id=c.step_id, token=c.token, stage=c.stage, result=payload, next_step=next_step
        )
    if row is None:
        return None
    if row.next_id is None or row.claimed_at is None:
        return Committed([])  # the next step existed already: not this process' to run
    return Committed([], _carried(carry, next_step, row.next_id, row.claimed_at))


def _commit_and_publish_next(c: Claim, kind: Kind, payload: str, following: int) -> Committed | None:
    """`commit_alone` when the next step goes out as a message (no carry: `INLINE_STEPS=0`, a
    limited kind, or the inline budget spent): one statement, then its message after it."""
    sdef = kind.canvas[following].steps[0]
    next_step = commits_store.NextMessage(
        c.run_id, following, sdef.name, kind.canvas[following].label, kind.policy_for(sdef).max_attempts
    )
    with db.autocommit() as conn:
        row = commits_store.succeed_and_publish_next(
            conn, step_id=c.step_id, token=c.token, stage=c.stage, result=payload, next_step=next_step
        )
    if row is None:
        return None
    if row.next_id is None:
        return Committed([])
    return Committed([dispatch.step_dispatch(row.next_id, kind.name, kind.version, sdef.name, c.priority)])


# --------------------------------------------------------------------------------------------
# the end of a canceled run (invariant 8)


class CancelAsked(NamedTuple):
    """What asking a run to cancel did (`ask_cancel`)."""

    landed: bool  # the guarded REQUEST_CANCEL changed the run: it was live and is asked to stop
    status: RunStatus  # the run's status under its row lock: its final one when not landed
    dispatches: list[Dispatch]  # to publish after commit


def request_cancel(s: Session, run_id: uuid.UUID, reason: str, *, by_parent: bool = False) -> list[Dispatch]:
    """Business first: the kind's cancel hook and the request, then stop the run if no step
    runs (`finalize_cancel`, which cascades to the run's children). KeyError: no such run.

    The dispatches only, for the cascade and the sweeper; `ask_cancel` also says whether the
    request landed. `by_parent`: the parent's end asks (its cascade, the orphan backstop), so a
    retried parent replaces this child (`children.run_child`)."""
    return ask_cancel(s, run_id, reason, by_parent=by_parent).dispatches


def ask_cancel(s: Session, run_id: uuid.UUID, reason: str, *, by_parent: bool = False) -> CancelAsked:
    """`request_cancel`, saying whether the request landed: `landed` is what the guarded
    statement changed (nothing once the run has finished), `status` the run's status under its
    row lock. Why: a caller that checked the run was live before asking (`proj cancel`) must not
    report a cancel for a run that finished in between
    (`tests/integration/test_cli.py::test_cancel_of_a_run_that_finishes_before_it_lands_says_so`).
    KeyError: no such run."""
    run = cancels_store.lock_run_to_cancel(s, run_id)
    if run is None:
        raise KeyError(f"no run {run_id}")
    if run.status in TERMINAL:
        return CancelAsked(False, run.status, [])
    kind = get_kind(run.kind, run.version)
    if kind.on_cancel is not None:
        kind.on_cancel(s, run.id, kind.input_model.model_validate(run.input))
    if not cancels_store.request_cancel(s, run_id, reason[:2000], by_parent=by_parent):
        return CancelAsked(False, run.status, [])  # not while we hold the row; the guard decides
    return CancelAsked(True, run.status, finalize_cancel(s, run_id))


def cancel_children(s: Session, run_id: uuid.UUID, reason: str) -> list[Dispatch]:
    """Cancel every unfinished child of the run not asked to stop yet (and theirs, in turn).

    Each child through `if_served`: a child of a version this process does not know used to
    fail the parent's cancel, failure or expiry as a whole; now it is left, and once the parent
    has ended the orphan backstop of a sweep that knows its version cancels it
    (`tests/integration/test_ops_review.py::test_a_parent_cancels_with_a_child_of_an_unknown_version`).
    """
    out: list[Dispatch] = []
    for child_id in children_store.live_children(s, run_id):
        out += if_served(s, child_id, lambda c: request_cancel(s, c, reason, by_parent=True))
    return out


def if_served(s: Session, run_id: uuid.UUID, end: Callable[[uuid.UUID], list[Dispatch]]) -> list[Dispatch]:
    """`end(run_id)` (which ends or cancels the run) inside a savepoint; nothing, logged, when this
    process does not know the run's version.

    Why: ending a run needs its kind (cancel hook, compensation), and during a rollout this
    process may not serve the run's version. `UnknownKind` then rolled back the whole
    transaction: the operator's cancel refused, or a sweep rolled back on every tick, no lease
    taken back and nothing re-sent for any run. Now that run is left as it was, for a process
    serving its version (`tests/integration/test_ops_review.py::
    test_a_run_of_a_version_this_process_does_not_know_does_not_stop_the_sweeper`).
    """
    try:
        with s.begin_nested():
            return end(run_id)
    except UnknownKind as exc:
        log.warning("run %s left to a process serving its version: %s", run_id, exc)
        return []


def finalize_cancel(s: Session, run_id: uuid.UUID) -> list[Dispatch]:
    """Mark a cancel-requested run `canceled` once no step runs; enqueue its compensation.

    Its unfinished children are asked to cancel at once (business first, each with its own
    compensation); a canceled child wakes its parent's step, which then fails."""
    run = cancels_store.lock_run_to_cancel(s, run_id)
    if run is None or run.status in TERMINAL:
        return []
    reason = f"parent run {run_id} canceled: {run.cancel_reason or ''}".strip()
    out = cancel_children(s, run_id, reason)
    if cancels_store.live_leases(s, run_id):
        return out
    cancels_store.cancel_open_steps(s, run_id)
    ended = cancels_store.cancel_run(s, run_id)
    if ended is None:
        return out
    tracing.run_finished(s, run, RunStatus.CANCELED, ended.finished_at)
    out += notify_parent(s, run_id, ended.parent_run_id, RunStatus.CANCELED)
    return out + enqueue_compensation(s, run)


def enqueue_compensation(
    s: Session, run: cancels_store.RunToCancel | children_store.ExpiredRun
) -> list[Dispatch]:
    """Compensation is an explicit kind, enqueued once (idempotent key) in the same transaction."""
    kind = get_kind(run.kind, run.version)
    if kind.compensation is None:
        return []
    payload = (
        kind.compensation_input(run.id, run.input)
        if kind.compensation_input is not None
        else {"run_id": str(run.id), "kind": run.kind, "input": run.input}
    )
    _ref, out = insert_run(s, kind.compensation, payload, idempotency_key=f"compensate:{run.id}")
    return out
