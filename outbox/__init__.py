"""Transactional outbox: bridge a business transaction and the task engine (DESIGN.md inv. 6).

Usable by any SQLAlchemy 2 / Postgres / Celery project; it imports nothing from `proj`.

Public API::

    import outbox

    with Session.begin() as session:             # the business transaction
        session.add(Order(...))
        outbox.add(session, "notify", f"order:{order_id}", {"order_id": order_id})
    # committed: the event exists; rolled back: it never did

    from outbox.celery import install            # once, where the Celery app is built
    install(app, session_factory=Session, engine_factory=MyTaskEngine, beat_interval=1.0)

- `add(session, kind, idempotency_key, payload)` writes `outbox.outbox_event` in the caller's
  transaction. Same key + same payload returns the same id; another payload raises
  `OutboxConflict`; a bad kind/key/payload raises `BadEvent` (both `ValueError`).
- `dispatch(session_factory, engine, ...)` claims due `pending` rows with
  `FOR UPDATE SKIP LOCKED`, calls `engine.enqueue(kind, payload, idempotency_key=key)` and marks
  each `dispatched`; a failure backs off exponentially (`RetryPolicy`: 1 s → 5 min); past the
  limit the row is `dead` with its error. Any number of dispatchers may run at once.
- `outbox.celery.install(...)` registers the `outbox.dispatch` task and its beat entry, and a
  post-commit nudge so a committed event is dispatched at once, not at the next beat tick.
- `Engine` is the protocol the dispatcher needs (anything with an idempotent `enqueue`).

Table: `outbox.outbox_event` (`outbox.models.OutboxEvent`, metadata `outbox.models.Base`).
"""

from outbox.core import (
    DEFAULT_POLICY,
    BadEvent,
    DispatchReport,
    Engine,
    OutboxConflict,
    OutboxError,
    RetryPolicy,
    SessionFactory,
    add,
    dispatch,
    dispatch_batch,
    pending_count,
    purge_dispatched,
)
from outbox.models import Base, EventStatus, OutboxEvent
from outbox.nudge import Nudger, set_nudger

__all__ = [
    "DEFAULT_POLICY",
    "BadEvent",
    "Base",
    "DispatchReport",
    "Engine",
    "EventStatus",
    "Nudger",
    "OutboxConflict",
    "OutboxError",
    "OutboxEvent",
    "RetryPolicy",
    "SessionFactory",
    "add",
    "dispatch",
    "dispatch_batch",
    "pending_count",
    "purge_dispatched",
    "set_nudger",
]
