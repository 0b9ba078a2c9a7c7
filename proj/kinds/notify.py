"""`notify`: POST the requester's webhook once, with an idempotency key the receiver can use."""

from __future__ import annotations

from typing import Any

import httpx

from proj.acquisition import service
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, NotDone, effect
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.kinds.common import TaskInput, load_task


def post_webhook(ctx: StepContext) -> dict[str, Any]:
    task = load_task(ctx)
    if not task.webhook_url:
        # Nobody to tell, but the request has finished all the same: `notified` is its end (the
        # admin page stops refreshing, a cancel is refused), not `imported` for ever.
        skipped = {"skipped": "no webhook"}
        with ctx.finish(skipped) as s:
            if service.advance_status(s, task.id, "notified"):
                service.event(s, task.id, "finished", reason="no webhook to notify")
        return skipped
    key = f"notify:{task.id}"
    body = {"download_task_id": str(task.id), "title": task.title, "status": "imported"}

    def do(att: Attempt) -> dict[str, Any]:
        att.check()
        r = httpx.post(task.webhook_url, json=body, headers={"Idempotency-Key": key}, timeout=10)
        r.raise_for_status()
        return {"status": r.status_code}

    def reconcile(att: Attempt) -> NotDone:
        # A webhook cannot be asked whether it saw us; re-send with the same Idempotency-Key.
        return NotDone("re-send with the same Idempotency-Key")

    result = effect(ctx, key, {"url": task.webhook_url}, do, reconcile, effect_kind="http")
    with ctx.finish(result) as s:
        if service.advance_status(s, task.id, "notified"):  # not again on a retry
            service.event(s, task.id, "requester notified", status=result.get("status"))
    return result


NOTIFY = register(
    Kind(
        name="notify",
        version=1,
        retry=RetryPolicy.network(),
        input_model=TaskInput,
        canvas=(step("post", post_webhook),),
        description="POST the requester's webhook with an Idempotency-Key",
    )
)
