"""`purge` (periodic): retention of finished runs' step data, dispatched outbox rows and signals.

Run rows themselves stay (they hold the idempotency key and its input hash, which never
expire); their steps, attempts and results older than the retention go.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.kinds.reconcile_downloads import PeriodicInput
from proj.settings import get_settings


def purge(ctx: StepContext) -> dict[str, Any]:
    days = get_settings().retention_days
    out: dict[str, Any] = {}
    with ctx.fenced() as s:
        out["steps"] = s.execute(
            text(
                "DELETE FROM engine.step WHERE run_id IN (SELECT id FROM engine.task_run "
                "WHERE status IN ('succeeded', 'failed', 'canceled') "
                "AND finished_at < now() - make_interval(days => :d))"
            ),
            {"d": days},
        ).rowcount
        out["signals"] = s.execute(
            text("DELETE FROM engine.task_signal WHERE created_at < now() - make_interval(days => :d)"),
            {"d": days},
        ).rowcount
        if s.scalar(text("SELECT to_regclass('outbox.outbox_event') IS NOT NULL")):
            out["outbox"] = s.execute(
                text(
                    "DELETE FROM outbox.outbox_event WHERE status = 'dispatched' "
                    "AND dispatched_at < now() - make_interval(days => :d)"
                ),
                {"d": days},
            ).rowcount
    return out


PURGE = register(
    Kind(
        name="purge",
        version=1,
        retry=RetryPolicy.db(),
        input_model=PeriodicInput,
        canvas=(step("purge", purge),),
        description="periodic: retention of finished runs, dispatched outbox rows, old signals",
    )
)
