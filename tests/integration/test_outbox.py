"""Invariant 6: the outbox bridges the business transaction and the broker.

Rows are written in the caller's transaction; `outbox.dispatch` hands them to the real engine
(`CeleryTaskEngine.enqueue`, idempotent by key). Faults are real: a dispatcher process SIGKILLed
between enqueue and the mark, concurrent dispatchers, a broker that is not there (then is), and
payloads the engine rejects. Assertions read `outbox.outbox_event`, `engine.task_run` and the
step bodies' own rows (`testkit.execution`).
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import text

import outbox
from outbox import nudge
from outbox.celery import install
from proj import db
from proj.engine import runs
from proj.engine.celery_engine import CeleryTaskEngine
from proj.engine.errors import IdempotencyConflict
from tests.conftest import new_key
from tests.support import services
from tests.support.services import scalar, sql, wait_for

FAST = outbox.RetryPolicy(
    max_attempts=4, initial_s=0.05, max_s=0.2, poison=(ValueError, TypeError, IdempotencyConflict)
)


def rows() -> list[tuple[Any, ...]]:
    return sql(
        "SELECT idempotency_key, status, attempts, run_ref, last_error FROM outbox.outbox_event ORDER BY id"
    )


def status_of(key: str) -> str:
    return scalar("SELECT status FROM outbox.outbox_event WHERE idempotency_key = %s", (key,))


def run_ids(key: str) -> list[uuid.UUID]:
    return [r[0] for r in sql("SELECT id FROM engine.task_run WHERE idempotency_key = %s", (key,))]


@pytest.fixture
def nudges():
    """Record nudges instead of sending them (restores the installed nudger afterwards)."""
    import proj.celery  # noqa: F401  installs the real nudger, which is put back at the end

    sent: list[float] = []
    previous = outbox.set_nudger(lambda: sent.append(time.monotonic()))
    yield sent
    nudge.restore_nudger(previous)


@pytest.fixture
def no_nudge():
    import proj.celery  # noqa: F401

    previous = outbox.set_nudger(None)
    yield
    nudge.restore_nudger(previous)


# --------------------------------------------------------------------------------------------
# add: in the caller's transaction


def test_rollback_leaves_no_row_and_no_nudge(nudges) -> None:
    key = new_key()
    sessions = db.sessions()
    with sessions() as s:
        s.begin()
        outbox.add(s, "probe", key, {"n": 1})
        inside = text("SELECT count(*) FROM outbox.outbox_event WHERE idempotency_key = :k")
        assert s.scalar(inside, {"k": key}) == 1  # visible inside the transaction
        s.rollback()
    assert rows() == []
    assert nudge.current().flush(2)
    assert nudges == []

    # A commit with several events nudges once, after the commit.
    with sessions.begin() as s:
        for i in range(3):
            outbox.add(s, "probe", f"{key}-{i}", {"n": i})
        assert nudges == []
    assert nudge.current().flush(2)
    assert len(nudges) == 1
    assert [r[1] for r in rows()] == ["pending"] * 3

    # The same session, reused after a rollback, does not nudge for the rolled-back event; a
    # savepoint rolled back inside a committed transaction does not cancel the outer nudge.
    with sessions() as s:
        s.begin()
        outbox.add(s, "probe", f"{key}-gone", {"n": 5})
        s.rollback()
        s.begin()
        s.execute(text("SELECT 1"))
        s.commit()
        assert nudge.current().flush(2) and len(nudges) == 1
        s.begin()
        outbox.add(s, "probe", f"{key}-outer", {"n": 6})
        nested = s.begin_nested()
        outbox.add(s, "probe", f"{key}-inner", {"n": 7})
        nested.rollback()
        s.commit()
    assert nudge.current().flush(2) and len(nudges) == 2
    assert sql(
        "SELECT idempotency_key FROM outbox.outbox_event WHERE idempotency_key LIKE %s", (f"{key}-%",)
    ) == [(f"{key}-{i}",) for i in range(3)] + [(f"{key}-outer",)]

    # The business write and the event share the fate of the transaction.
    with pytest.raises(RuntimeError), sessions.begin() as s:
        outbox.add(s, "probe", f"{key}-late", {"n": 9})
        raise RuntimeError("business rule failed after the event was added")
    assert (
        scalar("SELECT count(*) FROM outbox.outbox_event WHERE idempotency_key = %s", (f"{key}-late",)) == 0
    )
    assert nudge.current().flush(2) and len(nudges) == 2


def test_add_is_idempotent_and_validates(nudges) -> None:
    key = new_key()
    with db.transaction() as s:
        first = outbox.add(s, "probe", key, {"n": 1})
    with db.transaction() as s:
        assert outbox.add(s, "probe", key, {"n": 1}) == first
    with pytest.raises(outbox.OutboxConflict), db.transaction() as s:
        outbox.add(s, "probe", key, {"n": 2})
    for kind, k, payload in (("", key, {}), ("probe", "", {}), ("probe", key + "x", {"t": object()})):
        with pytest.raises(outbox.BadEvent), db.transaction() as s:
            outbox.add(s, kind, k, payload)
    assert sql("SELECT idempotency_key, payload FROM outbox.outbox_event") == [(key, {"n": 1})]


def test_add_of_a_key_purged_between_its_insert_and_its_read_adds_it_again(nudges) -> None:
    """`add` of a key whose dispatched row exists: the insert does nothing, then the row is read
    back. A purge committed between those two statements (forced here, on the real database)
    left the read empty, and `add` raised `NoResultFound` inside the caller's transaction. Now
    the insert is tried again and lands: the purged key is pending once more (its run was
    enqueued idempotently, so dispatching it again enqueues the same run)."""
    from sqlalchemy import event

    key = new_key()
    with db.transaction() as s:
        first = outbox.add(s, "probe", key, {"n": 1})
    assert sql(
        "UPDATE outbox.outbox_event SET status = 'dispatched', dispatched_at = now() - interval '1 hour' "
        "WHERE id = %s RETURNING id",
        (first,),
    ) == [(first,)]
    purged: list[int] = []

    def purge_before_the_read(conn, cursor, statement: str, *_: object) -> None:  # noqa: ANN001
        if not purged and statement.lstrip().upper().startswith("SELECT") and "outbox_event" in statement:
            with db.transaction() as other:  # another connection: commits before the read runs
                purged.append(outbox.purge_dispatched(other, 60))

    with db.transaction() as s:
        bind = s.get_bind()
        event.listen(bind, "before_cursor_execute", purge_before_the_read)
        try:
            again = outbox.add(s, "probe", key, {"n": 1})
        finally:
            event.remove(bind, "before_cursor_execute", purge_before_the_read)
    assert purged == [1], "the purge did not run between the insert and the read"
    assert again != first
    assert sql("SELECT id, status FROM outbox.outbox_event WHERE idempotency_key = %s", (key,)) == [
        (again, "pending")
    ]


# --------------------------------------------------------------------------------------------
# dispatch


class CountingEngine:
    """The real engine, counting `enqueue` calls per key (duplicates would be invisible in the
    database, because enqueue is idempotent)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.real = CeleryTaskEngine()
        self.calls: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.delay_s = delay_s

    def enqueue(self, kind: str, input: Mapping[str, Any], *, idempotency_key: str) -> Any:
        with self.lock:
            self.calls[idempotency_key] += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.real.enqueue(kind, input, idempotency_key=idempotency_key)


def test_crash_between_enqueue_and_mark_still_makes_one_run(inproc, no_nudge) -> None:
    """A dispatcher process is SIGKILLed right after `enqueue` returned, before its mark
    committed. The row stays pending; the next dispatch enqueues the same key again, which names
    the same run, and the run's steps execute once."""
    key = new_key()
    with db.transaction() as s:
        outbox.add(s, "probe", key, {"n": 3})
    code = (
        "import os, signal, outbox\n"
        "from proj import db\n"
        "from proj.engine.celery_engine import CeleryTaskEngine\n"
        "class Crash(CeleryTaskEngine):\n"
        "    def enqueue(self, kind, input, *, idempotency_key, **kw):\n"
        "        ref = super().enqueue(kind, input, idempotency_key=idempotency_key, **kw)\n"
        "        print(ref.task_run_id, flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "outbox.dispatch(db.sessions(), Crash())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(services.ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=services.ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    first_run = uuid.UUID(proc.stdout.strip())
    assert rows()[0][:4] == (key, "pending", 0, None), "the mark died with the dispatcher"
    assert run_ids(key) == [first_run]

    engine = CountingEngine()
    report = outbox.dispatch(db.sessions(), engine)
    assert report.dispatched == 1 and engine.calls[key] == 1
    assert rows()[0][:4] == (key, "dispatched", 1, str(first_run))
    assert run_ids(key) == [first_run]
    wait_for(lambda: inproc.get(first_run).status == "succeeded", 30, what="the run")
    assert sql("SELECT step, count(*) FROM testkit.execution GROUP BY step ORDER BY step") == [
        (f"s{i}", 1) for i in range(1, 6)
    ]


def test_concurrent_dispatchers_enqueue_each_event_once(no_nudge) -> None:
    n, dispatchers = 200, 4
    keys = [new_key() for _ in range(n)]
    with db.transaction() as s:
        for i, key in enumerate(keys):
            outbox.add(s, "probe", key, {"n": i})
    engine = CountingEngine(delay_s=0.003)
    barrier = threading.Barrier(dispatchers)
    reports: list[outbox.DispatchReport] = []

    def run() -> None:
        barrier.wait()
        reports.append(outbox.dispatch(db.sessions(), engine, batch=10))

    threads = [threading.Thread(target=run) for _ in range(dispatchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    assert sorted(engine.calls) == sorted(keys)
    assert set(engine.calls.values()) == {1}, "an event was handed to the engine twice"
    assert sum(r.dispatched for r in reports) == n
    assert sum(1 for r in reports if r.dispatched) >= 2, f"no concurrency happened: {reports}"
    assert scalar("SELECT count(*) FROM outbox.outbox_event WHERE status = 'dispatched'") == n
    assert scalar("SELECT count(*) FROM engine.task_run") == n
    assert (
        scalar(
            "SELECT count(*) FROM outbox.outbox_event o JOIN engine.task_run r "
            "ON r.id::text = o.run_ref AND r.idempotency_key = o.idempotency_key"
        )
        == n
    )


def test_poison_payload_goes_dead_and_does_not_block_the_rest(inproc, no_nudge) -> None:
    taken = new_key()
    inproc.enqueue("probe", {"n": 1}, idempotency_key=taken)
    with db.transaction() as s:  # poison first: oldest rows, first in every batch
        outbox.add(s, "probe", "bad-input", {"n": "not a number"})
        outbox.add(s, "no-such-kind", "bad-kind", {})
        outbox.add(s, "probe", taken, {"n": 2})  # the key names a run with another input
        good = [new_key() for _ in range(5)]
        for i, key in enumerate(good):
            outbox.add(s, "probe", key, {"n": i})

    # Small batches: the poison rows come first in every batch they are due in.
    slow = outbox.RetryPolicy(initial_s=30.0, poison=FAST.poison)
    first = outbox.dispatch(db.sessions(), CeleryTaskEngine(), batch=2, policy=slow)
    assert (first.dispatched, first.retried, first.dead) == (5, 3, 0)
    assert all(status_of(k) == "dispatched" for k in good)
    assert sql("SELECT DISTINCT attempts FROM outbox.outbox_event WHERE status = 'pending'") == [(1,)]

    sql("UPDATE outbox.outbox_event SET next_attempt_at = now() WHERE status = 'pending'")

    wait_for(
        lambda: (
            (outbox.dispatch(db.sessions(), CeleryTaskEngine(), policy=FAST) and False)
            or scalar("SELECT count(*) FROM outbox.outbox_event WHERE status = 'dead'") == 3
        ),
        10,
        what="the poison rows to go dead",
    )
    dead = {
        r[0]: (r[1], r[2]["type"])
        for r in sql(
            "SELECT idempotency_key, attempts, last_error FROM outbox.outbox_event WHERE status = 'dead'"
        )
    }
    assert dead == {
        "bad-input": (3, "InvalidInput"),
        "bad-kind": (3, "UnknownKind"),
        taken: (3, "IdempotencyConflict"),
    }
    assert run_ids("bad-input") == [] and run_ids("bad-kind") == []
    assert sql("SELECT input->>'n' FROM engine.task_run WHERE idempotency_key = %s", (taken,)) == [("1",)]
    for key in good:
        (run_id,) = run_ids(key)
        wait_for(lambda run_id=run_id: inproc.get(run_id).status == "succeeded", 30, what="good runs")
    report = outbox.dispatch(db.sessions(), CeleryTaskEngine(), policy=FAST)
    assert report.claimed == 0, "dead rows are never claimed again"


class FlakyBroker:
    """An engine whose enqueue raises `ConnectionError` until `up` is set.

    The outbox's contract is with any `outbox.Engine`, and its back-off is tested against one
    that fails. Ours cannot be made to fail by a broker outage: its enqueue commits the run in
    Postgres and the sweeper publishes later (`test_broker_down_rows_stay_pending…` below uses a
    real dead broker for what that path does)."""

    def __init__(self) -> None:
        self.up = False
        self.real = CeleryTaskEngine()

    def enqueue(self, kind: str, input: Mapping[str, Any], *, idempotency_key: str) -> Any:
        if not self.up:
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6390. Connection refused.")
        return self.real.enqueue(kind, input, idempotency_key=idempotency_key)


def test_failures_back_off_exponentially_then_dead_with_the_error(no_nudge) -> None:
    keys = [new_key(), new_key()]
    with db.transaction() as s:
        for key in keys:
            outbox.add(s, "probe", key, {"n": 1})
    engine = FlakyBroker()
    delays = []
    for attempt in range(1, 4):
        r = outbox.dispatch(db.sessions(), engine)
        assert r.retried == 2 and r.dispatched == 0
        row = sql(
            "SELECT attempts, status, extract(epoch FROM next_attempt_at - clock_timestamp()), last_error "
            "FROM outbox.outbox_event WHERE idempotency_key = %s",
            (keys[0],),
        )[0]
        assert row[0] == attempt and row[1] == "pending"
        assert row[3]["type"] == "ConnectionError" and "Connection refused" in row[3]["message"]
        delays.append(float(row[2]))
        assert outbox.dispatch(db.sessions(), engine).claimed == 0, "not due before its backoff"
        sql("UPDATE outbox.outbox_event SET next_attempt_at = now()")
    assert [round(d) for d in delays] == [1, 2, 4]

    # Past the limit: dead, with its error.
    policy = outbox.RetryPolicy(max_attempts=4)
    r = outbox.dispatch(db.sessions(), engine, policy=policy)
    assert r.dead == 2
    assert sql("SELECT DISTINCT status, attempts FROM outbox.outbox_event") == [("dead", 4)]
    assert scalar("SELECT count(*) FROM engine.task_run") == 0


def test_transient_failure_then_recovery_dispatches(no_nudge) -> None:
    key = new_key()
    with db.transaction() as s:
        outbox.add(s, "probe", key, {"n": 1})
    engine = FlakyBroker()
    assert outbox.dispatch(db.sessions(), engine).retried == 1
    engine.up = True
    wait_for(lambda: outbox.dispatch(db.sessions(), engine).dispatched == 1, 5, what="the retry")
    assert rows()[0][1:3] == ("dispatched", 2) and len(run_ids(key)) == 1


# --------------------------------------------------------------------------------------------
# through Celery: the nudge, beat, a broker that is down


def test_nudge_dispatches_at_once_without_beat(procs) -> None:
    """No beat runs: only the post-commit nudge can make these events run. With the nudge
    disabled, the same kind of event stays pending."""
    import proj.celery  # noqa: F401  installs the nudge in this process

    procs.worker("w", concurrency=2)
    previous = outbox.set_nudger(None)
    try:
        with db.transaction() as s:
            outbox.add(s, "probe", "no-nudge", {"n": 0})
        time.sleep(3)
        assert status_of("no-nudge") == "pending" and run_ids("no-nudge") == []
    finally:
        nudge.restore_nudger(previous)

    key = new_key()
    with db.transaction() as s:
        outbox.add(s, "probe", key, {"n": 1})
    committed = time.time()
    wait_for(lambda: run_ids(key), 10, what="the nudged dispatch")
    (run_id,) = run_ids(key)
    # Started = its first step was claimed by the worker. (Not waiting for the whole run: with no
    # sweeper, a step message lost to a Redis restart by another test suite would stall it.)
    wait_for(lambda: runs.get(run_id).started_at, 10, what="the run to start")
    started = runs.get(run_id).started_at.timestamp()  # no beat: only the nudge started it
    print(f"\nnudged run started {started - committed:.2f}s after the commit")
    assert rows()[-1][:2] == (key, "dispatched")
    assert "outbox.dispatch" in procs.log("w")


def test_beat_dispatches_without_the_nudge(procs, no_nudge) -> None:
    procs.worker("w", concurrency=2)
    procs.beat()
    keys = [new_key() for _ in range(5)]
    with db.transaction() as s:
        for i, key in enumerate(keys):
            outbox.add(s, "probe", key, {"n": i})
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 5,
        30,
        what="beat to dispatch and the runs to finish",
    )
    assert {r[0]: r[1] for r in rows()} == dict.fromkeys(keys, "dispatched")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broker_down_rows_stay_pending_then_go_out_when_it_is_back(procs, tmp_path) -> None:
    """Worker, beat and the nudge all point at a broker that is not running. Events commit
    fine, nothing is dispatched; when a Redis appears on that port, beat dispatches them and
    the runs finish, each once."""
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    dead = Celery("dead-broker", broker=url)
    dead.conf.broker_connection_timeout = 1
    previous = nudge.current()
    install(dead, session_factory=db.sessions(), engine_factory=CeleryTaskEngine, queue="engine")
    env = {"BROKER_URL": url}
    procs.worker("w", concurrency=2, env=env, wait=False)
    procs.beat(env=env)
    redis_proc: subprocess.Popen[bytes] | None = None
    try:
        keys = [new_key() for _ in range(5)]
        with db.transaction() as s:
            for i, key in enumerate(keys):
                outbox.add(s, "probe", key, {"n": i})
        assert nudge.current().flush(10)
        assert nudge.current().failed >= 1 and nudge.current().sent == 0
        wait_for(
            lambda: "Cannot connect" in procs.log("w") and "Connection error" in procs.log("beat"),
            60,
            what="worker and beat to find the broker down",
        )
        time.sleep(1)
        assert [r[1:3] for r in rows()] == [("pending", 0)] * 5, "nothing can dispatch without a broker"
        assert scalar("SELECT count(*) FROM engine.task_run") == 0

        redis_proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=(tmp_path / "redis.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        wait_for(
            lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 5,
            90,
            what="the broker to come back, beat to dispatch and the runs to finish",
        )
        assert [r[1] for r in rows()] == ["dispatched"] * 5
        for key in keys:
            assert len(run_ids(key)) == 1
        assert scalar("SELECT count(*) FROM testkit.execution") == 25
    finally:
        nudge.restore_nudger(previous)
        procs.stop_all()
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait(10)


def test_models_match_the_migration() -> None:
    from tests.integration.test_ledger import schema_diff

    assert schema_diff("outbox", outbox.Base.metadata) == []
