"""Invariants 1, 2, 3 and 9 under real faults: SIGKILL, SIGSTOP, duplicate messages, dropped
Postgres connections and a restarted Redis. Workers are real `celery -A proj worker` processes;
assertions read the business tables (`testkit.*`) and the engine's rows.
"""

from __future__ import annotations

import signal
import time

from proj.engine import runs
from proj.settings import get_settings
from tests.conftest import new_key
from tests.support import services
from tests.support.private import PrivateRedis, private_redis, use_broker
from tests.support.services import scalar, sql, wait_for


def _run_status(run_id) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def _executions(run_id, step: str) -> list[tuple]:
    return sql(
        "SELECT pid, attempt, started_at, ended_at FROM testkit.execution "
        "WHERE run_id = %s AND step = %s ORDER BY id",
        (run_id, step),
    )


def test_kill_9_mid_step_resumes_elsewhere_without_rerunning_completed_steps(procs) -> None:
    """Invariants 1 and 2: completed steps never re-run; the killed step runs again elsewhere
    within lease_ttl + sweep interval (driven by the sweeper, not Redis' visibility timeout)."""
    procs.worker("victim", concurrency=1)
    ref = runs.enqueue("probe", {"slow_step": "s3", "slow_s": 30.0}, idempotency_key=new_key())
    wait_for(lambda: _executions(ref.task_run_id, "s3"), 30, what="s3 to start on the victim")
    procs.worker("rescuer", concurrency=1)
    procs.beat()
    killed_at = scalar("SELECT clock_timestamp()")
    procs.kill("victim")
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 60, what="run to finish")

    for name in ("s1", "s2", "s4", "s5"):
        assert len(_executions(ref.task_run_id, name)) == 1, f"{name} re-ran"
    s3 = _executions(ref.task_run_id, "s3")
    assert len(s3) == 2, "the interrupted step must run exactly once more"
    assert s3[0][3] is None, "the first s3 never finished (its worker was killed)"
    assert s3[1][0] != s3[0][0], "s3 ran again in another process"
    s = get_settings()
    recovery = (s3[1][2] - killed_at).total_seconds()
    assert recovery <= s.lease_ttl_s + s.sweep_interval_s + 2.0, f"recovered in {recovery:.1f}s"
    assert (
        scalar(
            "SELECT count(*) FROM engine.step WHERE run_id = %s AND status = 'succeeded'",
            (ref.task_run_id,),
        )
        == 5
    )


def test_duplicate_messages_and_two_workers_execute_each_step_once(procs) -> None:
    """Invariant 1 under at-least-once delivery: every message is published twice, two workers
    share the queue, and after the runs finish every step message is sent yet again."""
    procs.worker("w1", concurrency=2, env={"FAULT_DUPLICATE_PUBLISH": "2"})
    procs.worker("w2", concurrency=2, env={"FAULT_DUPLICATE_PUBLISH": "2"})
    procs.beat()
    from proj.engine import dispatch

    refs = [runs.enqueue("probe", {"n": i}, idempotency_key=new_key()) for i in range(60)]
    dispatch.publish(_all_step_dispatches())  # the first steps, a second time
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 60,
        120,
        what="60 runs to succeed",
    )
    dispatch.publish(_all_step_dispatches())  # every step again, after completion
    time.sleep(2)
    per_step = sql("SELECT step, count(*), count(DISTINCT run_id) FROM testkit.execution GROUP BY step")
    assert sorted(per_step) == [(f"s{i}", 60, 60) for i in range(1, 6)]
    assert {r.task_run_id for r in refs} == {
        row[0] for row in sql("SELECT id FROM engine.task_run WHERE status = 'succeeded'")
    }


def _all_step_dispatches():
    from proj.engine.dispatch import step_dispatch

    rows = sql(
        "SELECT s.id, r.kind, r.version, s.name FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id"
    )
    return [step_dispatch(i, k, v, n) for i, k, v, n in rows]


def test_retry_cap_fails_after_exactly_max_attempts_with_the_error(inproc) -> None:
    """Invariant 9: a step that always fails ends `failed` after exactly max_attempts."""
    ref = inproc.enqueue("flaky", {"message": "tracker unreachable"}, idempotency_key=new_key())
    wait_for(lambda: _run_status(ref.task_run_id) == "failed", 30, what="run to fail")
    assert len(_executions(ref.task_run_id, "fails")) == 3
    assert len(_executions(ref.task_run_id, "ok")) == 1
    view = inproc.get(ref.task_run_id)
    assert view.attempts == 3
    assert view.last_error["type"] == "RuntimeError"
    assert "tracker unreachable (attempt 3)" in view.last_error["message"]
    assert view.last_error["step"] == "fails"
    time.sleep(1.0)  # nothing runs after the dead letter
    assert len(_executions(ref.task_run_id, "fails")) == 3


def test_non_retryable_error_fails_at_once(inproc) -> None:
    ref = inproc.enqueue("flaky", {"fatal": True}, idempotency_key=new_key())
    wait_for(lambda: _run_status(ref.task_run_id) == "failed", 30, what="run to fail")
    assert len(_executions(ref.task_run_id, "fails")) == 1


def test_sigstopped_worker_cannot_commit_after_losing_its_lease(procs) -> None:
    """Invariant 3: a worker frozen past its lease wakes up and its commits are refused; the
    step's result and the fenced business write are the ones of the worker that took over."""
    procs.worker("sleepy", concurrency=1)
    ref = runs.enqueue(
        "probe",
        {"slow_step": "s2", "slow_s": 6.0, "fenced_effect": True},
        idempotency_key=new_key(),
    )
    wait_for(lambda: _executions(ref.task_run_id, "s2"), 30, what="s2 to start")
    frozen_pid = _executions(ref.task_run_id, "s2")[0][0]
    procs.signal("sleepy", signal.SIGSTOP)
    procs.worker("awake", concurrency=1)
    procs.beat()
    wait_for(lambda: len(_executions(ref.task_run_id, "s2")) == 2, 30, what="s2 taken over")
    new_pid = _executions(ref.task_run_id, "s2")[1][0]
    wait_for(
        lambda: (
            scalar("SELECT status FROM engine.step WHERE run_id = %s AND name = 's2'", (ref.task_run_id,))
            == "succeeded"
        ),
        30,
        what="s2 committed by the new worker",
    )
    procs.signal("sleepy", signal.SIGCONT)
    # The frozen body finishes its sleep (about 6 s) and tries to commit; wait for that.
    wait_for(
        lambda: _executions(ref.task_run_id, "s2")[0][3] is not None or "lease lost" in procs.log("sleepy"),
        30,
        what="the stale attempt to try its commit",
    )
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 60, what="run to finish")
    result = scalar("SELECT result FROM engine.step WHERE run_id = %s AND name = 's2'", (ref.task_run_id,))
    assert result["pid"] == new_pid != frozen_pid
    assert sql("SELECT pid FROM testkit.effect WHERE run_id = %s AND step = 's2'", (ref.task_run_id,)) == [
        (new_pid,)
    ]
    assert "lease lost" in procs.log("sleepy")
    outcomes = sql(
        "SELECT a.worker, a.outcome FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id"
        " WHERE s.run_id = %s AND s.name = 's2' ORDER BY a.attempt, a.started_at",
        (ref.task_run_id,),
    )
    assert [o for _, o in outcomes] == [None, "succeeded"]


def test_postgres_connections_killed_and_redis_restarted_mid_run(procs, tmp_path) -> None:
    """Runs finish when every app connection is terminated and Redis (with the queued
    messages) is restarted while they are in flight. The Redis is a private one
    (`tests.support.private`): the machine's shared Redis is never restarted."""
    with private_redis(tmp_path) as rds, use_broker(rds.url):
        _killed_and_restarted(procs, rds)


def _killed_and_restarted(procs, rds: PrivateRedis) -> None:
    env = {"BROKER_URL": rds.url}
    procs.worker("w1", concurrency=2, env=env)
    procs.worker("w2", concurrency=2, env=env)
    procs.beat(env=env)
    refs = [
        runs.enqueue("probe", {"n": i, "slow_step": "s2", "slow_s": 1.0}, idempotency_key=new_key())
        for i in range(20)
    ]
    wait_for(
        lambda: scalar("SELECT count(*) FROM testkit.execution WHERE step = 's2'") >= 2,
        30,
        what="runs in flight",
    )
    killed = services.terminate_app_connections()
    assert killed > 0
    rds.restart(down_s=1.0)
    time.sleep(0.5)
    services.terminate_app_connections()
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 20,
        120,
        what="all runs to succeed after the faults",
    )
    done = sql("SELECT name, count(*) FROM engine.step WHERE status = 'succeeded' GROUP BY name")
    assert sorted(done) == [(f"s{i}", 20) for i in range(1, 6)]
    # Completed steps never re-run (invariant 1): no body started after its step committed. (A
    # body may run twice here: its commit can die with its connection, which is no completion.)
    rerun = sql(
        "SELECT e.run_id, e.step, e.started_at, s.finished_at FROM testkit.execution e "
        "JOIN engine.step s ON s.run_id = e.run_id AND s.name = e.step "
        "WHERE s.status = 'succeeded' AND e.started_at > s.finished_at"
    )
    assert rerun == [], f"completed steps ran again: {rerun}"
    assert {r.task_run_id for r in refs} == {row[0] for row in sql("SELECT id FROM engine.task_run")}


def test_finish_commits_business_writes_and_the_result_together(procs) -> None:
    """`ctx.finish(result)`: killed inside the block, neither the business row nor the result
    commit; the retry writes the row once (a unique key would refuse a second) and its result."""
    procs.worker("victim", concurrency=1)
    ref = runs.enqueue("finisher", {"hold_in_finish_s": 30}, idempotency_key=new_key())
    wait_for(lambda: _executions(ref.task_run_id, "write"), 30, what="the write step to start")
    # Inside the finish block: the insert sent, its transaction open and not committed.
    wait_for(
        lambda: scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
            "AND query LIKE 'INSERT INTO testkit.effect%%'"
        ),
        30,
        what="the finish block's insert, uncommitted",
    )
    assert scalar("SELECT count(*) FROM testkit.effect") == 0
    procs.kill("victim")
    procs.worker("rescuer", concurrency=1)
    procs.beat()
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 60, what="run to finish")
    rows = sql("SELECT pid FROM testkit.effect WHERE run_id = %s", (ref.task_run_id,))
    result = scalar("SELECT result FROM engine.step WHERE run_id = %s AND name = 'write'", (ref.task_run_id,))
    assert rows == [(result["pid"],)]
    assert len(_executions(ref.task_run_id, "write")) == 2


def test_an_autocommit_connection_killed_mid_use_is_not_pooled_again() -> None:
    """The engine's hot statements use the pooled connection through psycopg directly
    (`db.autocommit`); a connection whose backend died under a statement must be thrown away,
    not handed to the next claim (pooled connections used a moment ago are not pinged)."""
    import psycopg
    import pytest
    from sqlalchemy import text

    from proj import db

    select_pid = text("SELECT pg_backend_pid() AS pid")
    pool = db.get_engine().pool
    in_use = pool.checkedout()
    with pytest.raises(psycopg.OperationalError), db.autocommit() as conn:
        pid = conn.first(select_pid, {}).pid
        sql("SELECT pg_terminate_backend(%s)", (pid,))
        conn.first(select_pid, {})
    assert pool.checkedout() == in_use, "the dead connection was neither returned nor discarded"
    for _ in range(pool.size() + 2):
        with db.autocommit() as conn:
            assert conn.first(select_pid, {}).pid != pid
