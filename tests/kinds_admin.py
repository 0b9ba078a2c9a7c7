"""Kinds for the admin tests (loaded through ENGINE_EXTRA_KINDS, see tests/conftest.py).

`mendable` fails its `fetch` step until a business row says the problem is fixed, so an operator
can resolve its dead letter with "retry" and see it finish; `copy` reports live progress. Its
timeline hook reads that business row (a stand-in for the acquisition tables).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.orm import Session

from proj import db
from proj.admin.timeline import RunInfo, TimelineEvent, ledger_timeline, register_timeline
from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step

ADMIN_DDL = """
CREATE SCHEMA IF NOT EXISTS testkit_admin;
CREATE TABLE IF NOT EXISTS testkit_admin.fix (
    key text PRIMARY KEY, fixed boolean NOT NULL DEFAULT false,
    fixed_at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


class MendInput(BaseModel):
    key: str
    chunks: int = 5
    chunk_s: float = 0.1


def fetch(ctx: StepContext) -> str:
    """Fails (a dead letter after 2 attempts) until `testkit_admin.fix` says the key is fixed."""
    with db.transaction() as s:
        fixed = s.scalar(text("SELECT fixed FROM testkit_admin.fix WHERE key = :k"), {"k": ctx.input.key})
    if not fixed:
        raise RuntimeError(f"source for {ctx.input.key} unreachable")
    return "fetched"


def copy(ctx: StepContext) -> int:
    """A chunked copy that reports progress (what `/admin/runs/{id}` shows live)."""
    total = ctx.input.chunks
    for done in range(total):
        ctx.checkpoint()
        ctx.report_progress(done, total, f"chunk {done + 1} of {total}")
        time.sleep(ctx.input.chunk_s)
    ctx.report_progress(total, total, "done")
    return total


MENDABLE = register(
    Kind(
        name="mendable",
        version=1,
        retry=RetryPolicy(max_attempts=2, initial_s=0.1, max_s=0.2),
        input_model=MendInput,
        canvas=(step("prepare", lambda ctx: "ready"), step("fetch", fetch), step("copy", copy)),
    )
)


def mendable_timeline(s: Session, run: RunInfo) -> Iterable[TimelineEvent]:
    """Business events from the stand-in business table, plus the ledger's effects."""
    row = s.execute(
        text("SELECT fixed, fixed_at FROM testkit_admin.fix WHERE key = :k"), {"k": run.input.get("key")}
    ).first()
    events = ledger_timeline(s, run)
    if row is not None and row.fixed:
        events.append(
            TimelineEvent(row.fixed_at, "source repaired by operator", source="business", state="ok")
        )
    return events


register_timeline("mendable", mendable_timeline)
