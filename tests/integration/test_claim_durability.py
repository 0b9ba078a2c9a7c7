"""A claim commits without waiting for its WAL flush; a step's commit still waits for it.

Why (`proj.engine.store.claims`, "One durable commit per step"): a claim that a crash of the
Postgres host loses leaves what a crash just before the claim would have left: the step
`pending`, no attempt. The body under that lost claim is fenced (its fenced writes and its commit
need the step `running` under its token), and any synchronous commit after the claim (a fenced
business write, a ledger record, the step's own commit) flushes the WAL up to itself, the claim
included, so nothing durable can depend on a claim that was lost.

These tests show the setting is where it must be (the claim's transaction, never the commit's
nor a pooled connection's next statement), and break the claim on purpose, as the crash would:
the stale body writes nothing, and the step runs again and commits once.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sqlalchemy import text

from proj import db
from proj.engine import protocol, runs
from proj.engine.store import claims as store
from proj.engine.store import recovery
from proj.settings import get_settings
from tests.conftest import new_key
from tests.support.services import scalar, sql
from tests.support.steps import first_step

SETTING = text("SELECT current_setting('synchronous_commit')")


def _claim_params(step_id: int) -> dict[str, Any]:
    return {"step_id": step_id, "token": uuid.uuid4(), "owner": "test", "ttl": 30.0}


def test_a_claim_commits_without_waiting_for_the_wal_flush() -> None:
    """Inside a transaction the claim sets `synchronous_commit=off` for that transaction only:
    the admission transaction of a limited kind (the claim is its last write) commits without
    the flush, and the next transaction is back to the server's setting."""
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    with db.transaction() as s:
        assert s.execute(SETTING).scalar_one() == "on"
        assert store.claim(s, **_claim_params(first_step(ref.task_run_id))) is not None
        assert s.execute(SETTING).scalar_one() == "off"
    with db.transaction() as s:
        assert s.execute(SETTING).scalar_one() == "on"


def _take(take: str, ex: db.Autocommit, step_id: int) -> None:
    if take == "claim_batch":
        got = store.claim_batch(ex, step_ids=[step_id], tokens=[uuid.uuid4()], owner="test", ttl=30.0)
        assert len(got) == 1
    else:
        assert getattr(store, take)(ex, **_claim_params(step_id)) is not None


@pytest.mark.parametrize("take", ["claim", "claim_start", "claim_batch"])
def test_every_claim_statement_sets_it_for_its_own_transaction(take: str) -> None:
    """Each claiming statement relaxes the transaction it runs in (here an open one, so that
    the setting can be read back before the commit)."""
    step_id = first_step(runs.enqueue("probe", {}, idempotency_key=new_key()).task_run_id)
    fairy = db.get_engine().raw_connection()
    try:
        pg = fairy.driver_connection
        pg.autocommit = False  # psycopg opens a transaction at the first statement
        ex = db.Autocommit(pg)
        assert ex.first(SETTING, {})[0] == "on"
        _take(take, ex, step_id)
        assert ex.first(SETTING, {})[0] == "off"
        pg.rollback()
    finally:
        fairy.close()


@pytest.mark.parametrize("take", ["claim", "claim_start", "claim_batch"])
def test_the_setting_ends_with_the_claim_statement_on_a_pooled_connection(take: str) -> None:
    """On the autocommit path the claim is its own transaction: the step's commit, the next
    statement on that pooled connection, still waits for its flush."""
    step_id = first_step(runs.enqueue("probe", {}, idempotency_key=new_key()).task_run_id)
    with db.autocommit() as conn:
        _take(take, conn, step_id)
        assert conn.first(SETTING, {})[0] == "on"


def test_a_claim_that_finds_nothing_leaves_the_setting_alone() -> None:
    step_id = first_step(runs.enqueue("probe", {}, idempotency_key=new_key()).task_run_id)
    with db.transaction() as s:
        assert store.claim(s, **_claim_params(step_id)) is not None
    with db.transaction() as s:
        assert store.claim(s, **_claim_params(step_id)) is None, "taken already"
        assert s.execute(SETTING).scalar_one() == "on"


def test_a_claim_lost_to_a_crash_is_fenced_and_the_step_runs_again(published, monkeypatch) -> None:
    """Break it on purpose: right after s2's claim returns, its rows go back to what WAL replay
    would leave had the claim's commit not reached the disk (`pending`, no lease, no attempt).
    The body still runs under the lost token: its fenced write and its commit are refused. The
    sweeper's re-sent message (a `pending` step whose message was consumed is a lost message)
    then runs s2 once more, and the run ends with each effect written once."""
    monkeypatch.setattr(get_settings(), "inline_steps", 0)
    ref = runs.enqueue("probe", {"fenced_effect": True}, idempotency_key=new_key())
    run = ref.task_run_id
    published.clear()
    assert protocol.execute(first_step(run), starts_run=True, limited=False) == "succeeded"
    (s2,) = published
    published.clear()

    real = protocol._claim

    def claim_then_lose_it(step_id: int, starts_run: bool = False, limited: bool = True):
        c, kicks = real(step_id, starts_run, limited)
        assert c is not None
        sql(
            "UPDATE engine.step SET status = 'pending', lease_token = NULL, lease_owner = NULL, "
            "lease_until = NULL, attempts = attempts - 1, started_at = NULL, claimed_at = NULL "
            "WHERE id = %s",
            (step_id,),
        )
        return c, kicks

    monkeypatch.setattr(protocol, "_claim", claim_then_lose_it)
    assert protocol.execute(s2.step_id, limited=False) == "lease_lost"
    monkeypatch.setattr(protocol, "_claim", real)

    assert sql("SELECT status, attempts FROM engine.step WHERE id = %s", (s2.step_id,)) == [("pending", 0)]
    assert scalar("SELECT count(*) FROM testkit.effect WHERE run_id = %s AND step = 's2'", (run,)) == 0
    assert scalar("SELECT count(*) FROM engine.step WHERE run_id = %s", (run,)) == 2, "no s3"
    assert published == []
    with db.transaction() as s:  # the sweeper's pick: a pending step whose message went out a while ago
        due = recovery.publish_due(s, again_s=0, again_unconsumed_s=0, n=10_000)
        assert s2.step_id in {d.id for d in due}

    step_id = s2.step_id
    for _ in range(4):  # s2 again (the re-sent message), then s3 … s5
        assert protocol.execute(step_id, limited=False) == "succeeded"
        if published:
            step_id = published.pop().step_id
    assert published == []
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (run,)) == "succeeded"
    assert sql("SELECT name, status, attempts FROM engine.step WHERE run_id = %s ORDER BY stage", (run,)) == [
        (f"s{i}", "succeeded", 1) for i in range(1, 6)
    ]
    # The body ran twice, as after any crash mid-step (bodies are idempotent, invariant 2); its
    # fenced write landed once.
    bodies = "SELECT count(*) FROM testkit.execution WHERE run_id = %s AND step = 's2'"
    assert scalar(bodies, (run,)) == 2
    effects = "SELECT step, count(*) FROM testkit.effect WHERE run_id = %s GROUP BY step ORDER BY step"
    assert sql(effects, (run,)) == [(f"s{i}", 1) for i in range(1, 6)]
