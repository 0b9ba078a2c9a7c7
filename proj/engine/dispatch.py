"""Publishing step messages. A message is a hint that names a step row; losing one is harmless
because the sweeper re-sends whatever Postgres says is due and unpublished."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from proj import db
from proj.engine import broker
from proj.engine.kind import queue_name, task_name
from proj.engine.store import recovery as store
from proj.settings import get_settings

log = logging.getLogger(__name__)

# Fail fast when the broker is down: the sweeper is the retry loop, not the caller.
PUBLISH_RETRY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.5}


@dataclass(frozen=True)
class Dispatch:
    """One message to send: the step row id, its task name and its version queue.

    `more`: further step rows of the same step task, which the delivery claims and runs one
    after another (`batched`). Each keeps its own claim, lease and fenced commit.
    """

    step_id: int
    task_name: str
    queue: str
    priority: int = 0
    more: tuple[int, ...] = ()

    @property
    def step_ids(self) -> tuple[int, ...]:
        return (self.step_id, *self.more)


def batched(items: Sequence[Dispatch], size: int) -> list[Dispatch]:
    """One message per `size` steps of the same task and priority, in the given order.

    Why: a signal that wakes 1,000 parked runs would otherwise cost 1,000 deliveries, and a
    worker's main process spends ~2.5 ms of Celery per delivery (receive, ack, task events):
    that, not the steps, bounded a mass wake (`bench.signal_latency`, herd). `size` ≤ 1 keeps
    one message per step (`INLINE_STEPS=0`: Flower sees every step).
    """
    if size <= 1 or len(items) <= 1:
        return list(items)
    groups: dict[tuple[str, str, int], list[Dispatch]] = {}
    for d in items:
        groups.setdefault((d.task_name, d.queue, d.priority), []).append(d)
    out: list[Dispatch] = []
    for (task, queue, priority), group in groups.items():
        ids = [i for d in group for i in d.step_ids]
        for n in range(0, len(ids), size):
            chunk = ids[n : n + size]
            out.append(Dispatch(chunk[0], task, queue, priority, tuple(chunk[1:])))
    return out


def wake_batch_size() -> int:
    """Steps per wake message: `WAKE_BATCH`, or 1 when every step is its own message."""
    s = get_settings()
    return 1 if s.inline_steps == 0 else s.wake_batch


def step_dispatch(step_id: int, kind: str, version: int, step: str, priority: int = 0) -> Dispatch:
    """The message for a step row, computed from names only (no need to serve that version)."""
    return Dispatch(step_id, task_name(kind, version, step), queue_name(kind, version), priority)


class _BufferedSentEvents:
    """Stands in for the event dispatcher Celery's `send_task_message` publishes `task-sent`
    with (its `event_dispatcher` option): the events go into a buffered dispatcher instead, which
    sends them as one `task.multi` message, as a worker sends its own buffered task events.
    Flower and `celery events` read both. A batch of N messages then costs N + 1 publishes
    instead of 2N (the sent event was ~40 % of a publish)."""

    def __init__(self, dispatcher: Any) -> None:
        self.dispatcher = dispatcher

    def publish(self, type: str, fields: dict[str, Any], producer: Any, **_options: Any) -> None:
        self.dispatcher.send(type, **fields)


@contextmanager
def _sent_events(app: Any, producer: Any, count: int) -> Iterator[_BufferedSentEvents | None]:
    """A buffered `task-sent` dispatcher for a batch (None: one message, or sent events off)."""
    if count < 2 or not app.conf.task_send_sent_event:
        yield None
        return
    dispatcher = app.events.Dispatcher(
        channel=producer.channel, buffer_group=["task"], buffer_limit=count + 1
    )
    try:
        yield _BufferedSentEvents(dispatcher)
    finally:
        try:
            dispatcher.flush(errors=False)
        except Exception as exc:  # monitoring only: the messages themselves are sent
            log.warning("could not send %d task-sent event(s): %s", count, exc)
        dispatcher.close()


def publish(items: Sequence[Dispatch]) -> list[Dispatch]:
    """Send the messages; return the ones that could not be sent."""
    if not items:
        return []
    app = broker.app()
    copies = get_settings().fault_duplicate_publish
    failed: list[Dispatch] = []
    try:
        with app.producer_or_acquire() as producer, _sent_events(app, producer, len(items)) as sent:
            extra = {"event_dispatcher": sent} if sent is not None else {}
            for d in items:
                try:
                    for _ in range(copies):
                        app.send_task(
                            d.task_name,
                            args=(d.step_id,),
                            kwargs={"more": list(d.more)} if d.more else None,
                            queue=d.queue,
                            producer=producer,
                            retry=True,
                            retry_policy=PUBLISH_RETRY,
                            **extra,
                        )
                except Exception as exc:
                    log.warning("publish of step(s) %s failed: %s", d.step_ids, exc)
                    failed.append(d)
    except Exception as exc:  # no producer at all (broker unreachable)
        log.warning("broker unavailable, %d message(s) left to the sweeper: %s", len(items), exc)
        done = {d.step_id for d in failed}
        failed.extend(d for d in items if d.step_id not in done)
    return failed


def publish_after_commit(items: Sequence[Dispatch]) -> None:
    """Publish; mark what failed as unpublished so the next sweep sends it at once."""
    failed = publish(items)
    if failed:
        try:
            with db.transaction() as s:
                store.mark_unpublished(s, [i for d in failed for i in d.step_ids])
        except Exception as exc:  # then `republish_after_s` covers it
            log.warning("could not mark %d step(s) unpublished: %s", len(failed), exc)
