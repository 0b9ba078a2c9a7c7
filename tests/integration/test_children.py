"""Issue 20: child runs (a step that starts a run and waits for it without a worker slot), the
cancel cascade, run deadlines and `TaskEngine.result()`. Real in-process workers and the sweeper
on real Postgres and Redis; assertions read the engine's rows and `testkit.execution`."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from proj.engine.errors import InvalidInput, RunCanceled, RunFailed
from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for


def _status(run_id) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def _children(run_id) -> list[tuple]:
    return sql(
        "SELECT id, kind, status, idempotency_key FROM engine.task_run WHERE parent_run_id = %s "
        "ORDER BY idempotency_key",
        (run_id,),
    )


def _executions(step: str) -> int:
    return scalar("SELECT count(*) FROM testkit.execution WHERE step = %s", (step,))


def test_a_child_run_is_waited_for_without_a_slot_and_its_result_is_the_steps(inproc) -> None:
    ref = inproc.enqueue("cparent", {"n": 21, "slow_s": 1.5}, idempotency_key=new_key())
    wait_for(lambda: _children(ref.task_run_id), 10, what="the child to be enqueued")
    # While the child runs, the parent's step is parked in Postgres (no lease, no slot).
    wait_for(
        lambda: (
            scalar("SELECT status FROM engine.step WHERE run_id = %s AND name = 'verify'", (ref.task_run_id,))
            == "waiting"
        ),
        10,
        what="the parent's child step to park",
    )
    assert (
        scalar(
            "SELECT lease_token FROM engine.step WHERE run_id = %s AND name = 'verify'", (ref.task_run_id,)
        )
        is None
    )
    assert inproc.result(ref.task_run_id, 30) == {"got": {"y": 42}}
    (child,) = _children(ref.task_run_id)
    assert child[1:3] == ("cleaf", "succeeded")
    assert child[3] == f"child:{ref.task_run_id}:verify:0"
    assert _executions("work") == 1 and _executions("after") == 1
    # the child's end was stored as a signal on the parent's topic
    assert (
        scalar("SELECT count(*) FROM engine.task_signal WHERE topic = %s", (f"run-finished:{child[0]}",)) == 1
    )


def test_a_redelivered_child_step_starts_no_second_child(inproc) -> None:
    """The child step's messages are sent again while it waits and after it finished: the
    idempotency key derived from the parent run and step names the same child every time."""
    from proj.engine import dispatch

    ref = inproc.enqueue("cparent", {"n": 2, "slow_s": 1.0}, idempotency_key=new_key())
    wait_for(lambda: _children(ref.task_run_id), 10, what="the child")
    step_id = scalar("SELECT id FROM engine.step WHERE run_id = %s AND name = 'verify'", (ref.task_run_id,))
    again = dispatch.step_dispatch(step_id, "cparent", 1, "verify")
    dispatch.publish([again, again])
    assert inproc.result(ref.task_run_id, 30) == {"got": {"y": 4}}
    dispatch.publish([again])
    time.sleep(1)
    assert len(_children(ref.task_run_id)) == 1
    assert _executions("work") == 1 and _executions("after") == 1


def test_a_fan_out_over_children_fans_in_in_postgres(inproc) -> None:
    ref = inproc.enqueue("cfan", {"count": 4}, idempotency_key=new_key())
    assert inproc.result(ref.task_run_id, 40) == 0 * 2 + 1 * 2 + 2 * 2 + 3 * 2
    kids = _children(ref.task_run_id)
    assert [k[3] for k in kids] == [f"child:{ref.task_run_id}:each:{i}" for i in range(4)]
    assert {k[2] for k in kids} == {"succeeded"}


def test_a_failed_child_fails_the_step_with_the_childs_error(inproc) -> None:
    ref = inproc.enqueue("cparent", {"n": 3, "fail": True}, idempotency_key=new_key())
    with pytest.raises(RunFailed) as info:
        inproc.result(ref.task_run_id, 40)
    err = info.value.last_error
    assert err["type"] == "ChildFailed" and err["step"] == "verify"
    assert "leaf 3 refuses" in err["message"]
    assert err["child_error"]["type"] == "NonRetryable"
    # under the parent's retry policy (2 attempts), still one child
    assert err["attempts"] == 2
    assert len(_children(ref.task_run_id)) == 1 and _executions("after") == 0


def test_canceling_a_child_alone_fails_the_parents_step(inproc) -> None:
    ref = inproc.enqueue("cparent", {"n": 1, "slow_s": 60}, idempotency_key=new_key())
    wait_for(lambda: _executions("work") == 1, 10, what="the child to start")
    (child,) = _children(ref.task_run_id)
    inproc.cancel(child[0], "operator stopped the child")
    with pytest.raises(RunFailed) as info:
        inproc.result(ref.task_run_id, 30)
    assert info.value.last_error["type"] == "ChildFailed"
    assert "canceled" in info.value.last_error["message"]
    assert "operator stopped the child" in info.value.last_error["message"]
    assert _status(child[0]) == "canceled"


def test_cancel_of_a_parent_with_three_running_children_cascades(inproc) -> None:
    ref = inproc.enqueue("cfan", {"count": 3, "slow_s": 60}, idempotency_key=new_key())
    wait_for(lambda: _executions("work") == 3, 15, what="three children running")
    kids = _children(ref.task_run_id)
    assert len(kids) == 3
    inproc.cancel(ref.task_run_id, "user withdrew")
    with pytest.raises(RunCanceled):
        inproc.result(ref.task_run_id, 10)
    for kid in kids:
        wait_for(lambda k=kid: _status(k[0]) == "canceled", 15, what=f"child {kid[0]} canceled")
    # business first: each run's cancel hook wrote its flag; compensation for each run
    flagged = {r[0] for r in sql("SELECT run_id FROM testkit.cancel_flag")}
    assert {k[0] for k in kids} | {ref.task_run_id} <= flagged
    wait_for(
        lambda: (
            scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'undo' AND status = 'succeeded'") == 4
        ),
        20,
        what="compensation of the parent and its three children",
    )
    # the children stopped at a checkpoint, not by running to the end
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'work' AND ended_at IS NOT NULL") == 0


def test_bad_child_kind_fails_the_step_at_once_and_writes_nothing(inproc) -> None:
    ref = inproc.enqueue("cparent_unknown", {"n": 1}, idempotency_key=new_key())
    with pytest.raises(RunFailed) as info:
        inproc.result(ref.task_run_id, 20)
    err = info.value.last_error
    assert err["type"] == "ChildRejected" and "UnknownKind" in err["message"]
    assert err["attempts"] == 1  # retrying cannot help
    assert _children(ref.task_run_id) == []


def test_an_input_the_childs_model_rejects_fails_the_step_and_writes_nothing(inproc) -> None:
    ref = inproc.enqueue("cparent", {"n": -5}, idempotency_key=new_key())
    with pytest.raises(RunFailed) as info:
        inproc.result(ref.task_run_id, 20)
    err = info.value.last_error
    assert err["type"] == "ChildRejected" and "InvalidInput" in err["message"]
    assert _children(ref.task_run_id) == []
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'cleaf'") == 0
    assert scalar("SELECT count(*) FROM engine.task_signal") == 0


def test_a_deadline_in_the_past_is_bad_input(inproc) -> None:
    key = new_key()
    with pytest.raises(InvalidInput, match="in the past"):
        inproc.enqueue("probe", {}, idempotency_key=key, deadline_at=datetime.now(UTC) - timedelta(seconds=1))
    with pytest.raises(InvalidInput, match="timezone-aware"):
        inproc.enqueue("probe", {}, idempotency_key=key, deadline_at=datetime.now() + timedelta(hours=1))
    assert scalar("SELECT count(*) FROM engine.task_run") == 0


def test_a_deadline_while_running_fails_the_run_at_the_next_checkpoint_with_compensation(inproc) -> None:
    """`deadlined` has `deadline_s=2` on its kind; its first step runs for 30 s, checkpointing."""
    started = time.monotonic()
    ref = inproc.enqueue("deadlined", {"slow_s": 30}, idempotency_key=new_key())
    with pytest.raises(RunFailed) as info:
        inproc.result(ref.task_run_id, 20)
    assert time.monotonic() - started < 15
    assert info.value.last_error["type"] == "DeadlineExceeded"
    assert info.value.last_error["step"] == "slow"
    assert _executions("after") == 0, "no step starts past the deadline"
    assert scalar("SELECT deadline_at IS NOT NULL FROM engine.task_run WHERE id = %s", (ref.task_run_id,))
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE kind = 'undo'") == "succeeded",
        15,
        what="the compensation",
    )


def test_a_deadline_while_parked_wakes_the_run_at_once(inproc) -> None:
    """`parked` waits for a signal that never comes, with a 600 s timer: the deadline ends it."""
    ref = inproc.enqueue(
        "parked", {}, idempotency_key=new_key(), deadline_at=datetime.now(UTC) + timedelta(seconds=2)
    )
    wait_for(lambda: _status(ref.task_run_id) == "waiting", 10, what="the run to park")
    with pytest.raises(RunFailed) as info:
        inproc.result(ref.task_run_id, 20)
    assert info.value.last_error["type"] == "DeadlineExceeded"
    assert (
        scalar("SELECT status FROM engine.step WHERE run_id = %s AND name = 'park'", (ref.task_run_id,))
        == "canceled"
    )
    assert _executions("after") == 0
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE kind = 'undo'") == "succeeded",
        15,
        what="the compensation",
    )


def test_a_parent_past_its_deadline_stops_its_child(inproc) -> None:
    ref = inproc.enqueue(
        "cparent",
        {"n": 1, "slow_s": 60},
        idempotency_key=new_key(),
        deadline_at=datetime.now(UTC) + timedelta(seconds=2),
    )
    wait_for(lambda: _executions("work") == 1, 10, what="the child to start")
    with pytest.raises(RunFailed) as info:
        inproc.result(ref.task_run_id, 20)
    assert info.value.last_error["type"] == "DeadlineExceeded"
    (child,) = _children(ref.task_run_id)
    # the child inherited the deadline: it stops at its checkpoint (failed), or is canceled by
    # the parent's expiry, whichever comes first
    assert scalar(
        "SELECT c.deadline_at = p.deadline_at FROM engine.task_run c JOIN engine.task_run p "
        "ON p.id = c.parent_run_id WHERE c.id = %s",
        (child[0],),
    )
    wait_for(lambda: _status(child[0]) in ("canceled", "failed"), 15, what="the child to stop")
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'work' AND ended_at IS NOT NULL") == 0


def test_result_of_a_run_that_finishes_fails_or_outlives_the_timeout(inproc) -> None:
    ok = inproc.enqueue("probe", {"n": 7}, idempotency_key=new_key())
    assert inproc.result(ok.task_run_id, 30)["n"] == 7
    assert inproc.result(ok.task_run_id, 0)["n"] == 7  # finished: at once, even with no time left

    bad = inproc.enqueue("flaky", {"message": "nope", "fatal": True}, idempotency_key=new_key())
    with pytest.raises(RunFailed) as info:
        inproc.result(bad.task_run_id, 30)
    assert info.value.last_error["type"] == "NonRetryable" and info.value.last_error["message"] == "nope"

    slow = inproc.enqueue("cleaf", {"x": 1, "slow_s": 30}, idempotency_key=new_key())
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        inproc.result(slow.task_run_id, 1.0)
    assert 0.9 <= time.monotonic() - started < 6
    inproc.cancel(slow.task_run_id, "done with it")
    with pytest.raises(RunCanceled, match="done with it"):
        inproc.result(slow.task_run_id, 15)


def test_result_is_woken_by_the_finishing_commit_not_a_poll(inproc, monkeypatch) -> None:
    """With the safety re-read pushed to 10 minutes, only the notification issued by the
    finishing commit can wake `result()` in time."""
    from proj.engine import runs

    monkeypatch.setattr(runs, "RESULT_RECHECK_S", 600.0)
    ref = inproc.enqueue("cleaf", {"x": 4, "slow_s": 1.0}, idempotency_key=new_key())
    wait_for(lambda: _executions("work") == 1, 10, what="the run to start")
    started = time.monotonic()
    assert inproc.result(ref.task_run_id, 120) == {"y": 8}
    assert time.monotonic() - started < 60


def test_result_of_an_unknown_run_is_a_key_error(inproc) -> None:
    import uuid

    with pytest.raises(KeyError):
        inproc.result(uuid.uuid4(), 1)


def test_admin_run_page_and_proj_show_display_the_parent_child_tree(inproc) -> None:
    from fastapi.testclient import TestClient
    from pydantic import SecretStr
    from typer.testing import CliRunner

    from proj import cli as cli_mod
    from proj.admin.app import create_app
    from proj.settings import get_settings
    from tests.kinds_admin import ADMIN_DDL

    sql(ADMIN_DDL)
    ref = inproc.enqueue("cfan", {"count": 2}, idempotency_key=new_key())
    assert inproc.result(ref.task_run_id, 30) == 2
    kids = _children(ref.task_run_id)
    settings = get_settings().model_copy(update={"admin_password": SecretStr("pw")})
    with TestClient(create_app(settings)) as client:
        client.auth = ("admin", "pw")
        page = client.get(f"/admin/runs/{ref.task_run_id}")
        assert page.status_code == 200
        assert 'id="child-runs"' in page.text
        for kid in kids:
            assert f'href="/admin/runs/{kid[0]}"' in page.text
        assert page.text.count('data-status="succeeded"') >= 2
        child_page = client.get(f"/admin/runs/{kids[0][0]}")
        assert child_page.status_code == 200
        assert f'id="parent-run"><a href="/admin/runs/{ref.task_run_id}"' in child_page.text
        # the timeline still reads business tables: the child's page renders without steps' orphans
        assert "Business timeline" in child_page.text

    runner = CliRunner()
    out = runner.invoke(cli_mod.cli, ["show", str(ref.task_run_id)], env={"COLUMNS": "250"}).output
    for kid in kids:
        assert str(kid[0]) in out
    assert "each[0] → cleaf@1" in out and "each[1] → cleaf@1" in out
    out = runner.invoke(cli_mod.cli, ["show", str(kids[1][0])], env={"COLUMNS": "250"}).output
    assert f"parent: cfan@1 {ref.task_run_id}" in out
    timed = inproc.enqueue(
        "parked", {}, idempotency_key=new_key(), deadline_at=datetime.now(UTC) + timedelta(hours=1)
    )
    out = runner.invoke(cli_mod.cli, ["show", str(timed.task_run_id)], env={"COLUMNS": "250"}).output
    assert "deadline" in out
    assert inproc.get(timed.task_run_id).deadline_at is not None


def test_a_child_locked_during_the_cascade_is_canceled_by_the_sweeper(inproc) -> None:
    """The cascade skips a child row locked at that moment (no deadlock with a child that is
    finishing and waking its parent); the sweeper cancels it on a later tick if it lives on."""
    import psycopg

    from tests.support.services import pg_url

    ref = inproc.enqueue("cparent", {"n": 1, "slow_s": 60}, idempotency_key=new_key())
    wait_for(lambda: _executions("work") == 1, 10, what="the child to start")
    (child,) = _children(ref.task_run_id)
    with psycopg.connect(pg_url()) as holder:
        holder.execute("SELECT 1 FROM engine.task_run WHERE id = %s FOR UPDATE", (child[0],))
        inproc.cancel(ref.task_run_id, "withdrawn")
        assert _status(ref.task_run_id) == "canceled"
        assert scalar("SELECT cancel_requested_at FROM engine.task_run WHERE id = %s", (child[0],)) is None
        holder.rollback()
    wait_for(lambda: _status(child[0]) == "canceled", 15, what="the sweeper to cancel the orphan")
    assert (
        scalar("SELECT cancel_reason FROM engine.task_run WHERE id = %s", (child[0],))
        == "its parent run ended"
    )


def test_sibling_steps_parking_at_once_leave_the_run_waiting(inproc, monkeypatch) -> None:
    """Two items of a fan-out park together, each in its own transaction. Each one's check "no
    other step of the run running or pending" saw its sibling still `running` (not committed
    yet), so neither marked the run `waiting`: /admin and `proj_runs` showed it running while
    nothing ran. Held at the same point (a barrier before the run's mark), the second park now
    waits for the first's commit and sees it."""
    import threading

    from proj.engine.store import waits

    barrier = threading.Barrier(2, timeout=15)
    mark = waits.run_waiting

    def both_parked_first(s, run_id):  # both PARK statements done, neither committed
        barrier.wait()
        return mark(s, run_id)

    monkeypatch.setattr(waits, "run_waiting", both_parked_first)
    ref = inproc.enqueue("cfan", {"count": 2, "slow_s": 6}, idempotency_key=new_key())
    wait_for(
        lambda: (
            scalar(
                "SELECT count(*) FROM engine.step WHERE run_id = %s AND status = 'waiting'",
                (ref.task_run_id,),
            )
            == 2
        ),
        20,
        what="both items to park",
    )
    assert _status(ref.task_run_id) == "waiting"
