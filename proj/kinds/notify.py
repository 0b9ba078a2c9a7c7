"""`notify`: POST the requester's webhook once, with an idempotency key the receiver can use."""

from __future__ import annotations

from typing import Any

import httpx

from proj.acquisition import service
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, NotDone, effect
from proj.engine.errors import NonRetryable, Unavailable
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.kinds.common import TaskInput, load_task, note_outage


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
        if refused_for_good(r.status_code):
            raise NonRetryable(
                f"the webhook {task.webhook_url} answered {r.status_code}: it refuses this call, "
                "so it is not sent again; fix the receiver and retry the run"
            )
        r.raise_for_status()
        return {"status": r.status_code}

    def reconcile(att: Attempt) -> NotDone:
        # A webhook cannot be asked whether it saw us; re-send with the same Idempotency-Key.
        return NotDone("re-send with the same Idempotency-Key")

    try:
        result = effect(ctx, key, {"url": task.webhook_url}, do, reconcile, effect_kind="http")
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.HTTPStatusError) as exc:
        down = receiver_down(task.webhook_url, exc)
        if down is None:
            raise
        note_outage(task.id, WEBHOOK_DOWN, down)
        raise down from exc
    with ctx.finish(result) as s:
        if service.advance_status(s, task.id, "notified"):  # not again on a retry
            service.event(s, task.id, "requester notified", status=result.get("status"))
    return result


def receiver_down(url: str, exc: Exception) -> ReceiverDown | None:
    """The outage `exc` says the receiver is in, or None: refused or no connection in time, or a
    gateway's 502/503/504 (the receiver behind it is not there)."""
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        if status not in DOWN_STATUSES:
            return None
        return ReceiverDown(f"the webhook {url} answered {status}: it is down")
    return ReceiverDown(f"the webhook {url} did not answer: {exc}")


def refused_for_good(status: int) -> bool:
    """A 4xx other than timeout (408), too early (425) and too many requests (429): the receiver
    refuses this call, and sending it again for half an hour changes nothing."""
    return 400 <= status < 500 and status not in (408, 425, 429)


# A requester's endpoint may be down for minutes (a deploy, a restart). The network policy's five
# attempts spent about 15 s, so an outage of a minute made the notice a dead letter; these twelve
# wait 2 s, 4 s, … up to 10 min apart, about 40 min in all, as webhook senders commonly do
# (`tests/integration/test_notify.py`).
#
# A receiver that is not there at all (refused, no connection in time, a gateway's 502/503/504)
# is an outage (`ReceiverDown`): those attempts are not spent for up to a day, tried every
# 10 min, so a home server down overnight still gets its notice in the morning
# (`tests/integration/test_outages.py`). An answer that is an error (a 500, a timeout after the
# request was sent) counts: the receiver saw the call, so sending it for a day is no kinder.
WEBHOOK_RETRY = RetryPolicy(max_attempts=12, initial_s=2.0, max_s=600.0, outage_s=24 * 3600.0)
DOWN_STATUSES = frozenset({502, 503, 504})


WEBHOOK_DOWN = "webhook unreachable"


class ReceiverDown(Unavailable):
    """The webhook's receiver is down: an outage, not a refusal of this call."""


NOTIFY = register(
    Kind(
        name="notify",
        version=1,
        retry=WEBHOOK_RETRY,
        input_model=TaskInput,
        canvas=(step("post", post_webhook),),
        description="POST the requester's webhook with an Idempotency-Key",
    )
)
