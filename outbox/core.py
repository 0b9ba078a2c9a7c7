"""`add` (in the caller's transaction) and `dispatch` (the beat-driven bridge to the task engine).

Why an outbox: a business write and a broker message cannot commit atomically. Writing the event
in the business transaction makes it exactly as durable as the business change (rolled back with
it), and the dispatcher hands committed events to `TaskEngine.enqueue`, whose idempotency key is
the event's key, so handing one over twice still makes one run.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import cast, func, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from outbox import nudge, tracing
from outbox.models import EventStatus, OutboxEvent

log = logging.getLogger(__name__)

MAX_KEY_LEN = 512
MAX_KIND_LEN = 200
MAX_PAYLOAD_BYTES = 1 << 20

SessionFactory = Callable[[], Session]
"""Returns a new `Session` (a `sessionmaker` works)."""


class Engine(Protocol):
    """What the dispatcher needs from a task engine: an idempotent `enqueue`."""

    def enqueue(self, kind: str, input: Mapping[str, Any], *, idempotency_key: str) -> Any: ...


class OutboxError(Exception):
    """Base of every error the outbox raises on purpose."""


class BadEvent(OutboxError, ValueError):
    """Kind, key or payload rejected by `add`; nothing was written."""


class OutboxConflict(OutboxError, ValueError):
    """`(kind, key)` already holds an event with a different payload; the stored row is untouched."""

    def __init__(self, kind: str, key: str, event_id: int) -> None:
        super().__init__(
            f"outbox key {key!r} of kind {kind!r} is already used by event {event_id} "
            "with a different payload"
        )
        self.kind = kind
        self.key = key
        self.event_id = event_id


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff between dispatch attempts and when an event goes `dead`.

    Delay after the n-th failure: `initial_s * multiplier**(n-1)`, capped at `max_s`
    (1 s, 2 s, 4 s … 5 min). Errors of a `poison` type (the engine rejecting the input) are
    deterministic, so they go dead after `poison_attempts`; anything else after `max_attempts`.
    """

    max_attempts: int = 8
    initial_s: float = 1.0
    max_s: float = 300.0
    multiplier: float = 2.0
    poison_attempts: int = 3
    poison: tuple[type[BaseException], ...] = (ValueError, TypeError)

    def backoff(self, failures: int) -> float:
        return min(self.max_s, self.initial_s * self.multiplier ** max(0, failures - 1))

    def limit_for(self, exc: BaseException) -> int:
        if isinstance(exc, self.poison):
            return min(self.max_attempts, self.poison_attempts)
        return self.max_attempts


DEFAULT_POLICY = RetryPolicy()


@dataclass
class DispatchReport:
    """What one `dispatch` call did (returned by the Celery task, logged, read by tests)."""

    batches: int = 0
    claimed: int = 0
    dispatched: int = 0
    retried: int = 0
    dead: int = 0
    dead_ids: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _unstorable(value: Any) -> str | None:
    """Why Postgres could not store this (decoded JSON) value: text and jsonb refuse a NUL and
    an unpaired surrogate. Checked before the INSERT, so the caller's transaction stays usable."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return "a NUL character"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return "an unpaired surrogate"
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _to_json(payload: Mapping[str, Any]) -> tuple[Any, int]:
    if not isinstance(payload, Mapping):
        raise BadEvent(f"outbox payload must be a mapping, not {type(payload).__name__}")
    try:
        encoded = json.dumps(dict(payload), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadEvent(f"outbox payload must be JSON-serialisable: {exc}") from exc
    value = json.loads(encoded)
    if reason := _unstorable(value):
        raise BadEvent(f"outbox payload contains {reason}")
    return value, len(encoded.encode())


def add(session: Session, kind: str, idempotency_key: str, payload: Mapping[str, Any]) -> int:
    """Write an event in the caller's transaction; returns its id. Commits or rolls back with it.

    Adding the same `(kind, key, payload)` again returns the existing id; the same key with
    another payload raises `OutboxConflict`. After the caller's commit, the dispatcher is nudged
    at once (best effort, if `outbox.celery.install` or `set_nudger` configured one).
    """
    if not isinstance(kind, str) or not kind.strip() or len(kind) > MAX_KIND_LEN or _unstorable(kind):
        raise BadEvent(f"outbox kind must be 1..{MAX_KIND_LEN} characters, no NUL, got {str(kind)[:100]!r}")
    if (
        not isinstance(idempotency_key, str)
        or not idempotency_key.strip()
        or len(idempotency_key) > MAX_KEY_LEN
        or _unstorable(idempotency_key)
    ):
        raise BadEvent(f"outbox idempotency key must be 1..{MAX_KEY_LEN} characters, no NUL")
    value, size = _to_json(payload)
    if size > MAX_PAYLOAD_BYTES:
        raise BadEvent(f"outbox payload is {size} bytes, limit {MAX_PAYLOAD_BYTES}")
    # Two tries: a purge may delete the conflicting (dispatched) row between the insert and the
    # read; the second insert then lands. Re-dispatching a purged key is harmless (see
    # `purge_dispatched`). Proof: `tests/integration/test_outbox.py::
    # test_add_of_a_key_purged_between_its_insert_and_its_read_adds_it_again`.
    for _ in range(2):
        event_id = session.scalar(
            pg_insert(OutboxEvent)
            .values(kind=kind, idempotency_key=idempotency_key, payload=value, trace=tracing.carrier())
            .on_conflict_do_nothing(index_elements=[OutboxEvent.kind, OutboxEvent.idempotency_key])
            .returning(OutboxEvent.id)
        )
        if event_id is not None:
            nudge.arm(session)
            return int(event_id)
        # Compared as jsonb, by Postgres: a float such as 9.540277552637683e16 is stored as the
        # numeric 95402775526376830 and reads back as another Python number.
        existing = session.execute(
            select(OutboxEvent.id, (OutboxEvent.payload == cast(value, JSONB)).label("same")).where(
                OutboxEvent.kind == kind, OutboxEvent.idempotency_key == idempotency_key
            )
        ).one_or_none()
        if existing is None:
            continue
        if not existing.same:
            raise OutboxConflict(kind, idempotency_key, existing.id)
        return int(existing.id)
    raise RuntimeError(f"outbox event ({kind}, {idempotency_key}) neither inserted nor found twice")


def _storable(text: str) -> str:
    """`text` with what Postgres' text and jsonb refuse (NUL, unpaired surrogates) escaped."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def _error(exc: BaseException, attempt: int) -> dict[str, Any]:
    """The row's `last_error`: always storable, or recording it would fail the whole batch's
    commit (the other rows' marks lost, this row's attempts never counted: it would never go dead)."""
    try:
        message = str(exc)
    except Exception:
        message = f"<{type(exc).__name__}: str() failed>"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:])
    return {
        "type": _storable(type(exc).__name__),
        "message": _storable(message[:2000]),
        "attempt": attempt,
        "traceback": _storable(tb[-3000:]),
    }


def dispatch_batch(
    session_factory: SessionFactory,
    engine: Engine,
    *,
    batch: int = 100,
    policy: RetryPolicy = DEFAULT_POLICY,
    budget_s: float = 5.0,
) -> DispatchReport:
    """Claim up to `batch` due rows (`FOR UPDATE SKIP LOCKED`), enqueue each, record each outcome.

    The claimed rows stay locked until the batch commits, so a concurrent dispatcher skips them.
    Every row's outcome is recorded on its own row (the engine's failure never aborts this
    transaction), so a poison row cannot block the others. A crash before the commit leaves the
    rows pending; their next dispatch calls `enqueue` again with the same key: the same run.
    Rows not reached within `budget_s` are left untouched for the next batch.
    """
    report = DispatchReport(batches=1)
    started = time.monotonic()
    with session_factory() as s, s.begin():
        rows = s.scalars(
            select(OutboxEvent)
            .where(OutboxEvent.status == EventStatus.PENDING, OutboxEvent.next_attempt_at <= func.now())
            .order_by(OutboxEvent.next_attempt_at, OutboxEvent.id)
            .limit(batch)
            .with_for_update(skip_locked=True)
        ).all()
        report.claimed = len(rows)
        for row in rows:
            if time.monotonic() - started > budget_s:
                break
            try:
                with tracing.dispatch_span(row.trace, row.id, row.kind, row.idempotency_key):
                    ref = engine.enqueue(row.kind, row.payload, idempotency_key=row.idempotency_key)
            except Exception as exc:
                failures = row.attempts + 1
                row.attempts = failures
                row.last_error = _error(exc, failures)
                if failures >= policy.limit_for(exc):
                    row.status = EventStatus.DEAD
                    report.dead += 1
                    report.dead_ids.append(row.id)
                    log.error(
                        "outbox event %s (%s) is dead after %d attempts: %s", row.id, row.kind, failures, exc
                    )
                else:
                    delay = policy.backoff(failures)
                    row.next_attempt_at = func.clock_timestamp() + timedelta(seconds=delay)
                    report.retried += 1
                    log.warning(
                        "outbox event %s (%s) failed, retry in %.0fs: %s", row.id, row.kind, delay, exc
                    )
                continue
            row.status = EventStatus.DISPATCHED
            row.attempts = row.attempts + 1
            row.dispatched_at = datetime.now(UTC)  # when enqueue returned, not when the batch commits
            run_id = getattr(ref, "task_run_id", ref)
            row.run_ref = None if run_id is None else str(run_id)[:200]
            report.dispatched += 1
    return report


def dispatch(
    session_factory: SessionFactory,
    engine: Engine,
    *,
    batch: int = 100,
    policy: RetryPolicy = DEFAULT_POLICY,
    time_budget_s: float = 10.0,
) -> DispatchReport:
    """Dispatch due events batch after batch until none is left or `time_budget_s` is spent.

    Safe to run from any number of processes at once (beat, nudges, a CLI).
    """
    total = DispatchReport()
    deadline = time.monotonic() + time_budget_s
    while True:
        r = dispatch_batch(
            session_factory,
            engine,
            batch=batch,
            policy=policy,
            budget_s=max(0.5, deadline - time.monotonic()),
        )
        total.batches += 1
        total.claimed += r.claimed
        total.dispatched += r.dispatched
        total.retried += r.retried
        total.dead += r.dead
        total.dead_ids.extend(r.dead_ids)
        if r.claimed < batch or time.monotonic() >= deadline:
            break
    if total.dispatched or total.retried or total.dead:
        log.info("outbox dispatch: %s", json.dumps(total.as_dict()))
    return total


PURGE_DISPATCHED = text(
    """
    DELETE FROM outbox.outbox_event
     WHERE status = 'dispatched' AND dispatched_at < now() - make_interval(secs => :secs)
    """
)


def purge_dispatched(session: Session, older_than_s: float) -> int:
    """Delete the events dispatched more than `older_than_s` ago, in the caller's transaction;
    returns how many. Why: a dispatched row is history only, and the engine's enqueue is
    idempotent forever (a later `add` of the same key enqueues the same run, not a second one).
    Pending and dead rows are never purged (`tests/integration/test_acquisition_kinds.py::
    test_purge_drops_finished_steps_keeps_runs_dead_letters_and_unfinished_work`)."""
    return int(session.execute(PURGE_DISPATCHED, {"secs": older_than_s}).rowcount)  # type: ignore[attr-defined]


def pending_count(session: Session) -> int:
    """The backlog (for /admin and tests): events not yet dispatched and not dead."""
    return int(
        session.scalar(
            select(func.count()).select_from(OutboxEvent).where(OutboxEvent.status == EventStatus.PENDING)
        )
        or 0
    )
