"""Kinds used by the engine tests (loaded through ENGINE_EXTRA_KINDS=tests.kinds).

Bodies write to `testkit.*` tables in their own committed transactions so a test can count real
body executions, including ones whose worker was killed before committing.
"""

from __future__ import annotations

import os
import time

from pydantic import BaseModel
from sqlalchemy import text

from proj import db
from proj.engine.context import StepContext
from proj.engine.errors import NonRetryable, Unavailable
from proj.engine.kind import Kind, RetryPolicy, fan_out, register, step, wait_for

TESTKIT_DDL = """
CREATE SCHEMA IF NOT EXISTS testkit;
CREATE TABLE IF NOT EXISTS testkit.execution (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, step text NOT NULL, item int,
    attempt int NOT NULL, pid int NOT NULL, started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz);
CREATE TABLE IF NOT EXISTS testkit.effect (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, step text NOT NULL, pid int NOT NULL,
    UNIQUE (run_id, step));
CREATE TABLE IF NOT EXISTS testkit.approval (
    key text PRIMARY KEY, approved boolean NOT NULL DEFAULT false);
CREATE TABLE IF NOT EXISTS testkit.chunk (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, at timestamptz NOT NULL);
CREATE TABLE IF NOT EXISTS testkit.deferred (
    k text, CONSTRAINT deferred_k UNIQUE (k) DEFERRABLE INITIALLY DEFERRED);
CREATE TABLE IF NOT EXISTS testkit.cancel_flag (
    run_id uuid PRIMARY KEY, at timestamptz NOT NULL);
"""


def record(ctx: StepContext) -> int:
    """Count a body execution in its own transaction (survives a kill before commit)."""
    with db.transaction() as s:
        return int(
            s.scalar(
                text(
                    "INSERT INTO testkit.execution (run_id, step, item, attempt, pid) "
                    "VALUES (:r, :s, :i, :a, :p) RETURNING id"
                ),
                {
                    "r": ctx.run_id,
                    "s": ctx.step,
                    "i": ctx.item_index,
                    "a": ctx.attempt,
                    "p": os.getpid(),
                },
            )
        )


def finish(exec_id: int) -> None:
    with db.transaction() as s:
        s.execute(
            text("UPDATE testkit.execution SET ended_at = clock_timestamp() WHERE id = :i"),
            {"i": exec_id},
        )


class ProbeInput(BaseModel):
    n: int = 0
    slow_step: str | None = None
    slow_s: float = 0.0
    slow_attempts: int = 1  # only the first N attempts of the slow step are slow
    fenced_effect: bool = False


def probe_body(ctx: StepContext) -> dict[str, object]:
    exec_id = record(ctx)
    inp: ProbeInput = ctx.input
    if inp.slow_step == ctx.step and ctx.attempt <= inp.slow_attempts:
        deadline = time.monotonic() + inp.slow_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
    if inp.fenced_effect:
        with ctx.fenced() as s:
            s.execute(
                text(
                    "INSERT INTO testkit.effect (run_id, step, pid) VALUES (:r, :s, :p) "
                    "ON CONFLICT (run_id, step) DO UPDATE SET pid = EXCLUDED.pid"
                ),
                {"r": ctx.run_id, "s": ctx.step, "p": os.getpid()},
            )
    finish(exec_id)
    return {"step": ctx.step, "pid": os.getpid(), "attempt": ctx.attempt, "n": inp.n}


PROBE = register(
    Kind(
        name="probe",
        version=1,
        retry=RetryPolicy(max_attempts=5, initial_s=0.2, max_s=1.0),
        input_model=ProbeInput,
        canvas=tuple(step(f"s{i}", probe_body) for i in range(1, 6)),
    )
)


class FlakyInput(BaseModel):
    message: str = "boom"
    fatal: bool = False


def always_fails(ctx: StepContext) -> None:
    record(ctx)
    if ctx.input.fatal:
        raise NonRetryable(ctx.input.message)
    raise RuntimeError(f"{ctx.input.message} (attempt {ctx.attempt})")


FLAKY = register(
    Kind(
        name="flaky",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=FlakyInput,
        canvas=(step("ok", lambda ctx: record(ctx) and "ok"), step("fails", always_fails)),
    )
)


class FanInput(BaseModel):
    items: int = 4


def fan_item(ctx: StepContext) -> int:
    record(ctx)
    return int(ctx.item) * 10


FAN = register(
    Kind(
        name="fan",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=FanInput,
        canvas=(
            step("plan", lambda ctx: list(range(ctx.input.items))),
            fan_out("each", fan_item, over=lambda ctx: ctx.result("plan")),
            step("total", lambda ctx: sum(ctx.result("each"))),
        ),
    )
)


def each_total(ctx: StepContext) -> int:
    try:
        return sum(ctx.result("each"))
    except KeyError:  # an empty fan-out committed no result
        return 0


FAN_FIRST = register(
    Kind(
        name="fanfirst",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=FanInput,
        canvas=(
            fan_out("each", fan_item, over=lambda ctx: range(ctx.input.items)),
            step("total", each_total),
        ),
        description="a fan-out as the first stage: created with the run, at enqueue",
    )
)


class ApprovalInput(BaseModel):
    key: str
    timeout_s: float = 30.0


def approved(ctx: StepContext) -> bool:
    with db.transaction() as s:
        return bool(
            s.scalar(text("SELECT approved FROM testkit.approval WHERE key = :k"), {"k": ctx.input.key})
        )


GATED = register(
    Kind(
        name="gated",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=ApprovalInput,
        canvas=(
            wait_for(
                "approval",
                topic=lambda ctx: f"approval:{ctx.input.key}",
                timeout_s=lambda ctx: ctx.input.timeout_s,
                check=approved,
            ),
            step("after", lambda ctx: record(ctx) and "done"),
        ),
    )
)


class TopicInput(BaseModel):
    topic: str
    timeout_s: float = 60.0


SIGNALLED = register(
    Kind(
        name="signalled",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=TopicInput,
        canvas=(
            wait_for("go", topic=lambda ctx: ctx.input.topic, timeout_s=lambda ctx: ctx.input.timeout_s),
            step("after", lambda ctx: ctx.result("go")),
        ),
    )
)


class ChunkyInput(BaseModel):
    chunks: int = 50
    chunk_s: float = 0.3


def chunked(ctx: StepContext) -> int:
    """A long body that honours cancel per chunk, as a large copy does."""
    done = 0
    for _ in range(ctx.input.chunks):
        ctx.checkpoint()
        with db.transaction() as s:
            s.execute(
                text("INSERT INTO testkit.chunk (run_id, at) VALUES (:r, clock_timestamp())"),
                {"r": ctx.run_id},
            )
        time.sleep(ctx.input.chunk_s)
        done += 1
    return done


def mark_cancel(session, run_id, inp) -> None:  # noqa: ANN001 - the kind's business hook
    session.execute(
        text("INSERT INTO testkit.cancel_flag (run_id, at) VALUES (:r, clock_timestamp())"),
        {"r": run_id},
    )


class UndoInput(BaseModel):
    run_id: str
    kind: str
    input: dict


CHUNKY = register(
    Kind(
        name="chunky",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=ChunkyInput,
        canvas=(step("copy", chunked), step("after", lambda ctx: record(ctx) and "after")),
        on_cancel=mark_cancel,
        compensation="undo",
    )
)

UNDO = register(
    Kind(
        name="undo",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=UndoInput,
        canvas=(step("undo", lambda ctx: record(ctx) and ctx.input.run_id),),
    )
)


class UpgradeInput(BaseModel):
    slow_s: float = 0.0


def versioned(ctx: StepContext) -> dict[str, object]:
    record(ctx)
    if ctx.step == "a" and ctx.input.slow_s:
        time.sleep(ctx.input.slow_s)
    return {"version": ctx.kind.version, "step": ctx.step}


UPGR_V1 = register(
    Kind(
        name="upgr",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=UpgradeInput,
        canvas=(step("a", versioned), step("b", versioned)),
    )
)
UPGR_V2 = register(
    Kind(
        name="upgr",
        version=2,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=UpgradeInput,
        canvas=(step("a", versioned), step("b", versioned), step("c", versioned)),
    )
)


class FinishInput(BaseModel):
    hold_in_finish_s: float = 0.0
    # The business transaction fails at COMMIT (a deferred unique constraint) and the body
    # swallows the error and returns, as a careless body might.
    fail_at_commit_swallowed: bool = False


def finishing(ctx: StepContext) -> dict[str, int]:
    """Business write and step result in one transaction (`ctx.finish`)."""
    record(ctx)
    result = {"pid": os.getpid()}
    if ctx.input.fail_at_commit_swallowed:
        try:
            with ctx.finish(result) as s:
                for _ in range(2):
                    s.execute(text("INSERT INTO testkit.deferred (k) VALUES (:r)"), {"r": str(ctx.run_id)})
        except Exception:  # noqa: BLE001 - the careless body under test
            pass
        return result
    with ctx.finish(result) as s:
        s.execute(
            text("INSERT INTO testkit.effect (run_id, step, pid) VALUES (:r, :s, :p)"),
            {"r": ctx.run_id, "s": ctx.step, "p": os.getpid()},
        )
        if ctx.attempt == 1 and ctx.input.hold_in_finish_s:
            time.sleep(ctx.input.hold_in_finish_s)  # the test kills the worker here
    return result


FINISHER = register(
    Kind(
        name="finisher",
        version=1,
        retry=RetryPolicy(max_attempts=3, initial_s=0.1, max_s=0.5),
        input_model=FinishInput,
        canvas=(step("write", finishing), step("after", lambda ctx: record(ctx) and "after")),
    )
)


class OutageInput(BaseModel):
    """What the step meets on each execution, in order: `U` a service it needs is down
    (`Unavailable`), `P` Postgres ends the body's session under it (`pg_terminate_backend`, as a
    restart does), `H` the body sits for a minute inside a fenced transaction (where a SIGSTOP
    freezes it with the step row locked), `F` an ordinary error, `.` success (past the end:
    success)."""

    script: str


def scripted(ctx: StepContext) -> str:
    record(ctx)
    with db.transaction() as s:
        n = int(
            s.scalar(
                text("SELECT count(*) FROM testkit.execution WHERE run_id = :r AND step = :s"),
                {"r": ctx.run_id, "s": ctx.step},
            )
        )
    what = ctx.input.script[n - 1] if n <= len(ctx.input.script) else "."
    if what == "U":
        raise Unavailable(f"the service is down (execution {n})")
    if what == "P":
        with db.transaction() as s:
            s.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
    if what == "H":
        with ctx.fenced():
            time.sleep(60)
    if what == "F":
        raise RuntimeError(f"the service answered an error (execution {n})")
    return f"done after {n}"


def _scripted_kind(name: str, retry: RetryPolicy) -> Kind:
    """One `scripted` step under `retry`."""
    return register(
        Kind(name=name, version=1, retry=retry, input_model=OutageInput, canvas=(step("call", scripted),))
    )


# Two attempts, and an outage may last an hour without spending them (`outage_s`).
OUTAGE = _scripted_kind("outage", RetryPolicy(max_attempts=2, initial_s=0.05, max_s=0.1, outage_s=3600.0))
# The step under a backoff long enough to tell its start (1 s) from its cap (10 min).
OUTAGE_LONG = _scripted_kind(
    "outage_long", RetryPolicy(max_attempts=2, initial_s=1.0, max_s=600.0, outage_s=3600.0)
)
# The same step under a policy with no outage window: an `Unavailable` counts like any error.
OUTAGE_COUNTED = _scripted_kind("outage_counted", RetryPolicy(max_attempts=2, initial_s=0.05, max_s=0.1))
