"""Kinds for the limit, priority and tracing tests (loaded through ENGINE_EXTRA_KINDS).

Bodies record their start and end in `testkit.execution` (own transactions, `clock_timestamp()`),
inside the lease, so overlapping intervals there bound how many runs held a slot at once.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, fan_out, group, register, step, wait_for
from tests.kinds import finish, record


class HoldInput(BaseModel):
    key: str | None = None
    hold_s: float = 0.2
    slow_attempts: int = 0  # the first N attempts hold `slow_s` instead (a victim to kill)
    slow_s: float = 30.0


def hold(ctx: StepContext) -> dict[str, object]:
    """Occupy the slot for a while, honouring a lost lease."""
    exec_id = record(ctx)
    inp: HoldInput = ctx.input
    seconds = inp.slow_s if ctx.attempt <= inp.slow_attempts else inp.hold_s
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
    finish(exec_id)
    return {"step": ctx.step, "attempt": ctx.attempt}


FAST_RETRY = RetryPolicy(max_attempts=5, initial_s=0.1, max_s=0.5)

# At most two runs per key in a step at once, across all workers.
KEYED = register(
    Kind(
        name="keyed",
        version=1,
        retry=FAST_RETRY,
        input_model=HoldInput,
        canvas=(step("first", hold), step("second", hold)),
        concurrency_key=lambda inp: inp.key,
        concurrency_limit=2,
    )
)

# One run per key at once.
KEYED_ONE = register(
    Kind(
        name="keyed_one",
        version=1,
        retry=FAST_RETRY,
        input_model=HoldInput,
        canvas=(step("only", hold),),
        concurrency_key=lambda inp: inp.key,
        concurrency_limit=1,
    )
)


class FanHoldInput(HoldInput):
    items: int = 3


# One run per key at once; the items of its fan-out share that slot.
KEYED_FAN = register(
    Kind(
        name="keyed_fan",
        version=1,
        retry=FAST_RETRY,
        input_model=FanHoldInput,
        canvas=(
            step("plan", lambda ctx: list(range(ctx.input.items))),
            fan_out("each", hold, over=lambda ctx: ctx.result("plan")),
        ),
        concurrency_key=lambda inp: inp.key,
        concurrency_limit=1,
    )
)

# One run of the kind at once, whatever its input: shows the priority order.
SOLO = register(
    Kind(
        name="solo",
        version=1,
        retry=FAST_RETRY,
        input_model=HoldInput,
        canvas=(step("only", hold),),
        global_limit=1,
    )
)

# Both limits: one run per key and three of the kind at once.
SHARDED = register(
    Kind(
        name="sharded",
        version=1,
        retry=FAST_RETRY,
        input_model=HoldInput,
        canvas=(step("only", hold),),
        concurrency_key=lambda inp: inp.key,
        concurrency_limit=1,
        global_limit=3,
    )
)

# No limit: its runs start in priority order anyway (the claim of its start step).
RANKED = register(
    Kind(
        name="ranked",
        version=1,
        retry=FAST_RETRY,
        input_model=HoldInput,
        canvas=(step("first", hold), step("second", lambda ctx: {"done": True})),
    )
)

# The same, with a first stage of several rows: a group, and a fan-out over the input's items.
RANKED_GROUP = register(
    Kind(
        name="ranked_group",
        version=1,
        retry=FAST_RETRY,
        input_model=HoldInput,
        canvas=(group(step("first", hold), step("beside", hold)), step("second", lambda ctx: {"done": True})),
    )
)

# A first stage that waits (like `acquire`, which waits for its approval): the check passes at
# once, so the wait steps' claim order is the order the `after` steps are published in.
RANKED_WAIT = register(
    Kind(
        name="ranked_wait",
        version=1,
        retry=FAST_RETRY,
        input_model=HoldInput,
        canvas=(
            wait_for(
                "ready", topic=lambda ctx: f"ranked_wait:{ctx.run_id}", timeout_s=60, check=lambda ctx: True
            ),
            step("first", hold),
        ),
    )
)

RANKED_FAN = register(
    Kind(
        name="ranked_fan",
        version=1,
        retry=FAST_RETRY,
        input_model=FanHoldInput,
        canvas=(
            fan_out("first", hold, over=lambda ctx: list(range(ctx.input.items))),
            step("second", lambda ctx: {"done": True}),
        ),
    )
)
