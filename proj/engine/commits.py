"""The commit decision of an attempt: success, a retry or the end of the run, or a cancel the
body stopped for. Every commit is fenced by the lease token (invariant 3): a refused one raises
`LeaseLost` and writes nothing. Statements: `proj.engine.store.commits`.

Each commit returns what the ladder needs next (`attempts.Committed`, `attempts.AttemptEnd`):
the messages to publish after commit and, for a success under a `Carry`, the next step claimed
in the same transaction. A success committed inside the body's own transaction
(`StepContext.finish`) goes through the `InBodyCommit` the ladder hands the context.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec

from sqlalchemy.orm import Session

from proj import db
from proj.engine import chain, tracing
from proj.engine.attempts import AttemptEnd, Carry, Claim, Committed, error_payload, to_json
from proj.engine.dispatch import Dispatch
from proj.engine.errors import LeaseLost, NonRetryable, Unavailable
from proj.engine.heartbeat import lock_idle_ms
from proj.engine.kind import Kind, RetryPolicy
from proj.engine.status import Outcome, RunStatus, StepStatus
from proj.engine.store import commits as store

log = logging.getLogger(__name__)

P = ParamSpec("P")


def commit_success(
    c: Claim, kind: Kind, result: Any, session: Session | None = None, carry: Carry | None = None
) -> Committed:
    """Store the result and advance the run, or refuse if the lease is gone.

    With `session` (from `StepContext.finish`), it joins the body's business transaction so
    the writes and the result commit together. With `carry`, a single next step is claimed in
    the same transaction for this process to run (`Committed.next`).
    """
    payload = to_json(result)
    if session is not None:
        return _succeed(session, c, payload, carry)
    alone = chain.commit_alone(c, kind, payload, carry)
    if alone is not None:
        return alone
    with db.transaction() as s:
        return _succeed(s, c, payload, carry)


@dataclass
class InBodyCommit:
    """The committer a step body's `StepContext.finish()` calls: the attempt's success joins the
    body's own transaction. What that commit hands back is kept here for the ladder, which owns
    this object (`committed` None: no `finish` committed).

    `committed` is set only once the body's transaction has committed (`landed`): taken before
    its COMMIT, a COMMIT that failed and that the body swallowed left the ladder running the next
    step on a claim that had rolled back (`tests/integration/test_step_path_review.py::
    test_a_finish_whose_transaction_did_not_commit_is_not_taken_as_committed`)."""

    c: Claim
    kind: Kind
    carry: Carry | None = None
    committed: Committed | None = None
    began: bool = False
    _pending: Committed | None = None

    def commit(self, session: Session, result: Any) -> None:
        self.began = True
        self._pending = commit_success(self.c, self.kind, result, session, self.carry)

    def landed(self) -> None:
        self.committed = self._pending


def _succeed(s: Session, c: Claim, payload: str, carry: Carry | None = None) -> Committed:
    run = store.succeed_and_lock_run(
        s, step_id=c.step_id, token=c.token, result=payload, idle_ms=lock_idle_ms()
    )
    if run is None:
        raise LeaseLost(f"step {c.step_id} attempt {c.attempt}: lease lost, result refused")
    return chain.advance(s, c.run_id, run=run, stage=c.stage, carry=carry)


def commit_failure(c: Claim, policy: RetryPolicy, exc: BaseException) -> AttemptEnd:
    """Schedule the next attempt with backoff, or fail the run when attempts are exhausted.

    An outage (`Unavailable`, or Postgres itself down under the body: `db.down`, under a policy
    with an `outage_s`) is retried without spending the attempt while the outage is younger than
    the window (`_wait_out`). The attempts spent are
    counted by the statement, in the row (`attempts - outages`), not from the claim.

    The backoff of an ordinary error grows with the attempts spent, not with an outage's: the
    first error after a day waited out is retried after `initial_s`, not `max_s`
    (`tests/integration/test_outages.py::test_an_error_after_an_outage_backs_off_from_the_start`).
    An outage's own retries grow with every attempt, so a service down for long is asked less often."""
    err = error_payload(exc)
    outage = isinstance(exc, Unavailable) or db.down(exc)
    delay = policy.backoff(c.attempt if outage else c.attempt - c.outages)
    with db.transaction() as s:
        if outage and policy.outage_s > 0 and _wait_out(s, c, policy, err, delay):
            log.info(
                "step %s: a service it needs is down, retry in %.1fs, not counted: %s", c.step_id, delay, exc
            )
            return AttemptEnd(Outcome.UNAVAILABLE, [])
        failed = store.fail_or_retry(
            s,
            step_id=c.step_id,
            token=c.token,
            final=isinstance(exc, NonRetryable),
            budget=min(c.max_attempts, policy.max_attempts),
            delay=delay,
            err=err,
            idle_ms=lock_idle_ms(),
            outage=outage,
        )
        if failed is None:
            raise LeaseLost(f"step {c.step_id} attempt {c.attempt}: lease lost, failure not recorded")
        final = failed.status == StepStatus.FAILED
        close_attempt(s, c, Outcome.FAILED if final else Outcome.RETRY, err)
        seen = {**err, "step": c.name, "attempts": failed.spent}
        if final:
            return AttemptEnd(Outcome.FAILED, fail_run(s, c.run_id, seen))
        store.record_retry_error(s, c.run_id, seen)
    log.info("step %s attempt %s failed, retry in %.1fs: %s", c.step_id, c.attempt, delay, exc)
    return AttemptEnd(Outcome.RETRY, [])


def _wait_out(s: Session, c: Claim, policy: RetryPolicy, err: dict[str, Any], delay: float) -> bool:
    """The attempt met an outage younger than `policy.outage_s`: retried after `delay`, not
    spent, logged `unavailable`; the run shows the error and since when the outage lasts
    (`tests/integration/test_outages.py`). False: the outage outlasted its window (or the lease
    is gone), and the attempt counts like any failure."""
    out = store.retry_outage(
        s,
        step_id=c.step_id,
        token=c.token,
        delay=delay,
        window=policy.outage_s,
        err=err,
        idle_ms=lock_idle_ms(),
    )
    if out is None:
        return False
    close_attempt(s, c, Outcome.UNAVAILABLE, err)
    store.record_retry_error(
        s, c.run_id, {**err, "step": c.name, "attempts": out.spent, "outage_since": out.since.isoformat()}
    )
    return True


def commit_canceled(c: Claim) -> AttemptEnd:
    """The body stopped itself on a cancel request: close the step, then finish the cancel."""
    with db.transaction() as s:
        if not store.cancel_step(s, step_id=c.step_id, token=c.token, idle_ms=lock_idle_ms()):
            raise LeaseLost(f"step {c.step_id}: lease lost, cancel not recorded")
        close_attempt(s, c, Outcome.CANCELED)
        return AttemptEnd(Outcome.CANCELED, chain.finalize_cancel(s, c.run_id))


def commit_or_refuse(commit: Callable[P, AttemptEnd], *args: P.args, **kwargs: P.kwargs) -> AttemptEnd:
    """Run a commit; a refused one (the lease is gone) is the outcome `lease_lost`."""
    try:
        return commit(*args, **kwargs)
    except LeaseLost as exc:
        log.warning("commit refused: %s", exc)
        return AttemptEnd(Outcome.LEASE_LOST, [])


def close_attempt(s: Session, c: Claim, outcome: Outcome, err: dict[str, Any] | None = None) -> None:
    """The attempt, which did not succeed, is logged with its outcome (`step_attempt` is an audit
    log, never a timeline; a success is its step row)."""
    store.close_attempt(s, step_id=c.step_id, token=c.token, attempt=c.attempt, outcome=outcome, err=err)


def commit_deadline(c: Claim, exc: BaseException) -> AttemptEnd:
    """The body stopped at a checkpoint past the run's deadline: the step fails and the run
    ends `failed` with `DeadlineExceeded`, with its compensation (`chain.expire_run`)."""
    err = error_payload(exc)
    with db.transaction() as s:
        failed = store.fail_or_retry(
            s,
            step_id=c.step_id,
            token=c.token,
            final=True,
            budget=0,
            delay=0.0,
            err=err,
            idle_ms=lock_idle_ms(),
        )
        if failed is None:
            raise LeaseLost(f"step {c.step_id} attempt {c.attempt}: lease lost, deadline not recorded")
        close_attempt(s, c, Outcome.FAILED, err)
        err_run = {**err, "step": c.name, "attempts": c.attempt}
        return AttemptEnd(Outcome.FAILED, chain.expire_run(s, c.run_id, err_run))


def fail_run(s: Session, run_id: uuid.UUID, err: dict[str, Any]) -> list[Dispatch]:
    """The run becomes a dead letter: `failed` with its error; pending siblings stop, its
    unfinished children are canceled and its parent's child step is woken (the messages).

    A run asked to cancel while its step ran (a body that never reached a checkpoint, then
    failed for good) ends `canceled` with its compensation instead: the cancel was asked first,
    and a dead letter would have left the torrent and temp files behind (invariant 8;
    `tests/integration/test_ops_review.py::test_a_step_failing_after_a_cancel_request_ends_the_run_canceled`).
    """
    run = store.fail_run(s, run_id, err)
    if run is None:  # finished already, or asked to cancel: `finalize_cancel` tells them apart
        return chain.finalize_cancel(s, run_id)
    tracing.run_finished(s, run, RunStatus.FAILED, run.finished_at)
    out = chain.cancel_children(s, run_id, f"parent run {run_id} failed")
    return out + chain.notify_parent(s, run_id, run.parent_run_id, RunStatus.FAILED)
