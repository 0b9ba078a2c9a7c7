"""Kinds for child runs and deadlines (loaded through ENGINE_EXTRA_KINDS=tests.kinds_children).

Bodies record each execution in `testkit.execution` (`tests.kinds.record`), so tests count real
body runs, killed ones included. Compensation is the `undo` kind of `tests.kinds`.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from proj.engine.context import StepContext
from proj.engine.errors import NonRetryable
from proj.engine.kind import Kind, RetryPolicy, child, register, step, wait_for
from tests.kinds import finish, mark_cancel, record

FAST_RETRY = RetryPolicy(max_attempts=2, initial_s=0.2, max_s=0.5)


class LeafInput(BaseModel):
    x: int = Field(ge=0)  # a negative x is an input the child's model rejects
    slow_s: float = 0.0
    slow_attempts: int = 1
    fail: bool = False


def leaf_work(ctx: StepContext) -> dict[str, int]:
    """Slow (checkpointing every 50 ms) on its first `slow_attempts` attempts, then x * 2."""
    exec_id = record(ctx)
    inp: LeafInput = ctx.input
    if ctx.attempt <= inp.slow_attempts:
        end = time.monotonic() + inp.slow_s
        while time.monotonic() < end:
            ctx.checkpoint()
            time.sleep(0.05)
    if inp.fail:
        raise NonRetryable(f"leaf {inp.x} refuses")
    finish(exec_id)
    return {"y": inp.x * 2}


LEAF = register(
    Kind(
        name="cleaf",
        version=1,
        retry=FAST_RETRY,
        input_model=LeafInput,
        canvas=(step("work", leaf_work),),
        on_cancel=mark_cancel,
        compensation="undo",
    )
)


class ParentInput(BaseModel):
    n: int = 1
    slow_s: float = 0.0
    slow_attempts: int = 1
    fail: bool = False


def leaf_input(ctx: StepContext) -> dict[str, object]:
    inp: ParentInput = ctx.input
    return {
        "x": ctx.result("prep")["x"],
        "slow_s": inp.slow_s,
        "slow_attempts": inp.slow_attempts,
        "fail": inp.fail,
    }


def prep(ctx: StepContext) -> dict[str, int]:
    record(ctx)
    return {"x": ctx.input.n}


def after(ctx: StepContext) -> dict[str, object]:
    record(ctx)
    return {"got": ctx.result("verify")}


PARENT = register(
    Kind(
        name="cparent",
        version=1,
        retry=FAST_RETRY,
        input_model=ParentInput,
        canvas=(step("prep", prep), child("verify", kind="cleaf", input=leaf_input), step("after", after)),
        compensation="undo",
    )
)

UNKNOWN_CHILD = register(
    Kind(
        name="cparent_unknown",
        version=1,
        retry=FAST_RETRY,
        input_model=ParentInput,
        canvas=(
            step("prep", prep),
            child("verify", kind="no_such_kind", input=leaf_input),
            step("after", after),
        ),
    )
)


class FanInput(BaseModel):
    count: int = 3
    slow_s: float = 0.0


FAN = register(
    Kind(
        name="cfan",
        version=1,
        retry=FAST_RETRY,
        input_model=FanInput,
        canvas=(
            child(
                "each",
                kind="cleaf",
                input=lambda ctx: {"x": ctx.item, "slow_s": ctx.input.slow_s},
                over=lambda ctx: list(range(ctx.input.count)),
            ),
            step("total", lambda ctx: sum(r["y"] for r in ctx.result("each"))),
        ),
        on_cancel=mark_cancel,
        compensation="undo",
    )
)


class SlowInput(BaseModel):
    slow_s: float = 30.0


def slow(ctx: StepContext) -> str:
    exec_id = record(ctx)
    end = time.monotonic() + ctx.input.slow_s
    while time.monotonic() < end:
        ctx.checkpoint()
        time.sleep(0.05)
    finish(exec_id)
    return "done"


DEADLINED = register(
    Kind(
        name="deadlined",
        version=1,
        retry=FAST_RETRY,
        input_model=SlowInput,
        canvas=(step("slow", slow), step("after", lambda ctx: record(ctx) and "after")),
        compensation="undo",
        deadline_s=2.0,
    )
)

PARKED = register(
    Kind(
        name="parked",
        version=1,
        retry=FAST_RETRY,
        input_model=SlowInput,
        canvas=(
            wait_for("park", topic=lambda ctx: f"never:{ctx.run_id}", timeout_s=600.0),
            step("after", lambda ctx: record(ctx) and "after"),
        ),
        compensation="undo",
    )
)
