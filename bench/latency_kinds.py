"""Kinds for the latency benchmarks (bench/recovery.py, bench/signal_latency.py, bench/scale.py).

Loaded in the worker with `ENGINE_EXTRA_KINDS=bench.kinds,bench.latency_kinds`. Bodies record
`clock_timestamp()` in `benchkit.mark` in their own committed transaction, so the driver reads
when a body really started (also for an attempt whose worker is killed afterwards).
"""

from __future__ import annotations

import os
import time

from pydantic import BaseModel
from sqlalchemy import text

from proj import db
from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step, wait_for

BENCHKIT_DDL = """
CREATE SCHEMA IF NOT EXISTS benchkit;
CREATE TABLE IF NOT EXISTS benchkit.mark (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, step text NOT NULL, attempt int NOT NULL,
    pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE INDEX IF NOT EXISTS mark_run_idx ON benchkit.mark (run_id, step);
CREATE TABLE IF NOT EXISTS benchkit.gate (topic text PRIMARY KEY, open boolean NOT NULL DEFAULT false);
"""


MARK = text("INSERT INTO benchkit.mark (run_id, step, attempt, pid) VALUES (:r, :s, :a, :p) RETURNING id")
GATE_OPEN = text("SELECT open FROM benchkit.gate WHERE topic = :t")


def mark(ctx: StepContext) -> None:
    """Record that this body started, now, in a transaction of its own."""
    with db.autocommit() as conn:
        conn.first(
            MARK,
            {"r": ctx.run_id, "s": ctx.step, "a": ctx.attempt, "p": os.getpid()},
        )


# recovery: a long first attempt on one worker, killed; the second attempt is quick ------------


class HoldInput(BaseModel):
    slow_s: float = 120.0


def hold(ctx: StepContext) -> dict[str, int]:
    mark(ctx)
    if ctx.attempt == 1:  # the heartbeat thread keeps the lease alive meanwhile
        deadline = time.monotonic() + ctx.input.slow_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return {"attempt": ctx.attempt, "pid": os.getpid()}


HOLD = register(
    Kind(
        name="hold",
        version=1,
        retry=RetryPolicy(max_attempts=5, initial_s=0.2, max_s=1.0),
        input_model=HoldInput,
        canvas=(step("hold", hold), step("after", lambda ctx: mark(ctx))),
        description="benchmark: a long first attempt (killed), then a mark",
    )
)


# signals: park on a topic, re-check a business row when signalled, then a marked step --------


class GateInput(BaseModel):
    topic: str
    timeout_s: float = 3600.0


def gate_open(ctx: StepContext) -> bool:
    """The business truth the wait checks (like `gated` in tests/kinds.py)."""
    with db.autocommit() as conn:
        row = conn.first(GATE_OPEN, {"t": ctx.input.topic})
    return bool(row and row.open)


GATE = register(
    Kind(
        name="gate",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=GateInput,
        canvas=(
            wait_for(
                "open",
                topic=lambda ctx: ctx.input.topic,
                timeout_s=lambda ctx: ctx.input.timeout_s,
                check=gate_open,
            ),
            step("after", lambda ctx: mark(ctx)),
        ),
        description="benchmark: wait for a signal + business check, then a marked step",
    )
)
