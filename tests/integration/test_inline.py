"""Linear chains continue in the worker that ran the previous step (`attempts.Carry`).

The next step is claimed in the transaction that commits the previous one, so it needs no
message. These tests call `protocol.execute` directly (no Celery) and record what would be
published, so they see exactly which steps travelled as messages. Recovery of an inline step
whose worker is killed is `test_engine_faults::test_kill_9_mid_step_resumes_elsewhere…` (its
slow step s3 is reached inline).
"""

from __future__ import annotations

from typing import Any

import pytest

from proj.engine import chain, protocol, runs
from proj.settings import get_settings
from tests.conftest import new_key
from tests.support.services import scalar, sql
from tests.support.steps import first_step


def _steps(run_id: Any) -> list[tuple[Any, ...]]:
    return sql(
        "SELECT s.name, s.status, s.attempts, a.worker, a.lease_token FROM engine.step s "
        "LEFT JOIN engine.attempt a ON a.step_id = s.id WHERE s.run_id = %s ORDER BY s.stage",
        (run_id,),
    )


def test_a_linear_chain_runs_to_the_end_from_one_message(published) -> None:
    ref = runs.enqueue("probe", {"n": 3}, idempotency_key=new_key())
    published.clear()

    assert protocol.execute(first_step(ref.task_run_id), starts_run=True) == "succeeded"

    assert published == [], "no step after the first needed a message"
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == "succeeded"
    rows = _steps(ref.task_run_id)
    assert [(r[0], r[1], r[2]) for r in rows] == [(f"s{i}", "succeeded", 1) for i in range(1, 6)]
    assert len({r[3] for r in rows}) == 1, "one worker ran them all"
    assert len({r[4] for r in rows}) == 5, "each step had a lease token of its own"
    assert sql("SELECT step, count(*) FROM testkit.execution GROUP BY step ORDER BY step") == [
        (f"s{i}", 1) for i in range(1, 6)
    ]


def test_the_inline_budget_hands_the_rest_of_the_chain_to_a_message(published, monkeypatch) -> None:
    monkeypatch.setattr(get_settings(), "inline_steps", 2)
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    published.clear()

    protocol.execute(first_step(ref.task_run_id), starts_run=True)

    statuses = [(r[0], r[1]) for r in _steps(ref.task_run_id)]
    assert statuses == [("s1", "succeeded"), ("s2", "succeeded"), ("s3", "succeeded"), ("s4", "pending")]
    assert [d.task_name for d in published] == ["probe.v1.s4"]
    assert protocol.execute(published[0].step_id) == "succeeded"
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == "succeeded"


def test_inline_off_publishes_every_step(published, monkeypatch) -> None:
    monkeypatch.setattr(get_settings(), "inline_steps", 0)
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    published.clear()
    protocol.execute(first_step(ref.task_run_id), starts_run=True)
    assert [d.task_name for d in published] == ["probe.v1.s2"]


def test_limited_kinds_and_fan_outs_go_back_to_the_broker(published) -> None:
    """A limited run returns to the admission line between steps; a fan-out's items are spread
    over the workers. Neither is continued inline."""
    keyed = runs.enqueue("keyed", {"key": "k", "hold_s": 0.0}, idempotency_key=new_key())
    fan = runs.enqueue("fan", {"items": 3}, idempotency_key=new_key())
    published.clear()

    protocol.execute(first_step(keyed.task_run_id))
    protocol.execute(first_step(fan.task_run_id), starts_run=True)

    assert sorted(d.task_name for d in published) == ["fan.v1.each"] * 3 + ["keyed.v1.second"]


@pytest.fixture
def sent_sql(monkeypatch) -> dict[str, list[str]]:
    """What this thread sends to Postgres through psycopg (SQLAlchemy's statements included):
    statements, and COMMITs of transactions. The heartbeat's lease renewals, on a thread of
    their own and driven by time, are not counted."""
    import threading

    import psycopg

    seen: dict[str, list[str]] = {"statements": [], "commits": []}
    execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit
    mine = threading.get_ident()

    def recording_execute(self, query, *args, **kwargs):
        if threading.get_ident() == mine:
            seen["statements"].append(str(query))
        return execute(self, query, *args, **kwargs)

    def recording_commit(self):
        if threading.get_ident() == mine:
            seen["commits"].append("COMMIT")
        return commit(self)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording_execute)
    monkeypatch.setattr(psycopg.Connection, "commit", recording_commit)
    return seen


def test_a_linear_chain_costs_one_statement_per_step(published, sent_sql) -> None:
    """The claim and each commit are single statements in autocommit: no BEGIN/COMMIT round
    trips, no second statement to advance the run (`chain.commit_alone`)."""
    ref = runs.enqueue("probe", {"n": 4}, idempotency_key=new_key())
    first = first_step(ref.task_run_id)
    sent_sql["statements"].clear()
    sent_sql["commits"].clear()

    assert protocol.execute(first, starts_run=True) == "succeeded"

    # Not counted: the probe body's own writes, and the pool's liveness ping of a connection
    # that sat idle over `DB_PING_IDLE_S` (a loaded machine can make that happen mid-run).
    # (SQLAlchemy's psycopg dialect pings with an empty statement, ";").
    engine_sql = [
        q for q in sent_sql["statements"] if "testkit." not in q and q.strip() not in (";", "SELECT 1")
    ]
    assert len(engine_sql) == 6, engine_sql  # the claim, then one commit per step
    # The probe body records itself in two transactions of its own (testkit.execution).
    assert len(sent_sql["commits"]) == 2 * 5, "the engine committed no transaction of its own"
    run = sql("SELECT status, result FROM engine.task_run WHERE id = %s", (ref.task_run_id,))[0]
    last = scalar("SELECT result FROM engine.step WHERE run_id = %s AND name = 's5'", (ref.task_run_id,))
    assert run == ("succeeded", last) and last["step"] == "s5" and last["n"] == 4
    assert sql(
        "SELECT count(*), count(*) FILTER (WHERE outcome = 'succeeded' AND ended_at IS NOT NULL) "
        "FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id WHERE s.run_id = %s",
        (ref.task_run_id,),
    ) == [(5, 5)]


def test_a_step_per_message_costs_two_statements(published, sent_sql, monkeypatch) -> None:
    """`INLINE_STEPS=0`: each step claims in one statement and commits in one, the next step
    inserted pending and published by that commit (`store.commits.SUCCEED_AND_PUBLISH_NEXT`):
    no BEGIN/COMMIT round trips, no second statement to advance the run."""
    monkeypatch.setattr(get_settings(), "inline_steps", 0)
    ref = runs.enqueue("probe", {"n": 2}, idempotency_key=new_key())
    step_id = first_step(ref.task_run_id)
    published.clear()

    for i in range(1, 6):
        sent_sql["statements"].clear()
        sent_sql["commits"].clear()
        # `limited=False`: what the kind's Celery task passes (probe declares no limits)
        assert protocol.execute(step_id, starts_run=i == 1, limited=False) == "succeeded"
        engine_sql = [  # not counted either: the process' liveness lock, taken at its first claim
            q
            for q in sent_sql["statements"]
            if "testkit." not in q and q.strip() not in (";", "SELECT 1") and "pg_try_advisory_lock" not in q
        ]
        assert len(engine_sql) == 2, [" ".join(q.split())[:50] for q in engine_sql]  # claim, commit
        # The probe body records itself in two transactions of its own (testkit.execution).
        assert len(sent_sql["commits"]) == 2, "the engine committed no transaction of its own"
        if i < 5:
            assert [d.task_name for d in published] == [f"probe.v1.s{i + 1}"]
            step_id = published.pop().step_id
            assert scalar("SELECT status FROM engine.step WHERE id = %s", (step_id,)) == "pending"
    assert published == []
    assert [(r[0], r[1], r[2]) for r in _steps(ref.task_run_id)] == [
        (f"s{i}", "succeeded", 1) for i in range(1, 6)
    ]
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == "succeeded"


def _before_the_commit(monkeypatch, act) -> None:
    """Run `act(claim)` between a step's body and its one-statement commit."""
    real = chain.commit_alone

    def commit(c, kind, payload, carry):
        act(c)
        return real(c, kind, payload, carry)

    monkeypatch.setattr(chain, "commit_alone", commit)


def test_a_cancel_asked_during_a_step_stops_the_chain_at_its_commit(published, monkeypatch) -> None:
    """The one-statement commit advances only a run that nobody asked to cancel; otherwise it
    writes nothing and the general commit finishes the cancel."""
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    published.clear()
    _before_the_commit(monkeypatch, lambda c: c.name == "s2" and runs.cancel(c.run_id, "test"))

    assert protocol.execute(first_step(ref.task_run_id), starts_run=True) == "succeeded"

    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == "canceled"
    assert [(r[0], r[1]) for r in _steps(ref.task_run_id)] == [("s1", "succeeded"), ("s2", "succeeded")]
    assert published == []


def test_a_step_whose_lease_moved_on_commits_nothing(published, monkeypatch) -> None:
    """The fence holds in the one-statement commit: another attempt owns the step now (the
    sweeper re-claimed it), so this attempt's result, and the next step, are refused."""
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())

    def steal(c) -> None:
        if c.name == "s2":
            sql("UPDATE engine.step SET lease_token = gen_random_uuid() WHERE id = %s", (c.step_id,))

    _before_the_commit(monkeypatch, steal)

    assert protocol.execute(first_step(ref.task_run_id), starts_run=True) == "lease_lost"

    assert [(r[0], r[1]) for r in _steps(ref.task_run_id)] == [("s1", "succeeded"), ("s2", "running")]
    assert (
        scalar(
            "SELECT outcome FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
            "WHERE s.run_id = %s AND s.name = 's2'",
            (ref.task_run_id,),
        )
        is None
    ), "the stolen attempt was not closed as a success"
    assert scalar("SELECT current_stage FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == 1
