"""The execute ladder: the one place where a step message is run, every outcome in one place.

Every delivery of a step message goes through `execute()`, as a Celery task goes through
`celery.app.trace`:

1. **claim** (`_claim`, statements in `store.claims`): one `UPDATE … WHERE status='pending' AND
   due` takes the step with a fresh lease token. A duplicate message, a completed step or a
   canceled run claims nothing: the outcome is `noop`. A kind with limits is admitted in the same
   transaction (`admission`), or refused with a reason. A kind without limits starts its runs in
   priority order: a delivery of its start step claims the pending run of higher priority, if
   any, instead of its own (`store.claims.claim_start`).
2. **heartbeat**: the process heartbeat renews the lease while the body runs.
3. **body** (`_attempt`): the kind's function, a wait check (`waiting`) or a child run
   (`children`: enqueue it and park until it finishes), with a `StepContext`.
4. **commit decision** (`commits`), fenced by the lease token: `succeeded` (the result, and the
   run advanced in the same transaction by `chain`), `retry` or `failed` (the retry policy),
   `unavailable` (a service the body needs is down: retried, the attempt not spent),
   `canceled` (the body stopped on a cancel request), `failed` with `DeadlineExceeded` (the
   body stopped past the run's deadline), `waiting`/`rechecking` (parked), or
   `lease_lost` (another attempt took over: nothing is written).
5. **publish**: messages for new steps go out after commit; a failure leaves `published_at`
   NULL so the sweeper sends them (messages are hints, Postgres is the truth). A limited step
   that ends its attempt hands its slot to the head of the line (`admission.handoff`).
6. **carry**: a committed success of a linear chain has claimed the next step in its own
   commit (`attempts.Carry`) and returned it (`attempts.Committed.next`); the ladder runs it
   here while the inline budget lasts.

Every attempt is an OpenTelemetry span in its run's trace (`proj.engine.tracing`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from proj import db, logs
from proj.engine import chain, dispatch, tracing
from proj.engine.admission import admit, any_limits, deny, handoff, limit_gates, slot_of
from proj.engine.attempts import AttemptEnd, Carry, Claim, worker_id
from proj.engine.children import run_child
from proj.engine.commits import (
    InBodyCommit,
    commit_canceled,
    commit_deadline,
    commit_failure,
    commit_or_refuse,
    commit_success,
)
from proj.engine.context import StepContext
from proj.engine.dispatch import Dispatch
from proj.engine.errors import CancelRequested, DeadlineExceeded, LeaseLost
from proj.engine.heartbeat import HEARTBEAT, Lease
from proj.engine.kind import Kind, WaitSpec, get_kind
from proj.engine.status import Outcome
from proj.engine.store import claims as store
from proj.engine.sweeper import sweep as _sweep  # noqa: F401  registers the liveness reaper's recovery
from proj.engine.waiting import run_wait
from proj.settings import get_settings

log = logging.getLogger(__name__)


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


def _claim(
    step_id: int, starts_run: bool = False, limited: bool = True
) -> tuple[Claim | None, list[Dispatch]]:
    """The claim transaction; also returns waiters to wake when a denial saw free slots.

    `starts_run`: the message is for the kind's `start_step` (a kind without limits), so it
    may start a better-ordered pending run instead (`store.claims.claim_start`). `limited`: the
    kind declares limits, so the claim goes through admission in a transaction.
    """
    token = uuid.uuid4()
    kicks: list[Dispatch] = []
    owner, ttl = worker_id(), get_settings().lease_ttl_s
    row: store.ClaimedRow | None
    if starts_run or not limited:
        # Nothing to admit: the claim is a single statement, atomic on its own, so it runs in
        # autocommit and saves the BEGIN and COMMIT round trips.
        with db.autocommit() as conn:
            take = store.claim_start if starts_run else store.claim
            row = take(conn, step_id=step_id, token=token, owner=owner, ttl=ttl)
            if row is None:
                return None, []
            if starts_run and row.stage == 0 and row.item_index == 0:
                kicks = _release_start_siblings(conn, row)
    else:
        with db.transaction() as s:
            slot = slot_of(s, step_id)
            if slot is None:
                return None, []
            gates = limit_gates(get_kind(slot.kind, slot.version), slot.concurrency_key)
            if gates:
                denial, kicks = admit(s, slot, gates)
                if denial is not None:
                    return None, kicks + deny(s, step_id, denial)
            row = store.claim(s, step_id=step_id, token=token, owner=owner, ttl=ttl)
            if row is None:
                return None, []
    return _claim_of(row, token), kicks


def _claim_of(row: store.ClaimedRow, token: uuid.UUID) -> Claim:
    """The `Claim` a claiming statement's row describes."""
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
        parent_run_id=row.parent_run_id,
        deadline_at=row.deadline_at,
        outages=row.outages,
    )


def _release_start_siblings(conn: db.Autocommit, row: store.ClaimedRow) -> list[Dispatch]:
    """The run just claimed by its start step: send the rest of its first stage, held back at
    enqueue so that they could not start a run out of priority order (`Kind.holds_start_siblings`).
    If this process dies before publishing, the sweeper re-sends them (`republish_after_s`)."""
    if not get_kind(row.kind, row.version).holds_start_siblings:
        return []
    return [
        dispatch.step_dispatch(r.id, row.kind, row.version, r.name, row.priority)
        for r in store.release_start_siblings(conn, row.run_id)
    ]


def execute(
    step_id: int,
    starts_run: bool = False,
    more: Sequence[int] = (),
    task: tuple[str, str] | None = None,
    limited: bool | None = None,
) -> str:
    """Run one delivery of a step message, and the chain after it while the inline budget
    lasts; returns the outcome of the last step run (for logs and tests).

    `more`: the other steps of a batched message (`dispatch.batched`, mass wakes), each claimed
    and committed as if it had its own message (`_deliver_batch`). Past `INLINE_BUDGET_S` the
    rest go back to the broker as one message (`task`: its name and queue), so one delivery
    never holds a worker slot much longer than an inline chain.

    `limited`: whether the message's kind declares limits (its Celery task knows); None asks
    whether any kind of this process does. Only a limited kind's claim needs the admission
    transaction: any other is one autocommit statement.
    """
    limited = any_limits() if limited is None else limited
    if not more:
        return _deliver(step_id, starts_run, limited)
    return _deliver_batch([step_id, *more], task, limited)


# How many steps of a batched message one claim statement takes at a time: the inline budget is
# looked at between chunks, so a batch of slow steps overruns it by at most one chunk.
CLAIM_CHUNK = 8


def _deliver_batch(ids: list[int], task: tuple[str, str] | None, limited: bool) -> str:
    """The steps of one batched message (`dispatch.batched`: a mass wake), while the budget lasts.

    Why: one after another, each with its own claim statement, a mass wake spent a fifth of its
    time claiming (`bench.signal_latency`, herd). Here a chunk of steps is claimed in one
    statement (`store.claims.claim_batch`), each under its own token with its own lease and
    attempt record, and each then runs and commits exactly as if it had a message of its own;
    the claimed steps that wait their turn are heart-beaten meanwhile
    (`tests/integration/test_wake_batches.py`). A kind with limits is claimed one by one through
    admission, as before. No step of a batched message starts a run, whatever its task says: a
    batched message only ever names woken steps, whose runs started already, so there is no
    start order to keep, and a first step that waits (a start step) is batch-claimed too.
    Claimed one by one with `claim_start`, such a herd (`bench.signal_latency`'s `gate`) never
    reached the batched claim or the chunk commit. Past `INLINE_BUDGET_S` the unclaimed rest
    goes back to the broker as one message.
    """
    outcome: str = Outcome.NOOP
    began = time.monotonic()
    rest = list(ids)
    batch_claims = not limited
    while rest:
        late = time.monotonic() - began > get_settings().inline_budget_s
        if task is not None and late and len(rest) < len(ids):  # the first chunk always runs
            name, queue = task
            dispatch.publish_after_commit([Dispatch(rest[0], name, queue, 0, tuple(rest[1:]))])
            break
        if not batch_claims:
            outcome = _deliver(rest.pop(0), False, limited)  # a woken step starts no run
            continue
        chunk, rest = rest[:CLAIM_CHUNK], rest[CLAIM_CHUNK:]
        claims = _claim_batch(chunk)
        with HEARTBEAT.track_many([(c.step_id, c.token) for c in claims]):
            outcome = _run_chunk(claims) or outcome
    return outcome


def _run_chunk(claims: list[Claim]) -> str | None:
    """The claimed steps of a chunk. Wait steps whose check holds commit together.

    Why: in a mass wake each woken step is a check that holds, then a commit that claims its
    run's next step. One commit statement per run was the heaviest statement left
    (`bench.signal_latency`, herd). So the chunk's checks run first, and the steps whose check
    held commit in one statement (`chain.commit_together`), each fenced by its own token, with
    its next step claimed for this process. Then each carried chain runs as usual. A step that
    is not such a wait, or whose check did not hold or failed, or whose commit did not land,
    runs through the ladder (`_run_chain`), which checks again: checks only read.
    """
    outcome: str | None = None
    held: list[tuple[Claim, Kind, Any]] = []
    rest: list[Claim] = []
    for c in claims:
        kind = get_kind(c.kind, c.version)
        spec = _together(c, kind)
        value = _check(c, kind, spec) if spec is not None else None
        if value:
            held.append((c, kind, value))
        else:
            rest.append(c)
    landed = chain.commit_together(held)
    # The next steps the commit claimed wait their turn like the chunk's own claims: heart-beaten
    # until each one's chain runs. Left out, one waiting behind an earlier chain longer than a
    # lease was taken back by a sweep and re-sent while this process still ran its body on the
    # stale token (`tests/integration/test_step_path_review.py::
    # test_next_steps_a_chunk_claimed_keep_their_lease_while_an_earlier_chain_runs`).
    carried = [(n.step_id, n.token) for n in landed.values() if n is not None]
    with HEARTBEAT.track_many(carried):
        for c, _, _ in held:
            if c.step_id not in landed:
                rest.append(c)
                continue
            log.debug("step %s attempt %s: the check held, committed with its chunk", c.step_id, c.attempt)
            outcome = Outcome.SUCCEEDED
            nxt = landed[c.step_id]
            if nxt is not None:
                outcome = _run_chain(nxt)
    for c in rest:
        outcome = _run_chain(c)
    return outcome


def _together(c: Claim, kind: Kind) -> WaitSpec | None:
    """The wait of `c` when its check may commit with its chunk: a database check (not a timer
    or a bare signal) of a one-step stage followed by a one-step stage, in a kind without limits,
    with no span to record (a traced attempt takes the ladder, which records it)."""
    spec = kind.step_def(c.name).wait
    if spec is None or spec.check is None or spec.until is not None or kind.has_limits:
        return None
    following = c.stage + 1
    if following >= len(kind.canvas) or not kind.canvas[c.stage].single or not kind.canvas[following].single:
        return None
    if get_settings().inline_steps <= 0 or not tracing.skipped(c.trace):
        return None
    return spec


def _check(c: Claim, kind: Kind, spec: WaitSpec) -> Any:
    """Run a wait's check for a claimed step, as the ladder would; None when it raised (the
    ladder runs it again and records the failure)."""
    assert spec.check is not None
    fields = logs.StepFields(str(c.run_id), c.kind, c.name, c.attempt, worker_id())
    with logs.step_fields(fields), HEARTBEAT.track(c.step_id, c.token) as lease:
        try:
            return spec.check(_context(c, kind, lease))
        except Exception as exc:
            log.debug("step %s: check raised %r; the ladder runs it again", c.step_id, exc)
            return None


def _claim_batch(ids: list[int]) -> list[Claim]:
    """Claim the pending ones of `ids` in one autocommit statement, each under its own token."""
    tokens = [uuid.uuid4() for _ in ids]
    with db.autocommit() as conn:
        rows = store.claim_batch(
            conn, step_ids=ids, tokens=tokens, owner=worker_id(), ttl=get_settings().lease_ttl_s
        )
    return [_claim_of(row, token) for row, token in rows]


def _deliver(step_id: int, starts_run: bool, limited: bool) -> str:
    """One step message's worth of work: claim, run, and the inline chain after it."""
    c, kicks = _claim(step_id, starts_run, limited)
    dispatch.publish_after_commit(kicks)
    return _run_chain(c)


def _run_chain(c: Claim | None) -> str:
    """A claimed step, and the chain after it while its inline budget lasts."""
    outcome: str = Outcome.NOOP
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
        end, error = _attempt(c, kind, carry)
        tracing.set_outcome(span, end.outcome, error)
    to_publish = end.publish
    if limit_gates(kind, c.concurrency_key):
        try:
            with db.transaction() as s:
                to_publish = [*to_publish, *handoff(s, kind, c.concurrency_key)]
        except Exception as exc:  # the sweeper re-sends blocked steps anyway
            log.warning("hand-off after step %s failed: %s", c.step_id, exc)
    dispatch.publish_after_commit(to_publish)
    # Only a committed success carries on (the commit returned the step it claimed).
    return end.outcome, end.next if end.outcome == Outcome.SUCCEEDED else None


def _context(c: Claim, kind: Kind, lease: Lease, committer: InBodyCommit | None = None) -> StepContext:
    """The context a claimed attempt's body (or wait check) runs with."""
    return StepContext(
        run_id=c.run_id,
        kind=kind,
        raw_input=c.input,
        step_id=c.step_id,
        step=c.name,
        stage=c.stage,
        attempt=c.attempt,
        item=c.item,
        item_index=c.item_index,
        lease=lease,
        committer=committer,
    )


def _attempt(c: Claim, kind: Kind, carry: Carry | None = None) -> tuple[AttemptEnd, BaseException | None]:
    """Body (or wait check) and its fenced commit, under the heartbeat.

    A body that commits its result in its own transaction (`StepContext.finish`) does so through
    the `InBodyCommit` it is handed; otherwise its result is committed here once it returns."""
    sdef = kind.step_def(c.name)
    in_body = InBodyCommit(c, kind, carry)
    plain = sdef.wait is None and sdef.child is None  # only a plain body may `finish()`
    error: BaseException | None = None
    with HEARTBEAT.track(c.step_id, c.token) as lease:
        ctx = _context(c, kind, lease, in_body if plain else None)
        try:
            _not_stopped(c, lease)
            if sdef.wait is not None:
                end = run_wait(c, ctx, kind, sdef.wait, carry)
            elif sdef.child is not None:
                end = run_child(c, ctx, kind, sdef.child, carry)
            else:
                assert sdef.fn is not None
                result = sdef.fn(ctx)
                committed = in_body.committed
                if committed is None and in_body.began:
                    raise RuntimeError(f"step {c.step_id}: the body's finish() transaction did not commit")
                if committed is None:
                    committed = commit_success(c, kind, result, carry=carry)
                end = AttemptEnd.succeeded(committed)
        except LeaseLost as exc:
            log.warning("step %s attempt %s: %s", c.step_id, c.attempt, exc)
            end, error = AttemptEnd(Outcome.LEASE_LOST, []), exc
        except CancelRequested:
            end = commit_or_refuse(commit_canceled, c)
        except DeadlineExceeded as exc:
            end = commit_or_refuse(commit_deadline, c, exc)
            error = exc
        except Exception as exc:
            policy = kind.policy_for(sdef)
            end = commit_or_refuse(commit_failure, c, policy, exc)
            error = exc
    return end, error


def _not_stopped(c: Claim, lease: Lease) -> None:
    """Raise before the body starts if, while the step waited its turn (claimed with a chunk or
    by the commit before it), the heartbeat found its lease taken over or a cancel asked: the
    body must not run on a lease another worker holds, nor start for a canceled run
    (`tests/integration/test_step_path_review.py::
    test_a_claimed_step_whose_run_was_canceled_while_it_waited_its_turn_does_not_run`)."""
    if lease.lost.is_set():
        raise LeaseLost(f"step {c.step_id} attempt {c.attempt}: lease taken over before the body began")
    if lease.cancel.is_set():
        raise CancelRequested(f"run {c.run_id} was canceled before step {c.step_id} began")
