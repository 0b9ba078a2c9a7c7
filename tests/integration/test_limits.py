"""Per-key and per-kind concurrency limits and priorities, counted in Postgres across workers.

Step bodies record start/end timestamps in `testkit.execution` inside their lease; the limit
holds if those intervals never overlap more than the limit allows.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import pytest

from proj.engine import dispatch, runs
from proj.engine.errors import InvalidInput
from proj.engine.sweeper import sweep
from proj.settings import get_settings
from tests.conftest import new_key
from tests.support.plans import generic_plan
from tests.support.services import scalar, sql, wait_for


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals open at one instant (an end at t closes before a start at t opens)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: e)
    open_now = peak = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    return peak


def _succeeded(kind: str) -> int:
    return scalar("SELECT count(*) FROM engine.task_run WHERE kind = %s AND status = 'succeeded'", (kind,))


def _executions_of_key(key: str) -> list[tuple[Any, ...]]:
    return sql(
        "SELECT e.run_id, e.step, e.attempt, e.pid, e.started_at, e.ended_at FROM testkit.execution e "
        "JOIN engine.task_run r ON r.id = e.run_id WHERE r.concurrency_key = %s ORDER BY e.started_at",
        (key,),
    )


def _blocked(run_id) -> bool:
    return bool(
        scalar(
            "SELECT count(*) FROM engine.step WHERE run_id = %s AND status = 'pending' "
            "AND blocked_at IS NOT NULL",
            (run_id,),
        )
    )


def test_thirty_runs_of_one_key_never_exceed_the_limit_on_four_processes(procs) -> None:
    """30 runs share a key with limit 2 on 4 worker processes (2 workers x 2): never more than
    2 in a step at once, all finish, and another key is not held up by the full one."""
    procs.worker("w1", concurrency=2)
    procs.worker("w2", concurrency=2)
    procs.beat()
    key, other = f"tracker:{new_key()}", f"tracker:{new_key()}"
    started = time.monotonic()
    refs = [runs.enqueue("keyed", {"key": key, "hold_s": 0.2}, idempotency_key=new_key()) for _ in range(30)]
    others = [
        runs.enqueue("keyed", {"key": other, "hold_s": 0.2}, idempotency_key=new_key()) for _ in range(2)
    ]
    wait_for(lambda: _succeeded("keyed") == 32, 120, interval=0.2, what="32 runs to succeed")
    elapsed = time.monotonic() - started

    rows = _executions_of_key(key)
    assert len(rows) == 60, "each of the 2 steps of the 30 runs ran exactly once"
    assert all(r[5] is not None for r in rows)
    peak = max_overlap([(r[4], r[5]) for r in rows])
    assert peak == 2, f"at most 2 at once (and the limit was used), saw {peak}"
    assert len({r[3] for r in rows}) >= 2, "the work was spread over several worker processes"
    # Two slots, 60 steps of 0.2 s: at least 6 s. A freed slot is handed to the next in line by
    # a message; were the hand-off lost, each of the ~28 queued runs would wait for the
    # sweeper's re-send (`REPUBLISH_AFTER_S=5` here), two at a time. The bound tells
    # the two paths apart; it is not a speed target.
    busy = (rows[-1][5] - rows[0][4]).total_seconds()
    print(
        f"\n30 runs x 2 steps, limit 2: {busy:.1f}s from first start to last end (ideal 6.0s), "
        f"{elapsed:.1f}s from enqueue to all done"
    )
    assert busy < 6.0 * 3

    other_rows = _executions_of_key(other)
    assert len(other_rows) == 4
    assert max(r[5] for r in other_rows) < rows[-1][5], "the other key did not wait for the full one"
    assert {r.task_run_id for r in refs + others} == {
        row[0] for row in sql("SELECT id FROM engine.task_run WHERE status = 'succeeded'")
    }
    assert scalar("SELECT count(*) FROM engine.step WHERE blocked_at IS NOT NULL") == 0


def _admin_shows(run_id, text: str) -> bool:
    """The run page of /admin (rendered in-process) carries the waiting reason."""
    from pydantic import SecretStr
    from starlette.testclient import TestClient

    from proj.admin.app import create_app
    from proj.settings import get_settings

    settings = get_settings().model_copy(update={"admin_password": SecretStr("pw")})
    with TestClient(create_app(settings)) as c:
        c.auth = ("admin", "pw")
        page = c.get(f"/admin/runs/{run_id}")
    return page.status_code == 200 and 'id="pending-reason"' in page.text and text in page.text


def test_run_over_the_limit_waits_pending_with_its_reason(inproc) -> None:
    """A run over its key's limit is `pending` with a reason in `get`; another key runs; it
    starts as soon as the holder commits (a hand-off, not a sweep later)."""
    key = f"user:{new_key()}"
    a = inproc.enqueue("keyed_one", {"key": key, "hold_s": 2.0}, idempotency_key=new_key())
    wait_for(lambda: _executions_of_key(key), 10, what="the holder to start")
    b = inproc.enqueue("keyed_one", {"key": key, "hold_s": 0.1}, idempotency_key=new_key())
    c = inproc.enqueue("keyed_one", {"key": f"user:{new_key()}", "hold_s": 0.1}, idempotency_key=new_key())
    wait_for(lambda: _blocked(b.task_run_id), 10, what="the second run to be refused a slot")
    view = inproc.get(b.task_run_id)
    assert view.status == "pending"
    assert view.pending_reason is not None
    assert f"concurrency key {key!r}" in view.pending_reason and "1/1 runs in a step" in view.pending_reason
    assert _admin_shows(b.task_run_id, "1/1 runs in a step"), "/admin shows the reason too"
    wait_for(lambda: inproc.get(c.task_run_id).status == "succeeded", 10, what="another key to run")
    assert inproc.get(b.task_run_id).status == "pending", "still waiting for the holder"
    assert inproc.get(a.task_run_id).pending_reason is None

    wait_for(lambda: _succeeded("keyed_one") == 3, 20, what="all runs to finish")
    rows = _executions_of_key(key)
    (a_start, a_end), (b_start, _b_end) = [(r[4], r[5]) for r in rows]
    assert [r[0] for r in rows] == [a.task_run_id, b.task_run_id]
    gap = (b_start - a_end).total_seconds()
    assert 0 <= gap < 1.0, f"the waiter started {gap:.2f}s after the slot freed"
    assert inproc.get(b.task_run_id).pending_reason is None


def test_kill_9_of_a_holder_frees_its_slot_within_the_lease(procs) -> None:
    """The holder's worker is killed: its lease expires, the sweeper frees the slot, and a run
    of the key starts elsewhere within lease_ttl + sweep interval; the limit still holds."""
    key = f"disk:{new_key()}"
    procs.worker("victim", concurrency=1)
    a = runs.enqueue("keyed_one", {"key": key, "slow_attempts": 1, "slow_s": 60.0}, idempotency_key=new_key())
    wait_for(lambda: _executions_of_key(key), 30, what="the holder to start on the victim")
    procs.worker("rescuer", concurrency=1)
    # Two waiters: the busy victim may prefetch one message (lost with it, re-sent by the
    # sweeper); the other reaches the rescuer, which refuses it a slot.
    waiters = [
        runs.enqueue("keyed_one", {"key": key, "hold_s": 0.2}, idempotency_key=new_key()) for _ in range(2)
    ]
    wait_for(
        lambda: any(_blocked(w.task_run_id) for w in waiters),
        30,
        what="a waiter to be refused on the rescuer",
    )
    view = runs.get(next(w for w in waiters if _blocked(w.task_run_id)).task_run_id)
    assert view.status == "pending" and "concurrency key" in view.pending_reason
    assert len(_executions_of_key(key)) == 1
    procs.beat()
    killed_at = scalar("SELECT clock_timestamp()")
    procs.kill("victim")
    wait_for(lambda: _succeeded("keyed_one") == 3, 60, what="all runs to finish")

    rows = _executions_of_key(key)
    assert len(rows) == 4, "the killed attempt, its retry and the two waiters"
    first_after = min(r[4] for r in rows[1:])
    s = get_settings()
    recovery = (first_after - killed_at).total_seconds()
    print(f"\nslot freed {recovery:.2f}s after kill -9 (lease {s.lease_ttl_s}s, sweep {s.sweep_interval_s}s)")
    assert recovery <= s.lease_ttl_s + s.sweep_interval_s + 2.0, f"slot freed after {recovery:.1f}s"
    intervals = [(r[4], r[5] or killed_at) for r in rows]
    assert max_overlap(intervals) == 1
    assert {r[0] for r in rows} == {a.task_run_id, *(w.task_run_id for w in waiters)}


def test_priority_orders_the_start_of_waiting_runs(inproc) -> None:
    """With one slot (global_limit=1) held, waiting runs start by priority, highest first, and
    in enqueue order within one priority."""
    blocker = inproc.enqueue("solo", {"hold_s": 2.0}, idempotency_key=new_key())
    wait_for(
        lambda: scalar("SELECT count(*) FROM testkit.execution WHERE run_id = %s", (blocker.task_run_id,)),
        10,
        what="the blocker to start",
    )
    priorities = [1, 5, 3, 9, 0, 7, 5, -2]
    refs = [
        inproc.enqueue("solo", {"hold_s": 0.05}, idempotency_key=new_key(), priority=p) for p in priorities
    ]
    wait_for(lambda: all(_blocked(r.task_run_id) for r in refs), 10, what="all of them to wait")
    assert inproc.get(refs[0].task_run_id).pending_reason.startswith("waiting for a slot: solo has 1/1 runs")
    wait_for(lambda: _succeeded("solo") == len(refs) + 1, 30, what="all runs to finish")

    rows = sql(
        "SELECT e.run_id, r.priority, e.started_at, e.ended_at FROM testkit.execution e "
        "JOIN engine.task_run r ON r.id = e.run_id ORDER BY e.started_at"
    )
    assert rows[0][0] == blocker.task_run_id
    started = [r[1] for r in rows[1:]]
    assert started == sorted(priorities, reverse=True), f"start order by priority: {started}"
    fives = [r[0] for r in rows if r[1] == 5]
    assert fives == [refs[1].task_run_id, refs[6].task_run_id], "FIFO within one priority"
    assert max_overlap([(r[2], r[3]) for r in rows]) == 1


def _start_order(kind: str) -> list[Any]:
    return sql(
        "SELECT e.run_id, r.priority FROM testkit.execution e JOIN engine.task_run r ON r.id = e.run_id "
        "WHERE r.kind = %s AND e.step = 'first' ORDER BY e.started_at",
        (kind,),
    )


def test_priority_orders_the_start_of_queued_runs_without_limits(engine) -> None:
    """Runs of a kind without limits, all queued in the broker before any worker runs, start by
    priority (highest first, FIFO within one priority), not in the broker's order. No sweeper
    runs, so every run also finishing shows that no start message was lost by the reordering."""
    priorities = [1, 5, 3, 9, 0, 7, 5, -2, 3, 8]
    refs = [
        engine.enqueue("ranked", {"hold_s": 0.02}, idempotency_key=new_key(), priority=p) for p in priorities
    ]
    engine.start(roles=("worker",), concurrency=1)
    wait_for(lambda: _succeeded("ranked") == len(refs), 30, what="all runs to finish without the sweeper")

    rows = _start_order("ranked")
    started = [r[1] for r in rows]
    assert started == sorted(priorities, reverse=True), f"start order by priority: {started}"
    by_prio = {p: [r[0] for r in rows if r[1] == p] for p in (5, 3)}
    assert by_prio[5] == [refs[1].task_run_id, refs[6].task_run_id], "FIFO within one priority"
    assert by_prio[3] == [refs[2].task_run_id, refs[8].task_run_id], "FIFO within one priority"
    assert scalar("SELECT count(*) FROM testkit.execution") == len(refs), "each first step ran once"


@pytest.mark.parametrize("kind", ["ranked_group", "ranked_fan", "ranked_wait"])
def test_priority_orders_the_start_of_runs_whose_first_stage_is_a_group_a_fan_out_or_a_wait(
    engine, kind: str
) -> None:
    """A first stage that is a group or a fan-out: only its item 0 is sent at enqueue, and it
    starts runs in priority order; the other rows go out when their run starts, so none of them
    starts a lower-priority run early. A first stage that waits starts in priority order too.
    No sweeper, so all finishing shows no message was lost."""
    priorities = [1, 5, 3, 9, 0, 7, 5, -2, 3, 8]
    refs = [engine.enqueue(kind, {"hold_s": 0.02}, idempotency_key=new_key(), priority=p) for p in priorities]
    engine.start(roles=("worker",), concurrency=1)
    wait_for(lambda: _succeeded(kind) == len(refs), 30, what="all runs to finish without the sweeper")

    first_touch = sql(
        "SELECT e.run_id, r.priority FROM testkit.execution e JOIN engine.task_run r ON r.id = e.run_id "
        "WHERE r.kind = %s GROUP BY e.run_id, r.priority ORDER BY min(e.started_at)",
        (kind,),
    )
    started = [r[1] for r in first_touch]
    assert started == sorted(priorities, reverse=True), f"start order by priority: {started}"
    assert [r[0] for r in first_touch if r[1] == 5] == [refs[1].task_run_id, refs[6].task_run_id]
    per_run = {"ranked_group": 2, "ranked_fan": 3, "ranked_wait": 1}[kind]  # bodies that record
    assert scalar("SELECT count(*) FROM testkit.execution") == per_run * len(refs), "each row ran once"


def test_duplicate_start_messages_start_each_run_once(engine) -> None:
    """Every start message delivered twice (and out of order): each run's first step still runs
    exactly once, the best-ordered first, and all finish without the sweeper."""
    priorities = [0, 4, 0, 2, 6, 0]
    refs = [
        engine.enqueue("ranked", {"hold_s": 0.02}, idempotency_key=new_key(), priority=p) for p in priorities
    ]
    starts = sql(
        "SELECT s.id, r.priority FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
        "WHERE r.kind = 'ranked' AND s.stage = 0 ORDER BY r.created_at DESC"
    )
    dispatch.publish([dispatch.step_dispatch(sid, "ranked", 1, "first", p) for sid, p in starts])
    engine.start(roles=("worker",), concurrency=2)
    wait_for(lambda: _succeeded("ranked") == len(refs), 30, what="all runs to finish without the sweeper")

    per_run = sql(
        "SELECT e.run_id, count(*) FROM testkit.execution e JOIN engine.task_run r ON r.id = e.run_id "
        "WHERE r.kind = 'ranked' GROUP BY e.run_id"
    )
    assert sorted(n for _, n in per_run) == [1] * len(refs), per_run
    assert scalar(
        "SELECT count(*) FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id WHERE s.stage = 0"
    ) == len(refs)
    assert {r[1] for r in _start_order("ranked")[:2]} == {6, 4}, "two children: the two best start first"


def test_sweeper_sends_the_highest_priority_first(monkeypatch) -> None:
    """Re-sends (lost messages, refused steps) go out highest priority first."""
    sent: list[list[dispatch.Dispatch]] = []
    monkeypatch.setattr(dispatch, "publish_after_commit", lambda items: sent.append(list(items)))
    refs = {p: runs.enqueue("probe", {"n": p}, idempotency_key=new_key(), priority=p) for p in (0, 7, -1, 3)}
    sql("UPDATE engine.step SET published_at = NULL")
    sent.clear()
    sweep()
    order = [(d.priority, d.step_id) for batch in sent for d in batch]
    assert [p for p, _ in order] == [7, 3, 0, -1]
    step_of = {
        p: scalar("SELECT id FROM engine.step WHERE run_id = %s", (r.task_run_id,)) for p, r in refs.items()
    }
    assert [step for _, step in order] == [step_of[p] for p in (7, 3, 0, -1)]


def test_dead_letters_pending_steps_do_not_starve_the_sweeper(monkeypatch) -> None:
    """A failed run keeps its pending steps (an operator may retry it), due forever and older
    than any live step. With more of them than one sweep's batch, the live step is still sent:
    the batch holds only steps of live runs (`store.recovery.PUBLISH_DUE`)."""
    from proj.engine import sweeper

    sent: list[list[dispatch.Dispatch]] = []
    monkeypatch.setattr(dispatch, "publish_after_commit", lambda items: sent.append(list(items)))
    monkeypatch.setattr(sweeper, "BATCH", 3)
    dead = [runs.enqueue("probe", {"n": i}, idempotency_key=new_key()).task_run_id for i in range(4)]
    live = runs.enqueue("probe", {"n": 9}, idempotency_key=new_key()).task_run_id
    sql("UPDATE engine.task_run SET status = 'failed' WHERE id = ANY(%s)", (dead,))
    sql(
        "UPDATE engine.step SET published_at = NULL, next_attempt_at = next_attempt_at - "
        "CASE WHEN run_id = ANY(%s) THEN interval '1 hour' ELSE interval '0' END",
        (dead,),
    )
    sent.clear()
    sweep()
    live_step = scalar("SELECT id FROM engine.step WHERE run_id = %s", (live,))
    assert [d.step_id for batch in sent for d in batch] == [live_step]
    assert (
        scalar("SELECT count(*) FROM engine.step WHERE run_id = ANY(%s) AND published_at IS NULL", (dead,))
        == 4
    )


def test_bad_priority_is_refused_and_nothing_is_written() -> None:
    """A priority must be a 32-bit int (it orders with `-priority` in SQL)."""
    with pytest.raises(InvalidInput):
        runs.enqueue("probe", {}, idempotency_key=new_key(), priority="high")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        runs.enqueue("probe", {}, idempotency_key=new_key(), priority=2**40)
    assert scalar("SELECT count(*) FROM engine.task_run") == 0


def test_a_slot_is_per_run_fan_out_items_share_it(inproc) -> None:
    """The limit counts runs: the items of a fan-out run together in the run's one slot, and
    the next run of the key waits until they are all done."""
    key = f"disk:{new_key()}"
    a = inproc.enqueue("keyed_fan", {"key": key, "items": 3, "hold_s": 0.6}, idempotency_key=new_key())
    wait_for(lambda: _executions_of_key(key), 10, what="the first items to start")
    b = inproc.enqueue("keyed_fan", {"key": key, "items": 3, "hold_s": 0.1}, idempotency_key=new_key())
    wait_for(lambda: _succeeded("keyed_fan") == 2, 30, what="both runs to finish")
    rows = _executions_of_key(key)
    by_run = {run: [(r[4], r[5]) for r in rows if r[0] == run] for run in (a.task_run_id, b.task_run_id)}
    assert max_overlap(by_run[a.task_run_id]) >= 2, "a run's items share its slot"
    assert max(e for _, e in by_run[a.task_run_id]) <= min(s for s, _ in by_run[b.task_run_id])


def test_a_waiting_run_can_be_canceled_and_never_starts(inproc) -> None:
    key = f"user:{new_key()}"
    a = inproc.enqueue("keyed_one", {"key": key, "hold_s": 1.5}, idempotency_key=new_key())
    wait_for(lambda: _executions_of_key(key), 10, what="the holder to start")
    b = inproc.enqueue("keyed_one", {"key": key, "hold_s": 0.1}, idempotency_key=new_key())
    c = inproc.enqueue("keyed_one", {"key": key, "hold_s": 0.1}, idempotency_key=new_key())
    wait_for(lambda: _blocked(b.task_run_id) and _blocked(c.task_run_id), 10, what="both to wait")
    inproc.cancel(b.task_run_id, "requester withdrew")
    assert inproc.get(b.task_run_id).status == "canceled"
    wait_for(lambda: inproc.get(c.task_run_id).status == "succeeded", 20, what="the next in line to run")
    assert inproc.get(a.task_run_id).status == "succeeded"
    assert [r[0] for r in _executions_of_key(key)] == [a.task_run_id, c.task_run_id]


def test_global_and_key_limits_together(inproc) -> None:
    """One run per key and three of the kind at once, on a worker with four threads."""
    keys = [f"k{i}:{new_key()}" for i in range(4)]
    for _ in range(3):
        for k in keys:
            inproc.enqueue("sharded", {"key": k, "hold_s": 0.15}, idempotency_key=new_key())
    wait_for(lambda: _succeeded("sharded") == 12, 60, what="all runs to finish")
    rows = sql(
        "SELECT r.concurrency_key, e.started_at, e.ended_at FROM testkit.execution e "
        "JOIN engine.task_run r ON r.id = e.run_id"
    )
    assert len(rows) == 12
    assert max_overlap([(r[1], r[2]) for r in rows]) <= 3
    for k in keys:
        assert max_overlap([(r[1], r[2]) for r in rows if r[0] == k]) == 1


CLAIM_TYPES = {"id": "bigint", "tok": "uuid", "owner": "text", "ttl": "float8"}


def _claim_values(step_id: int) -> dict[str, str]:
    return {"id": str(step_id), "tok": "gen_random_uuid()", "owner": "'w'", "ttl": "3.0"}


def _finished_runs(kind: str, n: int) -> None:
    """`n` succeeded runs of `kind`, inserted directly (history the claims must not walk)."""
    sql(
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "SELECT gen_random_uuid(), %s, 1, 'done-' || g, '{}', 'h', 'succeeded' "
        "FROM generate_series(1, %s) g",
        (kind, n),
    )


def test_a_claim_reads_its_step_by_primary_key_under_a_backlog() -> None:
    """Statistics taken when nothing was pending, then a backlog of 1,500 pending steps: a claim
    still reads its step by primary key, not by scanning the partial index of pending steps."""
    from proj import db
    from proj.engine.store import admission, claims

    _finished_runs("ranked", 3000)
    sql(
        "INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, status) "
        "SELECT id, 0, 'first', 0, 3, 'succeeded' FROM engine.task_run"
    )
    sql("ANALYZE engine.task_run, engine.step")
    with db.transaction() as s:
        for _ in range(1500):
            runs.insert_run(s, "ranked", {"hold_s": 0}, idempotency_key=new_key())
    step_id = scalar("SELECT max(id) FROM engine.step WHERE status = 'pending'")
    plan = generic_plan(claims.CLAIM, _claim_values(step_id), CLAIM_TYPES)
    assert "Index Scan using step_pkey on step s" in plan and "step_due_idx" not in plan, plan
    slot = generic_plan(admission.SLOT_OF, {"id": str(step_id)}, {"id": "bigint"})  # limited kinds
    assert "Index Scan using step_pkey on step s" in slot and "step_due_idx" not in slot, slot


@pytest.mark.parametrize("analyzed", [False, True])
def test_a_start_claim_probes_only_better_pending_runs(analyzed: bool) -> None:
    """The start claim's search for a better run is an index range (`task_run_start_idx`:
    kind, version, priority above mine), never a walk over the kind's runs. Checked on the
    generic plan a driver's prepared statement gets, with 2,000 finished runs of the kind and
    with stale (never analyzed) or fresh statistics: an earlier form scanned every run of the
    kind per claim when statistics were stale, which made starts O(runs) under a backlog."""
    import re

    from proj.engine.store import claims

    ref = runs.enqueue("ranked", {"hold_s": 0}, idempotency_key=new_key(), priority=1)
    _finished_runs("ranked", 2000)
    if analyzed:
        sql("ANALYZE engine.task_run, engine.step")
    step_id = scalar("SELECT id FROM engine.step WHERE run_id = %s", (ref.task_run_id,))
    plan = generic_plan(claims.CLAIM_START, _claim_values(step_id), CLAIM_TYPES)
    better = plan[plan.index("CTE better") : plan.index("CTE claimed")]
    assert re.search(
        r"Index Scan using task_run_start_idx on task_run r2 [^\n]*\n\s+Index Cond: "
        r"\(\(kind = \$\d+\) AND \(version = \$\d+\) AND \(priority > \$\d+\)\)",
        better,
    ), plan
    assert "task_run_kind_key" not in better, plan


def test_a_holder_whose_heartbeat_was_late_keeps_its_slot_until_the_sweeper_takes_it(
    published, monkeypatch
) -> None:
    """A holder's heartbeat stalls past its lease (a GC pause, a Postgres hiccup) and then
    renews: nobody took the lease back in between (the sweeper had not run), so the renewal
    lands and the holder goes on and commits. Admission counted only unexpired leases, so a
    claim in that window was admitted too: two runs of a key with limit 1 in a step at once,
    both to the end. Now a step holds its slot while it is `running` (its token not taken back);
    the sweeper's take-back frees it and hands it on."""
    import threading

    from proj.engine import protocol
    from proj.engine.heartbeat import HEARTBEAT
    from tests.support.steps import first_step

    key = f"disk:{new_key()}"
    holder = runs.enqueue("keyed_one", {"key": key, "hold_s": 5.0}, idempotency_key=new_key())
    waiter = runs.enqueue("keyed_one", {"key": key, "hold_s": 0.1}, idempotency_key=new_key())
    stalled = threading.Event()
    real_renew = HEARTBEAT.renew

    def late_renew(leases):  # noqa: ANN001, ANN202 - the heartbeat stalls until released
        stalled.wait(20)
        return real_renew(leases)

    monkeypatch.setattr(HEARTBEAT, "renew", late_renew)
    holding = threading.Thread(target=protocol.execute, args=(first_step(holder.task_run_id),))
    holding.start()
    wait_for(lambda: _executions_of_key(key), 10, what="the holder to start")
    wait_for(
        lambda: scalar(
            "SELECT lease_until < now() FROM engine.step WHERE run_id = %s", (holder.task_run_id,)
        ),
        10,
        what="the holder's lease to run out, its heartbeat stalled",
    )
    first = protocol.execute(first_step(waiter.task_run_id))
    stalled.set()  # the heartbeat renews: the holder's token was never taken back
    holding.join(20)
    assert not holding.is_alive()
    assert _succeeded("keyed_one") >= 1
    if first == "noop":  # refused; the holder's commit handed its slot on
        assert first_step(waiter.task_run_id) in [d.step_id for d in published]
        assert protocol.execute(first_step(waiter.task_run_id)) == "succeeded"
    assert _succeeded("keyed_one") == 2
    rows = _executions_of_key(key)
    assert [r[0] for r in rows] == [holder.task_run_id, waiter.task_run_id]
    assert max_overlap([(r[4], r[5]) for r in rows]) == 1, (
        f"two runs of a key with limit 1 in a step at once (the waiter's first delivery: {first})"
    )
    assert first == "noop", "refused while the holder's step was running"


def test_a_freed_global_slot_is_not_left_idle_behind_a_waiter_whose_key_is_full(published) -> None:
    """`sharded`: three of the kind at once, one per key. The kind is full (keys a, b, c), and
    two runs wait for a global slot: one of key a (first in line) and one of key d. b ends:
    the slot went to the head of the global line, the run of key a, which its key then
    refused, and the run of key d was told nothing, so the slot stayed idle until the
    sweeper's re-send (`REPUBLISH_AFTER_S`, 30 s by default). A hot key with many waiters
    idled every slot freed so, one at a time. Now the global line skips a waiter whose key
    is full: the freed slot goes to the run of key d at once."""
    import threading

    from proj.engine import protocol
    from tests.support.steps import first_step

    k = {name: f"{name}:{new_key()}" for name in "abcd"}
    holders = {
        name: runs.enqueue("sharded", {"key": k[name], "hold_s": hold}, idempotency_key=new_key())
        for name, hold in (("a", 3.0), ("b", 0.5), ("c", 3.0))
    }
    threads = {
        name: threading.Thread(target=protocol.execute, args=(first_step(ref.task_run_id),))
        for name, ref in holders.items()
    }
    for t in threads.values():
        t.start()
    wait_for(lambda: scalar("SELECT count(*) FROM testkit.execution") == 3, 10, what="three holders")
    same_key = runs.enqueue("sharded", {"key": k["a"], "hold_s": 0.1}, idempotency_key=new_key())
    other_key = runs.enqueue("sharded", {"key": k["d"], "hold_s": 0.1}, idempotency_key=new_key())
    assert protocol.execute(first_step(same_key.task_run_id)) == "noop"
    assert protocol.execute(first_step(other_key.task_run_id)) == "noop"
    assert _blocked(same_key.task_run_id) and _blocked(other_key.task_run_id)
    del published[:]
    threads["b"].join(10)  # b commits and hands its global slot on
    delivered: list[int] = []
    while published:  # as workers would: every message the hand-offs sent, in order
        d = published.pop(0)
        delivered.append(d.step_id)
        protocol.execute(d.step_id)
    assert (
        scalar("SELECT status FROM engine.task_run WHERE id = %s", (other_key.task_run_id,)) == "succeeded"
    ), f"the freed global slot stayed idle (delivered: {delivered})"
    assert threads["a"].is_alive() and threads["c"].is_alive(), "while a and c still held theirs"
    assert _blocked(same_key.task_run_id), "the run of key a still waits for its key"
    for t in threads.values():
        t.join(20)
