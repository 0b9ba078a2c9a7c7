"""Child runs: a step that starts another run and waits for it without a worker slot.

A child step, in one fenced transaction, enqueues its child (idempotently: the key is derived
from the parent run, the step and its item index, so a retried or re-delivered step finds the
same child) and parks on `run-finished:<child id>`, unless the child has finished already.
Everything is written at once or nothing is: a killed worker leaves either no child or a child
and a parked step. The child's end (succeeded, failed, canceled) stores that signal and wakes
the step in its own finishing transaction (`chain.notify_parent`); the step's next attempt
finds the child finished and commits its result, or fails with the child's error under the
parent's retry policy. A child its parent's end canceled (the parent failed, then an operator
retried it) is replaced by a fresh one (`replacement_key`). A child inherits its parent's
deadline (the earlier of it and its own kind's).
A child that cannot be enqueued (an unknown kind, an input its model rejects)
fails the step at once (`ChildRejected`), with nothing written.

Statements: `proj.engine.store.children`, `proj.engine.store.stages` (`insert_run`),
`proj.engine.store.waits` (`lock_topic`, `park`). Proofs: `tests/integration/test_children.py`,
`tests/faults/test_children_faults.py`.
"""

from __future__ import annotations

import os
import signal

from proj import db
from proj.engine.attempts import AttemptEnd, Carry, Claim
from proj.engine.chain import insert_run
from proj.engine.commits import commit_success
from proj.engine.context import StepContext
from proj.engine.errors import BadInput, ChildFailed, ChildRejected
from proj.engine.heartbeat import lock_idle_ms
from proj.engine.kind import ChildSpec, Kind
from proj.engine.status import TERMINAL, Outcome, RunStatus
from proj.engine.store import children as store
from proj.engine.store import waits as waits_store
from proj.engine.waiting import park_in
from proj.settings import get_settings


def child_key(c: Claim) -> str:
    """The child's idempotency key: one child per parent run, step and item (until the parent's
    own end cancels it: `replacement_key`)."""
    return f"child:{c.run_id}:{c.name}:{c.item_index}"


def replacement_key(c: Claim, canceled: object) -> str:
    """The key of the child that takes the place of `canceled`, one its parent's end stopped.

    Why: a fan-out parent that fails cancels its children still running (its cascade); they
    never run again. When an operator retries the parent, its step meets such a child and, before,
    failed on it (`ChildFailed`), so a retried parent could only fail again. Now it starts a
    fresh child of the same input under this key, derived from the one replaced, so re-deliveries
    of the step find it, and a later failure and retry chain on to the next. A child an operator
    canceled is not replaced: that cancel still fails the step
    (`tests/integration/test_children_retry.py`)."""
    return f"{child_key(c)}:after:{canceled}"


def run_child(
    c: Claim, ctx: StepContext, kind: Kind, spec: ChildSpec, carry: Carry | None = None
) -> AttemptEnd:
    """Enqueue the child (or find it) and park until it finishes; commit its result when it has."""
    try:
        child_input = spec.input(ctx)
    except BadInput as exc:
        raise ChildRejected(f"child {spec.kind!r} of step {c.name}: {type(exc).__name__}: {exc}") from exc
    with db.transaction() as s:
        ctx.fence(s)  # a stale attempt starts nothing
        key, out = child_key(c), []
        while True:
            try:
                ref, sent = insert_run(
                    s,
                    spec.kind,
                    child_input,
                    idempotency_key=key,
                    priority=c.priority,
                    parent_run_id=c.run_id,
                    inherited_deadline=c.deadline_at,
                )
            except BadInput as exc:  # the transaction rolls back: nothing is half-written
                raise ChildRejected(
                    f"child {spec.kind!r} of step {c.name}: {type(exc).__name__}: {exc}"
                ) from exc
            out += sent
            topic = store.finished_topic(ref.task_run_id)
            # Under the topic lock a child that finishes meanwhile either is seen finished here or
            # finds this step parked and wakes it (`chain.notify_parent` takes the same lock).
            waits_store.lock_topic(s, topic, idle_ms=lock_idle_ms())
            child = store.child_state(s, ref.task_run_id)
            if not (child.status == RunStatus.CANCELED and child.canceled_by_parent):
                break
            key = replacement_key(c, child.id)  # the parent's end stopped it: the retry goes on
        parked = child.status not in TERMINAL
        if parked:
            park_in(s, c, topic, timeout_s=spec.timeout_s)
    if ref.created and get_settings().fault_kill_after_child_enqueue:
        os.kill(os.getpid(), signal.SIGKILL)  # the child and the park committed, nothing sent
    if parked:
        return AttemptEnd(Outcome.WAITING, out)
    if child.status == RunStatus.SUCCEEDED:
        return AttemptEnd.succeeded(commit_success(c, kind, child.result, carry=carry))
    canceled = {"type": "Canceled", "message": child.cancel_reason}
    error = child.last_error if child.status == RunStatus.FAILED else canceled
    raise ChildFailed(child.id, child.kind, child.status, error)
