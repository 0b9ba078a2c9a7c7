"""Wait steps (invariant 7): look at the database, and park on a topic with a timeout when the
condition does not hold. The worker slot is freed while parked; a signal wakes the step at once,
its timer anyway (`proj.engine.store.waits`). Proof: `tests/integration/test_waits_cancel.py`.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from proj import db
from proj.engine import dispatch
from proj.engine.attempts import AttemptEnd, Carry, Claim
from proj.engine.commits import close_attempt, commit_success
from proj.engine.context import StepContext
from proj.engine.errors import BadTopic, LeaseLost, NonRetryable
from proj.engine.heartbeat import lock_idle_ms
from proj.engine.inputs import check_topic
from proj.engine.kind import Kind, WaitSpec
from proj.engine.status import Outcome
from proj.engine.store import waits as store


def run_wait(
    c: Claim, ctx: StepContext, kind: Kind, spec: WaitSpec, carry: Carry | None = None
) -> AttemptEnd:
    """Check the business truth; commit if it holds, otherwise park the run on its topic.

    A wait that holds continues inline like any committed step (`carry`): a mass wake's next
    steps run in the delivery that re-checked, not after another trip through the broker.
    """
    topic = reachable(c, spec.topic(ctx))
    if spec.until is not None:
        until = spec.until(ctx)
        with db.transaction() as s:
            reached = store.reached(s, until)
        if reached:
            return AttemptEnd.succeeded(
                commit_success(c, kind, {"slept_until": until.isoformat()}, carry=carry)
            )
        return park(c, topic, until=until)
    if spec.check is not None:
        value = spec.check(ctx)
        if value:
            return AttemptEnd.succeeded(commit_success(c, kind, value, carry=carry))
    else:
        with db.transaction() as s:
            sig = store.latest_signal(s, topic)
        if sig is not None:
            return AttemptEnd.succeeded(commit_success(c, kind, {"signal": sig.payload}, carry=carry))
    timeout = spec.timeout_s(ctx) if callable(spec.timeout_s) else spec.timeout_s
    return park(c, topic, timeout_s=timeout, any_signal=spec.check is None)


def reachable(c: Claim, topic: str) -> str:
    """The topic, if a signal can reach it; else the step fails for good (`NonRetryable`).

    Why: `signal` refuses a topic outside `TOPIC_RE` or over `MAX_TOPIC_LEN` (a space, a
    title), so a step parked on one could only ever be woken by its timer, and a wait without
    a check parked again at each timeout, forever, one attempt row per wake-up
    (`tests/integration/test_waits_cancel.py::test_a_wait_on_a_topic_no_signal_can_reach_fails_at_once`).
    """
    try:
        check_topic(topic)
    except BadTopic as exc:
        raise NonRetryable(f"wait {c.name} cannot park: {exc}") from exc
    return topic


def park(
    c: Claim,
    topic: str,
    *,
    timeout_s: float | None = None,
    until: datetime | None = None,
    any_signal: bool = False,
) -> AttemptEnd:
    """Free the worker: the step waits in Postgres for a signal or its timer.

    Under the topic's advisory lock, a signal stored since this check started sends the step
    straight back to work, so a signal racing the park is never lost. Waiting gives the attempt
    back: it does not count against the retry policy.

    `any_signal`: a wait without a check, which any stored signal satisfies; then any signal
    the lock lets us see sends the step back. Why: a signal row's `created_at` is its
    transaction's start, so one whose transaction began before the claim and committed after
    the wait read the topic looked older than the claim, and the step parked with it stored
    (`tests/integration/test_waits_cancel.py::
    test_a_signal_whose_transaction_began_before_the_claim_wakes_a_bare_wait`). A check reads
    business rows, which a signal follows in a later transaction, so `since` is sound there.
    """
    with db.transaction() as s:
        store.lock_topic(s, topic, idle_ms=lock_idle_ms())
        raced = store.any_signal(s, topic) if any_signal else store.signal_since(s, topic, c.claimed_at)
        if park_in(s, c, topic, raced=raced, timeout_s=timeout_s, until=until):
            return AttemptEnd(
                Outcome.RECHECKING, [dispatch.step_dispatch(c.step_id, c.kind, c.version, c.name)]
            )
    return AttemptEnd(Outcome.WAITING, [])


def park_in(
    s: Session,
    c: Claim,
    topic: str,
    *,
    raced: bool = False,
    timeout_s: float | None = None,
    until: datetime | None = None,
) -> bool:
    """Park the step in the caller's transaction (which holds the topic's lock); True when a
    raced signal sends it straight back to work instead (the caller publishes it)."""
    parked = store.park(
        s,
        step_id=c.step_id,
        token=c.token,
        topic=topic,
        since=c.claimed_at,
        until=until,
        timeout_s=timeout_s or 0.0,
        raced=raced,
    )
    if not parked:
        raise LeaseLost(f"step {c.step_id}: lease lost while parking")
    close_attempt(s, c, Outcome.PARKED)
    if raced:
        return True
    store.run_waiting(s, c.run_id)
    return False
