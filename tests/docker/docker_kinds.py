"""A kind for the pytest-celery tests, mounted into our worker image (ENGINE_EXTRA_KINDS): one
step long enough to kill its container in the middle, then a quick one."""

from __future__ import annotations

import os
import socket
import time

from pydantic import BaseModel

from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step


class SlowInput(BaseModel):
    seconds: float = 20.0


def slow(ctx: StepContext) -> dict[str, object]:
    deadline = time.monotonic() + ctx.input.seconds
    while time.monotonic() < deadline:
        ctx.checkpoint()  # stops early on a lost lease or a cancel
        time.sleep(0.1)
    return {"host": socket.gethostname(), "pid": os.getpid(), "attempt": ctx.attempt}


SLOW = register(
    Kind(
        name="docker_slow",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.2, max_s=1.0),
        input_model=SlowInput,
        canvas=(step("slow", slow), step("done", lambda ctx: {"after": ctx.result("slow")})),
        description="pytest-celery: a step to kill mid-way",
    )
)
