"""A fan-out over child runs, one child failing: the parent becomes a dead letter and its cascade
cancels the siblings still running. The operator mends the cause, retries the failed child,
then the parent (README). The retried parent's other item steps met their children `canceled`,
which no retry can bring back, so the parent failed again, for good: only abandon was left.

Now a child the parent's own end canceled (its cascade, or the sweeper's orphan backstop) is
replaced, once the parent runs again, by a fresh child of the same input
(`proj.engine.children`). A child an operator canceled still fails its parent's step
(`tests/integration/test_children.py::test_canceling_a_child_alone_fails_the_parents_step`).
"""

from __future__ import annotations

from pydantic import BaseModel

from proj.engine import runs
from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, child, register, step
from tests.conftest import new_key
from tests.kinds_admin import ADMIN_DDL
from tests.support.services import scalar, sql, wait_for


class FanFixInput(BaseModel):
    key: str


def _item_input(ctx: StepContext) -> dict[str, object]:
    # Item 1 fails fast until mended; the others copy slowly, so the cascade meets them running.
    slow = ctx.item != 1
    return {"key": f"{ctx.input.key}:{ctx.item}", "chunks": 40 if slow else 1, "chunk_s": 0.1}


FAN_FIX = register(
    Kind(
        name="fanfix_parent",
        version=1,
        retry=RetryPolicy(max_attempts=2, initial_s=0.1, max_s=0.2),
        input_model=FanFixInput,
        canvas=(
            child("each", kind="mendable", input=_item_input, over=lambda ctx: [0, 1, 2]),
            step("total", lambda ctx: len(ctx.result("each"))),
        ),
    )
)


def _status(run_id: object) -> str:
    return str(scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)))


def _children(run_id: object) -> list[tuple[object, str, str]]:
    return [
        (r[0], r[1], r[2])
        for r in sql(
            "SELECT id, idempotency_key, status FROM engine.task_run WHERE parent_run_id = %s "
            "ORDER BY created_at, id",
            (run_id,),
        )
    ]


def _fix(key: str) -> None:
    sql(
        "INSERT INTO testkit_admin.fix (key, fixed) VALUES (%s, true) "
        "ON CONFLICT (key) DO UPDATE SET fixed = true",
        (key,),
    )


def test_a_retried_fan_out_replaces_the_children_its_failure_canceled(inproc) -> None:
    sql(ADMIN_DDL)
    key = new_key()
    _fix(f"{key}:0")
    _fix(f"{key}:2")
    ref = inproc.enqueue("fanfix_parent", {"key": key}, idempotency_key=new_key())
    parent = ref.task_run_id
    wait_for(lambda: _status(parent) == "failed", 40, what="the parent to become a dead letter")
    wait_for(
        lambda: sorted(s for _, _, s in _children(parent)) == ["canceled", "canceled", "failed"],
        30,
        what="the cascade to cancel the two siblings",
    )
    failed = next(i for i, _, s in _children(parent) if s == "failed")

    _fix(f"{key}:1")
    assert runs.retry_failed(failed) == 1
    wait_for(lambda: _status(failed) == "succeeded", 30, what="the mended child to succeed")
    assert runs.retry_failed(parent) >= 1
    wait_for(lambda: _status(parent) in ("succeeded", "failed"), 60, what="the retried parent to end")

    assert _status(parent) == "succeeded", scalar(
        "SELECT last_error FROM engine.task_run WHERE id = %s", (parent,)
    )
    assert scalar("SELECT result FROM engine.step WHERE run_id = %s AND name = 'total'", (parent,)) == 3
    kids = _children(parent)
    assert len(kids) == 5, "the three first children, and one fresh child for each canceled one"
    by_key = {k: s for _, k, s in kids}
    canceled = [(cid, k) for cid, k, s in kids if s == "canceled"]
    assert len(canceled) == 2
    for cid, k in canceled:
        assert by_key.get(f"{k}:after:{cid}") == "succeeded", kids


def test_a_retried_parent_whose_child_an_operator_canceled_still_fails(inproc) -> None:
    """The replacement is for children the parent's own end canceled, not the operator's cancel."""
    sql(ADMIN_DDL)
    key = new_key()
    for item in (0, 1, 2):
        _fix(f"{key}:{item}")
    ref = inproc.enqueue("fanfix_parent", {"key": key}, idempotency_key=new_key())
    parent = ref.task_run_id
    wait_for(lambda: len(_children(parent)) == 3, 20, what="three children")
    first = next(cid for cid, k, _ in _children(parent) if k == f"child:{parent}:each:0")
    runs.cancel(first, "operator stopped it")  # type: ignore[arg-type]
    wait_for(lambda: _status(parent) == "failed", 40, what="the parent to fail through that child")

    assert runs.retry_failed(parent) >= 1
    wait_for(lambda: _status(parent) == "failed", 40, what="the parent to fail again")
    error = scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (parent,))
    assert error["type"] == "ChildFailed" and "operator stopped it" in error["message"], error
    assert not [k for _, k, _ in _children(parent) if ":each:0:after:" in k], "item 0 is not replaced"
