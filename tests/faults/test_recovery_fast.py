"""Crash-stop recovery without waiting for the lease (issue #17, `proj.engine.liveness`).

Workers run with the default lease of 15 s. A worker (or one prefork child) killed with SIGKILL
mid-step has its step running elsewhere in about a second, and its effect happens once: the
ledger reconciles the POST the dead attempt made. Beside it, a worker frozen with SIGSTOP keeps
its session, so its lease: nothing is taken from it before the lease runs out, and then its late
commit is refused (invariant 3). The bounds below are liveness bounds, far from the lease on
purpose: they tell the two paths apart, they do not measure speed (`bench.recovery` does).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from proj.engine import runs
from tests.conftest import new_key
from tests.integration.test_ledger import _effects_input, _run_status, op_row
from tests.kinds_effects import Receiver, lines_for, read_journal
from tests.support.services import scalar, sql, wait_for

LEASE = {"LEASE_TTL_S": "15", "SWEEP_INTERVAL_S": "1", "REAP_INTERVAL_S": "0.25"}
FAST_BOUND_S = 5.0  # far below the 15 s lease: only the liveness path can be this quick

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def holding(inp: dict[str, Any]) -> dict[str, Any]:
    return wait_for(
        lambda: [e for e in read_journal(inp["journal"]) if e["event"] == "hold"], 30, what="the hold"
    )[0]


def attempt_started(run_id, attempt: int):
    return scalar(
        "SELECT a.started_at FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
        "WHERE s.run_id = %s AND a.attempt = %s",
        (run_id, attempt),
    )


def assert_effect_once(inp: dict[str, Any], receiver: Receiver) -> None:
    stored = op_row(f"http:{inp['op']}")
    assert stored["status"] == "done" and stored["attempts"] == 2
    assert stored["resolution"] == "reconciled"  # the dead attempt's POST was found, not redone
    assert receiver.count(inp["op"]) == 1
    assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1


def test_kill_9_of_a_worker_resumes_in_about_a_second_at_a_15s_lease(procs, tmp_path: Path, receiver) -> None:
    procs.worker("victim", concurrency=1, env=LEASE)
    inp = _effects_input(tmp_path, receiver, hold_in="http", hold_when="after", hold_s=120.0)
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    holding(inp)
    assert receiver.count(inp["op"]) == 1  # the POST happened; the commit did not
    procs.worker("rescuer", concurrency=1, env=LEASE)
    procs.beat(env=LEASE)
    lease_left = scalar(
        "SELECT extract(epoch FROM lease_until - clock_timestamp()) FROM engine.step WHERE run_id = %s",
        (ref.task_run_id,),
    )
    killed_at = scalar("SELECT clock_timestamp()")
    procs.kill("victim")
    wait_for(lambda: attempt_started(ref.task_run_id, 2), 30, what="the step to be claimed again")
    resumed = (attempt_started(ref.task_run_id, 2) - killed_at).total_seconds()
    assert lease_left > 8, f"the lease had only {lease_left:.1f}s left: the test proves nothing"
    assert resumed < FAST_BOUND_S, f"resumed {resumed:.2f}s after the kill (lease left: {lease_left:.1f}s)"
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 30, what="the run to finish")
    assert_effect_once(inp, receiver)
    print(f"kill -9 → claimed again in {resumed:.3f}s with {lease_left:.1f}s of lease left")


def test_kill_9_of_one_prefork_child_resumes_in_about_a_second(procs, tmp_path: Path, receiver) -> None:
    procs.worker("w", concurrency=2, env=LEASE)
    procs.beat(env=LEASE)
    inp = _effects_input(tmp_path, receiver, hold_in="http", hold_when="after", hold_s=120.0)
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    child = holding(inp)["pid"]
    assert child in procs.children("w")
    killed_at = scalar("SELECT clock_timestamp()")
    import os

    os.kill(child, signal.SIGKILL)  # the main process lives on and forks a new child
    wait_for(lambda: attempt_started(ref.task_run_id, 2), 30, what="the step to be claimed again")
    resumed = (attempt_started(ref.task_run_id, 2) - killed_at).total_seconds()
    assert resumed < FAST_BOUND_S, f"resumed {resumed:.2f}s after the child was killed"
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 30, what="the run to finish")
    assert_effect_once(inp, receiver)
    worker = sql(
        "SELECT a.worker FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
        "WHERE s.run_id = %s ORDER BY a.attempt",
        (ref.task_run_id,),
    )
    assert f":{child}#" in worker[0][0] and f":{child}#" not in worker[1][0]


def test_a_frozen_worker_keeps_its_lease_and_is_fenced_after_it(procs, tmp_path: Path, receiver) -> None:
    """SIGSTOP keeps the process' Postgres session: the fast path must not fire; the lease does."""
    procs.worker("frozen", concurrency=1, env=LEASE)
    inp = _effects_input(tmp_path, receiver, hold_in="http", hold_when="after", hold_s=20.0)
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    frozen_pid = holding(inp)["pid"]
    procs.worker("rescuer", concurrency=1, env=LEASE)
    procs.beat(env=LEASE)
    procs.signal("frozen", signal.SIGSTOP)
    stopped_at = scalar("SELECT clock_timestamp()")
    try:
        # Twelve reaper periods and more: a fast path mistaking a frozen worker for a dead one
        # would have taken the step by now.
        import time

        time.sleep(3.0)
        assert attempt_started(ref.task_run_id, 2) is None, "a frozen worker lost its step early"
        wait_for(lambda: attempt_started(ref.task_run_id, 2), 40, what="the lease to expire")
        taken = (attempt_started(ref.task_run_id, 2) - stopped_at).total_seconds()
        assert taken > 8, f"taken over after {taken:.1f}s: sooner than a 15 s lease allows"
        wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 40, what="the rescuer to finish")
    finally:
        procs.signal("frozen", signal.SIGCONT)
    refused = wait_for(
        lambda: [e for e in read_journal(inp["journal"]) if e["event"] == "refused"],
        40,
        what="the frozen attempt to try to go on",
    )
    assert [e["pid"] for e in refused] == [frozen_pid]
    assert_effect_once(inp, receiver)


def test_a_worker_frozen_inside_a_fenced_transaction_is_taken_over_at_its_lease(procs) -> None:
    """A worker frozen (SIGSTOP) while its body sits inside a fenced transaction keeps the step
    row locked, and the sweeper skips locked rows: before, its lease was never expired and the
    step stayed `running` for as long as the process stayed frozen (a CI run of
    `test_lease_lost_by_sigstop_during_a_copy` froze it inside a copy's per-chunk check so). Now
    the fence bounds the transaction's idle time below the lease: Postgres ends the frozen
    session, and the step runs on the rescuer at about the lease."""
    procs.worker("frozen", concurrency=1, env=LEASE)
    ref = runs.enqueue("outage_counted", {"script": "H"}, idempotency_key=new_key())
    executions = "SELECT count(*) FROM testkit.execution WHERE run_id = %s"
    wait_for(lambda: scalar(executions, (ref.task_run_id,)) == 1, 30, what="the body to start")
    wait_for(
        lambda: scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' "
            "AND query LIKE '%%UPDATE engine.step SET lease_until%%'"
        ),
        10,
        what="the body idle inside its fenced transaction",
    )
    procs.signal("frozen", signal.SIGSTOP)
    stopped_at = scalar("SELECT clock_timestamp()")
    try:
        procs.worker("rescuer", concurrency=1, env=LEASE)
        procs.beat(env=LEASE)
        wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 45, what="the rescuer to finish")
        taken = (attempt_started(ref.task_run_id, 2) - stopped_at).total_seconds()
        assert taken > 8, f"taken over after {taken:.1f}s: sooner than a 15 s lease allows"
    finally:
        procs.signal("frozen", signal.SIGCONT)
    assert scalar(executions, (ref.task_run_id,)) == 2


# A sweep that freezes (SIGSTOP) once it holds the sweep's lock, as a worker frozen mid-sweep
# would: `known_versions` is the sweep's first call after taking the lock.
FREEZE_INSIDE_A_SWEEP = """
import os, signal
from proj.engine import sweeper

known_versions = sweeper.known_versions


def frozen_here():
    os.kill(os.getpid(), signal.SIGSTOP)
    return known_versions()


sweeper.known_versions = frozen_here
sweeper.sweep(wait=True)
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _sweep_lock_held() -> bool:
    from proj.engine.store.recovery import SWEEP_LOCK

    return bool(
        scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 0 AND objid = %s "
            "AND objsubid = 1 AND granted",
            (SWEEP_LOCK,),
        )
    )


def test_a_frozen_sweeper_stops_recovery_briefly(procs, tmp_path: Path, receiver) -> None:
    """A process frozen inside a sweep holds the sweep's lock, and every other sweep skips or
    queues behind it: before, no lease was taken back anywhere for as long as it stayed frozen,
    the liveness fast path's included (a kill -9 went unrecovered). Now the lock bounds the
    sweep's idle time to two thirds of the lease: Postgres ends the frozen sweeper's session, and
    the killed worker's step resumes on the rescuer about then, its effect done once."""
    procs.worker("victim", concurrency=1, env=LEASE)
    inp = _effects_input(tmp_path, receiver, hold_in="http", hold_when="after", hold_s=120.0)
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    holding(inp)
    procs.worker("rescuer", concurrency=1, env=LEASE)
    procs.beat(env=LEASE)
    sweep = procs.python("sweeper", FREEZE_INSIDE_A_SWEEP, env=LEASE)
    wait_for(lambda: _stopped(sweep.pid), 30, what="the sweep to freeze holding its lock")
    assert _sweep_lock_held()
    frozen_at = scalar("SELECT clock_timestamp()")
    procs.kill("victim")
    wait_for(lambda: attempt_started(ref.task_run_id, 2), 40, what="the step to be claimed again")
    resumed = (attempt_started(ref.task_run_id, 2) - frozen_at).total_seconds()
    assert _stopped(sweep.pid), "the sweeper stayed frozen throughout"
    assert not _sweep_lock_held(), "Postgres ended the frozen sweeper's session"
    assert resumed > 5, f"resumed {resumed:.1f}s after the freeze: the sweep lock was not in the way"
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 30, what="the run to finish")
    assert_effect_once(inp, receiver)
    print(f"a sweeper frozen holding its lock: the killed worker's step resumed {resumed:.1f}s after")
