"""In-process checks of the engine's bookkeeping: chain, fan-out/fan-in, enqueue idempotency."""

from __future__ import annotations

import pytest

from proj.engine.errors import IdempotencyConflict, InvalidInput, UnknownKind
from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for


def test_chain_runs_every_step_once(inproc) -> None:
    ref = inproc.enqueue("probe", {"n": 1}, idempotency_key=new_key())
    wait_for(lambda: inproc.get(ref.task_run_id).status == "succeeded", 30, what="run done")
    rows = sql("SELECT step, count(*) FROM testkit.execution GROUP BY step ORDER BY step")
    assert rows == [(f"s{i}", 1) for i in range(1, 6)]
    view = inproc.get(ref.task_run_id)
    assert view.result["step"] == "s5"


def test_fan_out_fan_in_counted_in_postgres(inproc) -> None:
    ref = inproc.enqueue("fan", {"items": 7}, idempotency_key=new_key())
    wait_for(lambda: inproc.get(ref.task_run_id).status == "succeeded", 30, what="fan run done")
    assert inproc.get(ref.task_run_id).result == sum(i * 10 for i in range(7))
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'each'") == 7
    assert scalar("SELECT count(*) FROM engine.step WHERE name = 'each' AND status = 'succeeded'") == 7


@pytest.mark.parametrize("items", [3, 0])
def test_a_fan_out_first_stage_is_created_with_its_run(inproc, items: int) -> None:
    """The run and its first stage are inserted by one statement at enqueue; an empty first
    fan-out goes on to the next stage at once."""
    key = new_key()
    ref = inproc.enqueue("fanfirst", {"items": items}, idempotency_key=key)
    created = sql(
        "SELECT stage, name, item, status FROM engine.step WHERE run_id = %s ORDER BY stage, item_index",
        (ref.task_run_id,),
    )
    if items:  # the worker may have started them: their state varies, not their rows
        assert [row[:3] for row in created[:items]] == [(0, "each", i) for i in range(items)], created
    else:
        assert created[0][:2] == (1, "total"), created
    wait_for(lambda: inproc.get(ref.task_run_id).status == "succeeded", 30, what="fanfirst run done")
    assert inproc.get(ref.task_run_id).result == sum(i * 10 for i in range(items))
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'each'") == items
    again = inproc.enqueue("fanfirst", {"items": items}, idempotency_key=key)
    assert (again.task_run_id, again.created) == (ref.task_run_id, False)
    assert scalar("SELECT count(*) FROM engine.step WHERE run_id = %s", (ref.task_run_id,)) == items + 1


def test_enqueue_is_idempotent_forever(inproc) -> None:
    key = new_key()
    first = inproc.enqueue("probe", {"n": 7}, idempotency_key=key)
    again = inproc.enqueue("probe", {"n": 7}, idempotency_key=key)
    assert again.task_run_id == first.task_run_id and again.created is False
    with pytest.raises(IdempotencyConflict):
        inproc.enqueue("probe", {"n": 8}, idempotency_key=key)
    wait_for(lambda: inproc.get(first.task_run_id).status == "succeeded", 30, what="run done")
    # No time window: long after the run finished the key still names the same run.
    sql("UPDATE engine.task_run SET created_at = now() - interval '400 days'")
    late = inproc.enqueue("probe", {"n": 7}, idempotency_key=key)
    assert late.task_run_id == first.task_run_id
    with pytest.raises(IdempotencyConflict):
        inproc.enqueue("probe", {"n": 9}, idempotency_key=key)
    assert scalar("SELECT count(*) FROM engine.task_run") == 1
    assert scalar("SELECT count(*) FROM testkit.execution") == 5


def test_find_names_a_run_by_its_kind_and_key_only(engine) -> None:
    """The port's `find`: business code keeps its keys, not run ids, and reads no engine table."""
    key = new_key()
    ref = engine.enqueue("probe", {"n": 1}, idempotency_key=key)
    view = engine.find("probe", key)
    assert view is not None and view.id == ref.task_run_id and view.status == "pending"
    assert engine.find("probe", new_key()) is None
    assert engine.find("flaky", key) is None  # the same key under another kind names nothing


def test_bad_input_writes_nothing(engine) -> None:
    with pytest.raises(UnknownKind):
        engine.enqueue("nope", {}, idempotency_key=new_key())
    with pytest.raises(InvalidInput):
        engine.enqueue("probe", {"n": "not a number"}, idempotency_key=new_key())
    assert scalar("SELECT count(*) FROM engine.task_run") == 0


def test_the_embedded_beat_logs_a_failing_sweep_and_keeps_sweeping(monkeypatch, caplog) -> None:
    """The embedded engine's beat thread (`CeleryTaskEngine.start(roles={"beat"})`) must not
    stop recovering after an error, nor hide it: each failed sweep is logged and retried."""
    import logging

    from proj.engine import sweeper
    from proj.engine.celery_engine import CeleryTaskEngine

    engine = CeleryTaskEngine()
    calls: list[int] = []

    def broken_sweep() -> None:
        calls.append(1)
        if len(calls) == 2:
            engine._stopping.set()
        raise RuntimeError("sweep broke on purpose")

    monkeypatch.setattr(sweeper, "sweep", broken_sweep)
    with caplog.at_level(logging.ERROR, logger="proj.engine.celery_engine"):
        engine._beat_loop()
    assert len(calls) == 2, "the loop went on after the first failure"
    failures = [r for r in caplog.records if r.getMessage().startswith("sweep failed")]
    assert len(failures) == 2 and "sweep broke on purpose" in caplog.text


def test_a_retry_error_leaves_an_ended_runs_error() -> None:
    """A retry's error shows on its live run; on a run that ended (a fan-out sibling retrying
    after another item failed the run) the dead letter's own error stays."""
    from proj import db
    from proj.engine import runs
    from proj.engine.store import commits

    ref = runs.enqueue("probe", {"n": 1}, idempotency_key=new_key())
    with db.transaction() as s:
        assert commits.record_retry_error(s, ref.task_run_id, {"message": "retrying"}) is True
    assert scalar("SELECT last_error->>'message' FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == (
        "retrying"
    )
    sql(
        "UPDATE engine.task_run SET status = 'failed', last_error = %s WHERE id = %s",
        ('{"message": "the failure"}', ref.task_run_id),
    )
    with db.transaction() as s:
        assert commits.record_retry_error(s, ref.task_run_id, {"message": "a sibling's retry"}) is False
    assert scalar("SELECT last_error->>'message' FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == (
        "the failure"
    )
