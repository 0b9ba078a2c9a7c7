"""Attempts: a success writes no row, every other end and every orphan does (migration 0011).

The attempt that runs, or that succeeded, lives on its step row (`claimed_at`, `lease_token`,
`lease_owner`); `engine.step_attempt` logs the attempts that ended any other way, and the ones
taken from their holder. `engine.attempt` is the whole history, each attempt once. Why: the
happy path wrote its attempt row twice, two of a step's six row writes (`bench/README.md`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from proj import db
from proj.engine import protocol, runs, sweeper
from proj.engine.store import cancels, recovery
from proj.engine.store import claims as store
from tests.conftest import new_key
from tests.support.services import scalar, sql
from tests.support.steps import first_step


def _log(run_id: Any) -> list[tuple[Any, ...]]:
    return sql(
        "SELECT s.name, a.attempt, a.outcome, a.lease_token IS NOT NULL, a.worker IS NOT NULL, "
        "a.started_at <= coalesce(a.ended_at, now()) FROM engine.step_attempt a "
        "JOIN engine.step s ON s.id = a.step_id WHERE s.run_id = %s ORDER BY s.stage, a.attempt",
        (run_id,),
    )


def _history(run_id: Any) -> list[tuple[Any, ...]]:
    return sql(
        "SELECT s.name, a.attempt, a.outcome FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
        "WHERE s.run_id = %s ORDER BY s.stage, a.attempt",
        (run_id,),
    )


def _claim(step_id: int) -> uuid.UUID:
    token = uuid.uuid4()
    with db.autocommit() as conn:
        assert store.claim(conn, step_id=step_id, token=token, owner="test-worker", ttl=30.0) is not None
    return token


def test_a_run_that_succeeds_writes_no_attempt_row(published) -> None:
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    assert protocol.execute(first_step(ref.task_run_id), starts_run=True) == "succeeded"

    assert _log(ref.task_run_id) == []
    assert _history(ref.task_run_id) == [(f"s{i}", 1, "succeeded") for i in range(1, 6)]
    stamped = sql(
        "SELECT count(DISTINCT lease_token), count(*) FILTER (WHERE claimed_at <= finished_at) "
        "FROM engine.step WHERE run_id = %s",
        (ref.task_run_id,),
    )
    assert stamped == [(5, 5)], "each success keeps its token and its claim time"


def test_attempts_that_fail_are_logged_with_their_outcome(published) -> None:
    """`flaky` fails its second step three times (its retry cap)."""
    ref = runs.enqueue("flaky", {}, idempotency_key=new_key())
    assert protocol.execute(first_step(ref.task_run_id), starts_run=True) == "retry"
    fails = scalar("SELECT id FROM engine.step WHERE run_id = %s AND name = 'fails'", (ref.task_run_id,))
    for want in ("retry", "failed"):
        deadline = time.monotonic() + 5
        while (outcome := protocol.execute(fails, limited=False)) == "noop" and time.monotonic() < deadline:
            time.sleep(0.05)  # the retry's backoff (at most 0.5 s)
        assert outcome == want

    assert _log(ref.task_run_id) == [
        ("fails", 1, "retry", True, True, True),
        ("fails", 2, "retry", True, True, True),
        ("fails", 3, "failed", True, True, True),
    ]
    assert _history(ref.task_run_id) == [
        ("ok", 1, "succeeded"),
        ("fails", 1, "retry"),
        ("fails", 2, "retry"),
        ("fails", 3, "failed"),
    ]


def test_an_expired_lease_logs_its_attempt_as_an_orphan() -> None:
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    step_id = first_step(ref.task_run_id)
    token = _claim(step_id)
    assert _history(ref.task_run_id) == [("s1", 1, None)], "the running attempt, from the step row"
    sql("UPDATE engine.step SET lease_until = now() - interval '1 second' WHERE id = %s", (step_id,))

    with db.transaction() as s:
        assert step_id in {e.id for e in recovery.expire_leases(s, 1000, sweeper.known_versions())}

    assert _log(ref.task_run_id) == [("s1", 1, None, True, True, True)]
    assert sql("SELECT lease_token, worker FROM engine.step_attempt WHERE step_id = %s", (step_id,)) == [
        (token, "test-worker")
    ]
    assert _history(ref.task_run_id) == [("s1", 1, None)], "once: the step is pending again"


def test_a_run_canceled_mid_step_logs_the_running_attempt_as_an_orphan() -> None:
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    step_id = first_step(ref.task_run_id)
    token = _claim(step_id)

    with db.transaction() as s:
        assert cancels.cancel_open_steps(s, ref.task_run_id) == 1

    assert sql(
        "SELECT attempt, lease_token, outcome FROM engine.step_attempt WHERE step_id = %s", (step_id,)
    ) == [(1, token, None)]
    assert _history(ref.task_run_id) == [("s1", 1, None)]
