"""`purge` (periodic): retention of finished runs' step data, dispatched outbox rows and signals.

Run rows themselves stay (they hold the idempotency key and its input hash, which never
expire); their steps, attempts and results older than the retention go. Failed runs keep their
steps: they are dead letters until an operator retries (from the failed step) or abandons them.
"""

from __future__ import annotations

from typing import Any

import outbox
from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.engine.store import retention
from proj.kinds.reconcile_downloads import PeriodicInput
from proj.settings import get_settings


def purge(ctx: StepContext) -> dict[str, Any]:
    # In seconds: `RETENTION_DAYS` is a float and `make_interval(days => …)` takes only integers.
    secs = get_settings().retention_days * 86400.0
    out: dict[str, Any] = {}
    with ctx.fenced() as s:
        out["steps"] = retention.purge_finished_steps(s, secs)
        out["signals"] = retention.purge_signals(s, secs)
        out["outbox"] = outbox.purge_dispatched(s, secs)
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
