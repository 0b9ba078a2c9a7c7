"""Invariant 10: runs keep their version; per-version queues; the committed step lock."""

from __future__ import annotations

import signal
import time

from pydantic import BaseModel

from proj.engine import runs
from proj.engine.kind import Kind, RetryPolicy, step
from proj.engine.versions import current_steps, read_lock, violations
from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for


def test_committed_lock_matches_the_code() -> None:
    assert violations(read_lock(), current_steps()) == []


class _In(BaseModel):
    pass


def _kind(*names: str) -> Kind:
    return Kind(
        name="locked",
        version=1,
        retry=RetryPolicy.db(),
        input_model=_In,
        canvas=tuple(step(n, lambda ctx: None) for n in names),
    )


def test_lock_rejects_rename_remove_reorder_insert_and_allows_append() -> None:
    lock = {"locked@1": ["fetch", "verify", "copy"]}

    def check(*names: str) -> list[str]:
        return violations(lock, current_steps([_kind(*names)]))

    assert check("fetch", "verify", "copy") == []
    assert check("fetch", "verify", "copy", "notify") == []  # appended
    assert check("fetch", "check", "copy")  # renamed
    assert check("fetch", "copy")  # removed
    assert check("verify", "fetch", "copy")  # reordered
    assert check("fetch", "hash", "verify", "copy")  # inserted
    assert check("fetch", "verify", "copy") == []
    unlocked = violations({}, current_steps([_kind("a")]))
    assert unlocked and "proj lock-steps" in unlocked[0]


def _steps_of(run_id) -> list[tuple[str, str]]:
    return sql(
        "SELECT name, result->>'version' FROM engine.step WHERE run_id = %s ORDER BY stage",
        (run_id,),
    )


def test_upgrade_while_running(procs) -> None:
    """Old runs finish on v1 steps after the workers are replaced by a v1+v2 build; new runs
    start on v2; a v2-only worker leaves v1 runs waiting, visibly, until a v1 worker comes."""
    procs.worker("old", concurrency=3, env={"ENGINE_SERVE": "upgr@1"})
    procs.beat()
    old = [runs.enqueue("upgr", {"slow_s": 3.0}, idempotency_key=new_key(), version=1) for _ in range(3)]
    wait_for(
        lambda: scalar("SELECT count(*) FROM testkit.execution WHERE step = 'a'") == 3,
        30,
        what="old runs in flight",
    )
    procs.worker("new", concurrency=2)  # serves upgr@1 and upgr@2 (current + previous)
    procs.signal("old", signal.SIGTERM)  # warm shutdown: in-flight steps finish and commit
    wait_for(lambda: procs.procs["old"].poll() is not None, 30, what="old worker to drain")
    new = [runs.enqueue("upgr", {}, idempotency_key=new_key()) for _ in range(3)]
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 6,
        60,
        what="old and new runs to finish",
    )
    for ref in old:
        assert scalar("SELECT version FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == 1
        assert _steps_of(ref.task_run_id) == [("a", "1"), ("b", "1")]
    for ref in new:
        assert scalar("SELECT version FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == 2
        assert _steps_of(ref.task_run_id) == [("a", "2"), ("b", "2"), ("c", "2")]

    procs.kill("new")
    procs.worker("v2only", concurrency=2, env={"ENGINE_SERVE": "upgr@2"})
    stranded = runs.enqueue("upgr", {}, idempotency_key=new_key(), version=1)
    fresh = runs.enqueue("upgr", {}, idempotency_key=new_key())
    wait_for(lambda: runs.get(fresh.task_run_id).status == "succeeded", 30, what="v2 run")
    time.sleep(6.5)  # longer than REPUBLISH_AFTER_S: the sweeper re-sent it; still nobody serves v1
    view = runs.get(stranded.task_run_id)
    assert view.status == "pending" and view.attempts == 0
    assert "upgr@1" in (view.pending_reason or "")
    assert scalar("SELECT count(*) FROM testkit.execution WHERE run_id = %s", (stranded.task_run_id,)) == 0
    procs.worker("v1again", concurrency=1, env={"ENGINE_SERVE": "upgr@1"})
    wait_for(
        lambda: runs.get(stranded.task_run_id).status == "succeeded",
        30,
        what="the stranded v1 run to finish once a v1 worker exists",
    )
    assert _steps_of(stranded.task_run_id) == [("a", "1"), ("b", "1")]
