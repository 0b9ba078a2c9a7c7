"""Mass wakes travel in batches (issue #17): one message per WAKE_BATCH woken steps.

A signal that wakes many parked runs sends a few messages, each naming several step rows; the
delivery claims and runs them one after another, each with its own claim, lease and fenced
commit, so every run still goes through each step exactly once. Past the inline budget the rest
of a batch goes back to the broker. `INLINE_STEPS=0` keeps one message per step.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import redis

from proj.engine import runs
from proj.engine.dispatch import wake_batch_size
from proj.engine.heartbeat import Heartbeat
from proj.settings import get_settings
from tests.conftest import BROKER, new_key
from tests.support.plans import generic_plan
from tests.support.services import scalar, sql, wait_for


@pytest.fixture
def wake_batch(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv("WAKE_BATCH", "8")
    get_settings.cache_clear()
    yield 8
    monkeypatch.delenv("WAKE_BATCH")
    get_settings.cache_clear()


def test_per_message_mode_keeps_one_message_per_step(monkeypatch: pytest.MonkeyPatch, wake_batch) -> None:
    assert wake_batch_size() == 8
    monkeypatch.setenv("INLINE_STEPS", "0")
    get_settings.cache_clear()
    assert wake_batch_size() == 1


def queued(queue: str) -> int:
    """Messages waiting in a Redis queue (this file runs on Redis only, not in the AMQP matrix)."""
    assert BROKER.startswith("redis://"), "counts messages in a Redis list"
    return int(redis.Redis.from_url(BROKER).llen(queue))


def park(procs, n: int, key: str) -> None:
    procs.worker("parker", concurrency=2)
    for _ in range(n):
        runs.enqueue("gated", {"key": key, "timeout_s": 600}, idempotency_key=new_key())
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'waiting'") == n,
        60,
        what=f"{n} parked runs",
    )
    procs.kill("parker")


def test_one_signal_wakes_forty_runs_with_five_messages_each_run_once(procs, wake_batch) -> None:
    key = new_key()
    park(procs, 40, key)
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))
    assert runs.signal(f"approval:{key}") == 40
    assert queued("gated.v1") == 40 // wake_batch  # nobody consumes yet: the messages wait
    procs.worker("w", concurrency=2)
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 40,
        60,
        what="all 40 to wake and finish",
    )
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 40
    assert scalar("SELECT count(DISTINCT run_id) FROM testkit.execution WHERE step = 'after'") == 40
    # Every wait step was claimed once to park and once after the wake: no more (parking does
    # not consume an attempt, invariant 7, so the attempt records tell).
    per_step = scalar(
        "SELECT array_agg(DISTINCT n) FROM (SELECT count(*) AS n FROM engine.attempt a "
        "JOIN engine.step s ON s.id = a.step_id WHERE s.name = 'approval' GROUP BY s.id) c"
    )
    assert per_step == [2]


def test_a_batch_past_its_budget_hands_the_rest_back(
    procs, wake_batch, untraced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batched delivery of 16 woken steps with no inline budget left (`INLINE_BUDGET_S=0`):
    its first chunk (`protocol.CLAIM_CHUNK`, 8) runs, and the unclaimed rest goes back to the
    broker as one message naming exactly them, which a later delivery then runs."""
    from proj.engine import dispatch, protocol

    assert protocol.CLAIM_CHUNK == 8
    ids = woken_chunk(procs, 16)
    published: list[dispatch.Dispatch] = []  # from here on, recorded instead of sent
    monkeypatch.setattr(dispatch, "publish_after_commit", lambda items: published.extend(items))
    monkeypatch.setenv("INLINE_BUDGET_S", "0")
    get_settings.cache_clear()
    task = ("gated.v1.approval", "gated.v1")
    protocol.execute(ids[0], more=ids[1:], starts_run=True, task=task, limited=False)

    def wait_steps(status: str) -> list[int]:
        return [
            r[0]
            for r in sql(
                "SELECT id FROM engine.step WHERE id = ANY(%s) AND status = %s ORDER BY id", (ids, status)
            )
        ]

    assert wait_steps("succeeded") == ids[:8]
    assert wait_steps("pending") == ids[8:], "the rest was left unclaimed"
    handed_back = [d for d in published if d.task_name == task[0]]
    assert [(d.step_id, d.more, d.queue) for d in handed_back] == [(ids[8], tuple(ids[9:]), task[1])]
    d = handed_back[0]
    protocol.execute(d.step_id, more=d.more, starts_run=True, task=task, limited=False)
    assert wait_steps("succeeded") == ids


@pytest.fixture
def untraced(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tracer set in this process, whatever an earlier test configured: a traced attempt
    takes the ladder (which records its span), not the chunk's commit."""
    from proj.engine import tracing

    monkeypatch.setattr(tracing, "_off", lambda: True)


def parked_wait_steps() -> list[int]:
    return [r[0] for r in sql("SELECT id FROM engine.step WHERE name = 'approval' ORDER BY id")]


def test_overlapping_batches_claim_each_step_once(procs, wake_batch) -> None:
    """A chunk is claimed in one statement (`store.claims.CLAIM_BATCH`); a duplicate message
    naming the same steps, in another order, claims none of them a second time."""
    from proj.engine import dispatch
    from proj.engine.dispatch import Dispatch

    key = new_key()
    park(procs, 16, key)
    ids = parked_wait_steps()
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))
    assert runs.signal(f"approval:{key}") == 16
    # Two more deliveries of all 16, reversed and shuffled: as if the sweeper re-sent them.
    for dup in (ids[::-1], ids[5:] + ids[:5]):
        dispatch.publish_after_commit([Dispatch(dup[0], "gated.v1.approval", "gated.v1", 0, tuple(dup[1:]))])
    procs.worker("w", concurrency=2)
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 16,
        60,
        what="all 16 to finish",
    )
    wait_for(lambda: queued("gated.v1") == 0, 30, what="the duplicates to be consumed")
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 16
    per_step = scalar(
        "SELECT array_agg(DISTINCT n) FROM (SELECT count(*) AS n FROM engine.attempt a "
        "JOIN engine.step s ON s.id = a.step_id WHERE s.name = 'approval' GROUP BY s.id) c"
    )
    assert per_step == [2]  # parked once, claimed once after the wake


def woken_chunk(procs, n: int = 8) -> list[int]:
    """`n` untraced `gated` runs parked, approved and woken by one signal: their wait steps'
    ids, pending, for a test to deliver as one batched message (an earlier test may have set a
    tracer, and a traced attempt rightly takes the ladder)."""
    key = new_key()
    park(procs, n, key)
    sql("UPDATE engine.task_run SET trace = NULL")
    ids = parked_wait_steps()
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))
    assert runs.signal(f"approval:{key}") == n
    return ids


def test_claimed_steps_waiting_their_turn_keep_their_lease(
    procs, wake_batch, untraced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps of a chunk are claimed together and checked one after another: while the first
    check runs longer than a lease (`LEASE_TTL_S=3` in the tests), the heartbeat keeps the
    others' leases alive, so no sweeper could hand them to another worker meanwhile."""
    import time

    from proj.engine import protocol

    ids = woken_chunk(procs)
    seen: list[int] = []
    check = protocol._check

    def slow_first(c, kind, spec):  # the first claimed step's check runs longer than a lease
        if not seen:
            time.sleep(get_settings().lease_ttl_s + 1.5)
            seen.append(
                scalar(
                    "SELECT count(*) FROM engine.step WHERE id = ANY(%s) AND status = 'running' "
                    "AND lease_until > now()",
                    (ids,),
                )
            )
        return check(c, kind, spec)

    monkeypatch.setattr(protocol, "_check", slow_first)
    protocol.execute(  # as the worker calls it: `approval` is `gated`'s start step
        ids[0], more=ids[1:], starts_run=True, task=("gated.v1.approval", "gated.v1"), limited=False
    )
    assert seen == [8]  # all eight claimed, every lease still live after more than a lease
    assert scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 8
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 8


def _recorded_statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Statements this thread sends through psycopg (SQLAlchemy's included)."""
    import threading

    import psycopg

    seen: list[str] = []
    execute, mine = psycopg.Cursor.execute, threading.get_ident()

    def recording(self, query, *args, **kwargs):
        if threading.get_ident() == mine:
            seen.append(str(query))
        return execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    return seen


def test_a_chunks_held_checks_commit_in_one_statement(
    procs, wake_batch, untraced, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The woken wait steps of a chunk run their checks, then the ones that held commit together
    (`store.commits.SUCCEED_AND_CLAIM_NEXT_BATCH`), each fenced by its own token and with its
    run's next step claimed; then each `after` runs inline. One run canceled between the claim
    and the commit is left out of it (its guard) and ends canceled through the ladder."""
    from proj.engine import protocol

    ids = woken_chunk(procs)
    canceled = scalar("SELECT run_id FROM engine.step WHERE id = %s", (ids[3],))
    real_check = protocol._check

    def check_then_cancel_one(c, kind, spec):
        value = real_check(c, kind, spec)
        if c.step_id == ids[3]:
            runs.cancel(canceled, "asked while its chunk was being checked")
        return value

    monkeypatch.setattr(protocol, "_check", check_then_cancel_one)
    # The heartbeat would tell the canceled step's body of the cancel if it ticked between the
    # cancel and the commit (a loaded machine), and the ladder would then close it without
    # trying the commit this test shows refused: no tick during the chunk.
    monkeypatch.setattr(Heartbeat, "renew", lambda self, leases: None)
    seen = _recorded_statements(monkeypatch)
    # As the worker calls it: `approval`, a first step, is `gated`'s start step (`starts_run`).
    # The batched message names woken steps only, so it is claimed in one statement all the same.
    protocol.execute(
        ids[0], more=ids[1:], starts_run=True, task=("gated.v1.approval", "gated.v1"), limited=False
    )

    assert len([q for q in seen if "want AS MATERIALIZED" in q]) == 1, "one claim statement for the chunk"
    assert not [q for q in seen if "better AS" in q], "no start claim: the runs started long ago"
    together = [q for q in seen if "w.next_tok" in q]
    assert len(together) == 1, "one commit statement for the chunk's checks that held"
    # Only the canceled run's step tried to commit alone, through the ladder, and was refused.
    assert len([q for q in seen if "%(next_tok)s" in q]) == 1
    statuses = dict(sql("SELECT status, count(*) FROM engine.task_run GROUP BY status"))
    assert statuses == {"succeeded": 7, "canceled": 1}
    assert scalar("SELECT count(DISTINCT run_id) FROM testkit.execution WHERE step = 'after'") == 7
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 7
    per_step = scalar(
        "SELECT array_agg(DISTINCT n) FROM (SELECT count(*) AS n FROM engine.attempt a "
        "JOIN engine.step s ON s.id = a.step_id WHERE s.name = 'approval' GROUP BY s.id) c"
    )
    assert per_step == [2]  # parked once, claimed once after the wake


def _parked_crowd(waiting: int, topic: str = "herd") -> None:
    """Statistics taken while 3,000 runs had finished and none waited, then `waiting` of them
    parked on `topic` (inserted directly: the state of a mass wake minutes after its runs
    parked, before autovacuum analyzes again)."""
    sql(
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "SELECT gen_random_uuid(), 'gated', 1, 'herd-' || g, '{}', 'h', 'succeeded' "
        "FROM generate_series(1, 3000) g"
    )
    sql(
        "INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, status) "
        "SELECT id, 0, 'approval', 0, 3, 'succeeded' FROM engine.task_run"
    )
    sql("ANALYZE engine.task_run, engine.step")
    sql(
        "UPDATE engine.task_run SET status = 'waiting' "
        "WHERE id IN (SELECT id FROM engine.task_run ORDER BY id LIMIT %s)",
        (waiting,),
    )
    sql(
        "UPDATE engine.step s SET status = 'waiting', wait_topic = %s "
        "FROM engine.task_run r WHERE r.id = s.run_id AND r.status = 'waiting'",
        (topic,),
    )


def test_a_mass_wake_finds_its_runs_by_primary_key() -> None:
    """Statistics taken while no run waited, then 1,500 runs parked on one topic and 500 on
    others (a mass wake minutes after its runs parked, before autovacuum analyzed again): the
    wake reaches each woken step's run by primary key, and joins nothing else. It used to move
    the runs to `running` in a CTE joined to the woken steps, which the planner rescanned once
    per waiting run: 0.32 s of the 2.34 s a fresh `bench.signal_latency` herd took. The runs
    move to `running` at their claims (`test_the_claim_moves_a_woken_run_to_running`)."""
    from proj.engine.store import waits

    _parked_crowd(2000)
    sql("UPDATE engine.step SET wait_topic = 'other-' || id WHERE status = 'waiting' AND id % 4 = 0")
    herd = scalar("SELECT count(*) FROM engine.step WHERE wait_topic = 'herd'")
    plan = generic_plan(waits.WAKE_TOPIC, {"topic": "'herd'"}, {"topic": "text"})
    probe = r"Index Scan using task_run_pkey on task_run r \(actual [^)]*rows=1 loops=(\d+)\)"
    probes = re.search(probe, plan)
    assert probes and int(probes.group(1)) == herd, plan
    assert "CTE Scan" not in plan and "Join Filter" not in plan, plan


def test_the_claim_moves_a_woken_run_to_running() -> None:
    """The wake writes steps only: a woken run still shows `waiting` until a worker claims its
    step, and that claim shows it `running` (the claim's guard admits `waiting` runs). Meanwhile
    its view names no parked topic, and a step nobody picks up gets the usual pending reason."""
    import uuid

    from proj import db
    from proj.engine.store import claims, waits

    sql(
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "VALUES (gen_random_uuid(), 'gated', 1, 'woken', '{}', 'h', 'waiting')"
    )
    sql(
        "INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, status, wait_topic) "
        "SELECT id, 0, 'wait', 0, 3, 'waiting', 'door' FROM engine.task_run WHERE idempotency_key = 'woken'"
    )
    with db.transaction() as s:
        woken = waits.wake_topic(s, "door")
    assert [w.name for w in woken] == ["wait"]
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (woken[0].id,)) == "pending"
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (woken[0].run_id,)) == "waiting"
    view = runs.get(woken[0].run_id)
    assert view is not None and view.status == "waiting" and view.wait_topic is None  # woken, not parked
    sql(
        "UPDATE engine.step SET next_attempt_at = now() - interval '1 hour', "
        "created_at = now() - interval '2 hours' WHERE id = %s",
        (woken[0].id,),
    )  # woken an hour ago, parked since before, and no worker took it
    view = runs.get(woken[0].run_id)
    assert view is not None and (view.pending_reason or "").startswith("not picked up for"), view
    with db.autocommit() as conn:
        claimed = claims.claim(conn, step_id=woken[0].id, token=uuid.uuid4(), owner="w", ttl=15.0)
    assert claimed is not None and claimed.run_id == woken[0].run_id
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (woken[0].run_id,)) == "running"


def test_a_claim_among_many_waiting_runs_reaches_its_run_by_primary_key() -> None:
    """A woken run stays `waiting` until its claim, so a mass wake's claims run beside a crowd of
    waiting runs. Each claim (one step, or a batch of them) still reaches its run by primary key:
    with `status IN ('pending', 'waiting')` as the only guard, the planner could scan every live
    run per claim (`task_run_live_idx`) when the statistics say few runs wait."""
    from proj.engine.store import claims

    _parked_crowd(2000)
    sql(
        "UPDATE engine.step SET status = 'pending' WHERE id IN (SELECT id FROM engine.step "
        "WHERE status = 'waiting' ORDER BY id LIMIT 8)"
    )
    ids = [r[0] for r in sql("SELECT id FROM engine.step WHERE status = 'pending' ORDER BY id")]
    one = {"id": str(ids[0]), "tok": "gen_random_uuid()", "owner": "'w'", "ttl": "3.0"}
    types = {"id": "bigint", "tok": "uuid", "owner": "text", "ttl": "float8"}
    batch = {
        "ids": "ARRAY[" + ",".join(map(str, ids)) + "]::bigint[]",
        "toks": "ARRAY[" + ",".join(["gen_random_uuid()"] * len(ids)) + "]",
        "owner": "'w'",
        "ttl": "3.0",
    }
    batch_types = {"ids": "bigint[]", "toks": "uuid[]", "owner": "text", "ttl": "float8"}
    for statement, values, kinds in (
        (claims.CLAIM, one, types),
        (claims.CLAIM_START, one, types),
        (claims.CLAIM_BATCH, batch, batch_types),
    ):
        plan = generic_plan(statement, values, kinds)
        started = plan[plan.index("CTE started") : plan.index("CTE relaxed")]
        claimed = plan[plan.index("CTE claimed") : plan.index("CTE started")]
        assert "task_run_live_idx" not in claimed and "Seq Scan" not in claimed, plan
        assert "task_run_pkey" in started, plan  # an index scan, or a bitmap of one for a batch
        assert "task_run_live_idx" not in started and "Seq Scan" not in started, plan
