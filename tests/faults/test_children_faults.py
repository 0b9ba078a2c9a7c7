"""Issue 20 under real faults: SIGKILL of the parent's worker right after it enqueued a child,
and of the child's worker mid-step. Workers are real `celery -A proj worker` processes."""

from __future__ import annotations

from proj.engine import runs
from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for


def _status(run_id) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def _children(run_id) -> list[tuple]:
    return sql("SELECT id, status FROM engine.task_run WHERE parent_run_id = %s", (run_id,))


def _executions(step: str) -> list[tuple]:
    return sql(
        "SELECT run_id, pid, attempt, ended_at FROM testkit.execution WHERE step = %s ORDER BY id", (step,)
    )


def test_kill_9_of_the_parents_worker_right_after_the_child_was_enqueued(procs) -> None:
    """The victim serves only the parent kind; its pool process SIGKILLs itself right after the
    commit that enqueued the child and parked the step, before any message for the child went out. Exactly
    one child exists, it runs on the rescuer (its message re-sent by the sweeper) and the
    parent finishes there with the child's result."""
    procs.worker(
        "victim",
        concurrency=1,
        env={"ENGINE_SERVE": "cparent@1", "FAULT_KILL_AFTER_CHILD_ENQUEUE": "1"},
    )
    procs.beat()
    ref = runs.enqueue("cparent", {"n": 5}, idempotency_key=new_key())
    wait_for(lambda: _children(ref.task_run_id), 30, what="the child row")
    wait_for(lambda: "SIGKILL" in procs.log("victim"), 30, what="the victim's process to be killed")
    procs.worker("rescuer", concurrency=2)
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 60, what="the parent to finish")
    assert runs.get(ref.task_run_id).result == {"got": {"y": 10}}
    assert len(_children(ref.task_run_id)) == 1
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'cleaf'") == 1
    assert len(_executions("prep")) == 1, "the completed prep step never re-ran"
    assert len(_executions("work")) == 1 and len(_executions("after")) == 1


def test_a_childs_worker_killed_mid_step_recovers_and_the_parent_gets_the_result_once(procs) -> None:
    procs.worker("victim", concurrency=1, env={"ENGINE_SERVE": "cleaf@1"})
    procs.worker("parents", concurrency=1, env={"ENGINE_SERVE": "cparent@1"})
    procs.beat()
    ref = runs.enqueue("cparent", {"n": 8, "slow_s": 30}, idempotency_key=new_key())
    wait_for(lambda: _executions("work"), 30, what="the child's step to start on the victim")
    procs.worker("rescuer", concurrency=1, env={"ENGINE_SERVE": "cleaf@1"})
    procs.kill("victim")
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 60, what="the parent to finish")
    work = _executions("work")
    assert len(work) == 2 and work[0][3] is None and work[1][1] != work[0][1], "ran again elsewhere"
    assert runs.get(ref.task_run_id).result == {"got": {"y": 16}}
    assert len(_executions("after")) == 1, "the parent got the result once"
    assert (
        scalar(
            "SELECT count(*) FROM engine.step WHERE run_id = %s AND name = 'verify' AND status = 'succeeded'",
            (ref.task_run_id,),
        )
        == 1
    )
    assert len(_children(ref.task_run_id)) == 1
