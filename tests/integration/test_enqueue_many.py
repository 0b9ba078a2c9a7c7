"""`enqueue_many`: many runs of one kind in one transaction and one statement
(`proj.engine.chain.insert_runs`), each run exactly as `enqueue` would write it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from proj.engine.errors import BadInput, IdempotencyConflict, InvalidInput
from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for

# What a run and its steps look like, without ids, keys and clocks (deadline and start time
# relative to the run's creation; a start time given, as given), to compare a run of
# `enqueue_many` with one of `enqueue`.
RUN_SHAPE = """
    SELECT r.kind, r.version, r.input, r.input_hash, r.priority, r.concurrency_key, r.status,
           r.current_stage, r.current_step, r.parent_run_id, r.deadline_at - r.created_at,
           CASE WHEN r.available_at <> r.created_at THEN r.available_at END, r.trace IS NULL,
           array_agg(ARRAY[s.stage::text, s.name, s.item_index::text, coalesce(s.item::text, '-'),
                           s.max_attempts::text, s.status, (s.published_at IS NULL)::text,
                           (s.next_attempt_at - r.available_at)::text]
                     ORDER BY s.stage, s.item_index)
      FROM engine.task_run r JOIN engine.step s ON s.run_id = r.id
     WHERE r.id = %s
     GROUP BY r.id
"""


def shape(run_id: Any) -> tuple[Any, ...]:
    rows = sql(RUN_SHAPE, (run_id,))
    assert len(rows) == 1, rows
    return rows[0]


def test_each_run_of_a_batch_runs_every_step_once(inproc) -> None:
    refs = inproc.enqueue_many("probe", ((new_key(), {"n": i}) for i in range(20)))  # a generator too
    assert len({r.task_run_id for r in refs}) == 20 and all(r.created for r in refs)
    for ref in refs:
        wait_for(lambda ref=ref: inproc.get(ref.task_run_id).status == "succeeded", 30, what="run done")
    rows = sql("SELECT step, count(*) FROM testkit.execution GROUP BY step ORDER BY step")
    assert rows == [(f"s{i}", 20) for i in range(1, 6)]
    assert [inproc.get(r.task_run_id).result["n"] for r in refs] == list(range(20))


@pytest.mark.parametrize(
    ("kind", "inputs", "options"),
    [
        ("probe", [{"n": 1}, {"n": 2}], {}),
        ("fanfirst", [{"items": 3}, {"items": 0}, {"items": 1}], {}),  # an empty first fan-out
        ("ranked_group", [{"hold_s": 0.1}, {"hold_s": 0.2}], {"priority": 5}),  # held siblings
        ("keyed", [{"key": "a"}, {"key": "b"}], {}),  # a concurrency key
        ("deadlined", [{"slow_s": 1.0}], {}),  # the kind's deadline_s
        ("deadlined", [{"slow_s": 1.0}], {"deadline_at": datetime.now(UTC) + timedelta(hours=1)}),
        ("probe", [{"n": 3}], {"available_at": datetime.now(UTC) + timedelta(hours=1)}),  # not due
    ],
)
def test_a_batch_writes_and_publishes_what_enqueue_would(
    engine, published, kind: str, inputs: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    """Row for row and message for message, the same as one `enqueue` per input (no worker
    runs: the rows are as enqueued)."""
    singles = [engine.enqueue(kind, inp, idempotency_key=new_key(), **options) for inp in inputs]
    sent_singly = [(d.task_name, d.queue, d.priority, len(d.more)) for d in published]
    published.clear()
    batch = engine.enqueue_many(kind, [(new_key(), inp) for inp in inputs], **options)
    assert [(d.task_name, d.queue, d.priority, len(d.more)) for d in published] == sent_singly
    assert [shape(b.task_run_id) for b in batch] == [shape(s.task_run_id) for s in singles]
    sent_ids = [i for d in published for i in (d.step_id, *d.more)]
    batch_steps = sql(
        "SELECT id FROM engine.step WHERE id = ANY(%s) AND run_id = ANY(%s)",
        (sent_ids, [b.task_run_id for b in batch]),
    )
    assert len(batch_steps) == len(sent_ids)  # the messages name the batch's own steps


def test_a_batch_is_idempotent_per_key(engine, published) -> None:
    k1, k2, k3 = new_key(), new_key(), new_key()
    first = engine.enqueue_many("probe", [(k1, {"n": 1}), (k2, {"n": 2})])
    assert all(r.created for r in first)
    again = engine.enqueue_many("probe", [(k2, {"n": 2}), (k3, {"n": 3}), (k1, {"n": 1})])
    assert [(r.task_run_id, r.created) for r in again] == [
        (first[1].task_run_id, False),
        (again[1].task_run_id, True),
        (first[0].task_run_id, False),
    ]
    single = engine.enqueue("probe", {"n": 3}, idempotency_key=k3)
    assert (single.task_run_id, single.created) == (again[1].task_run_id, False)
    # A key given twice in one batch names one run.
    k4 = new_key()
    twice = engine.enqueue_many("probe", [(k4, {"n": 4}), (k4, {"n": 4})])
    assert twice[0].task_run_id == twice[1].task_run_id and [r.created for r in twice] == [True, False]
    assert scalar("SELECT count(*) FROM engine.task_run") == 4
    # One message per run created, none for a key that named a run already.
    assert len(published) == 4


@pytest.mark.parametrize(
    "items",
    [
        [("NEW", {"n": 5}), ("TAKEN", {"n": 99})],  # the taken key's run has another input
        [("NEW", {"n": 5}), ("NEW", {"n": 6})],  # one key, two inputs, in one batch
        [("NEW", {"n": 5}), ("nul\x00key", {"n": 6})],
        [("NEW", {"n": 5}), ("OTHER", {"n": "not a number"})],
        [("NEW", {"n": 5}), ("OTHER", {"n": 6}, "a third element")],
        [("NEW", {"n": 5}), {"n": 6}],
    ],
)
def test_a_batch_with_one_bad_item_writes_nothing(engine, published, items) -> None:
    taken = new_key()
    engine.enqueue("probe", {"n": 1}, idempotency_key=taken)
    published.clear()
    names = {"NEW": new_key(), "TAKEN": taken, "OTHER": new_key()}
    with pytest.raises((IdempotencyConflict, BadInput)):
        engine.enqueue_many(
            "probe", [(names.get(i[0], i[0]), *i[1:]) if isinstance(i, tuple) else i for i in items]
        )
    assert scalar("SELECT count(*) FROM engine.task_run") == 1
    assert scalar("SELECT count(*) FROM engine.step") == 1
    assert published == []


def test_bad_options_are_refused_before_anything_is_written(engine, published) -> None:
    past = datetime.now(UTC) - timedelta(seconds=1)
    with pytest.raises(InvalidInput):
        engine.enqueue_many("probe", [(new_key(), {"n": 1})], deadline_at=past)
    with pytest.raises(InvalidInput):
        engine.enqueue_many("probe", [(new_key(), {"n": 1})], priority=2**40)
    assert scalar("SELECT count(*) FROM engine.task_run") == 0 and published == []
    assert engine.enqueue_many("probe", []) == []


def test_a_batch_larger_than_one_statement_is_still_one_transaction(engine, published, monkeypatch) -> None:
    """`BATCH_ROWS` runs per statement: a key repeated across two statements still names one
    run, and a conflict in the last statement undoes the first ones."""
    from proj.engine import chain

    monkeypatch.setattr(chain, "BATCH_ROWS", 3)
    keys = [new_key() for _ in range(7)]
    items = [(k, {"n": i}) for i, k in enumerate(keys)] + [(keys[1], {"n": 1})]
    refs = engine.enqueue_many("probe", items)
    assert [r.created for r in refs] == [True] * 7 + [False]
    assert refs[7].task_run_id == refs[1].task_run_id
    assert scalar("SELECT count(*) FROM engine.task_run") == 7 and len(published) == 7
    with pytest.raises(IdempotencyConflict):
        engine.enqueue_many("probe", [(new_key(), {"n": i}) for i in range(6)] + [(keys[0], {"n": 99})])
    assert scalar("SELECT count(*) FROM engine.task_run") == 7 and len(published) == 7
