"""Run-level operations behind the port: enqueue, get, signal, cancel and operator decisions.

All of them write Postgres first and publish after commit; steps themselves are committed only
by `proj.engine.protocol`.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from pydantic_core import to_jsonable_python
from sqlalchemy import text
from sqlalchemy.orm import Session

from proj import db
from proj.engine import dispatch, tracing
from proj.engine.context import PlanContext
from proj.engine.dispatch import Dispatch, step_dispatch
from proj.engine.errors import (
    BadIdempotencyKey,
    BadTopic,
    IdempotencyConflict,
    InvalidInput,
    PayloadTooLarge,
)
from proj.engine.kind import Kind, get_kind
from proj.engine.port import TaskRunRef, TaskRunView
from proj.engine.protocol import (
    STAGE_STEPS,
    create_stage,
    finalize_cancel,
    stage_dispatches,
    stage_rows,
)
from proj.engine.status import TERMINAL, RunStatus
from proj.engine.store import runs as store_runs
from proj.engine.store import waits
from proj.engine.store.waits import Woken
from proj.settings import get_settings

TOPIC_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}(:[A-Za-z0-9_.\-/@+=]{1,200})*")  # whole topic: fullmatch
MAX_TOPIC_LEN = 512
MAX_KEY_LEN = 512


def unstorable(value: Any) -> str | None:
    """Why Postgres could not store this JSON-shaped value as text/jsonb (a NUL, a lone
    surrogate), or None. Checked before writing, so the error is typed and nothing is written."""
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
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return None


def to_json_text(value: Any, what: str) -> str:
    """Strict JSON for a jsonb column: no NaN/Infinity, nothing Postgres refuses; typed errors."""
    try:
        jsonable = to_jsonable_python(value)
        encoded = json.dumps(jsonable, allow_nan=False)
    except (ValueError, TypeError) as exc:  # PydanticSerializationError is a ValueError
        raise InvalidInput(f"{what} is not JSON-serialisable: {exc}") from exc
    if reason := unstorable(jsonable):
        raise InvalidInput(f"{what} contains {reason}")
    return encoded


def canonical_input(kind: Kind, input: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Validate against the kind's model; return the stored JSON and its hash.

    The hash covers only what the caller set (`exclude_unset`), so adding a defaulted field in a
    later version does not turn an honest retry into a conflict.
    """
    if not isinstance(input, Mapping):
        raise InvalidInput(f"input of {kind.name} must be a mapping, not {type(input).__name__}")
    try:
        model = kind.input_model.model_validate(dict(input))
    except ValidationError as exc:
        raise InvalidInput(f"invalid input for {kind.name}@{kind.version}: {exc}") from exc
    try:
        stored = model.model_dump(mode="json")
        given = to_jsonable_python(model.model_dump(mode="json", exclude_unset=True))
        encoded = json.dumps(stored, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as exc:  # unserialisable values in `Any` fields, NaN, ±inf
        raise InvalidInput(f"input of {kind.name} is not JSON-serialisable: {exc}") from exc
    if reason := unstorable(stored):
        raise InvalidInput(f"input of {kind.name} contains {reason}")
    limit = get_settings().max_input_bytes
    if len(encoded.encode()) > limit:
        raise PayloadTooLarge(f"input of {kind.name} is {len(encoded)} bytes, limit {limit}")
    digest = hashlib.sha256(json.dumps(given, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return stored, digest


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY_LEN or unstorable(key):
        raise BadIdempotencyKey(f"idempotency key must be 1..{MAX_KEY_LEN} characters, no NUL")


def check_reason(reason: str) -> None:
    if not isinstance(reason, str) or unstorable(reason):
        raise InvalidInput("a cancel/abandon reason must be text without NUL characters")


def check_topic(topic: str) -> None:
    if not isinstance(topic, str) or len(topic) > MAX_TOPIC_LEN or not TOPIC_RE.fullmatch(topic):
        raise BadTopic(
            f"bad signal topic {str(topic)[:100]!r}: expected 'name' or 'name:part' (at most "
            f"{MAX_TOPIC_LEN} characters), no spaces"
        )


def insert_run(
    s: Session,
    kind_name: str,
    input: Mapping[str, Any],
    *,
    idempotency_key: str,
    available_at: datetime | None = None,
    priority: int = 0,
    trace: Mapping[str, Any] | None = None,
    version: int | None = None,
) -> tuple[TaskRunRef, list[Dispatch]]:
    """Create the run and its first stage inside the caller's transaction (or find its twin).

    `version` pins an older version (an old build still enqueuing during a rollout); by default
    a run starts on the newest version this process knows, and keeps it to the end.
    `priority` (higher first, FIFO within one priority) orders the start of a kind's pending
    runs: in the admission line of a limited kind, by the claim of the start step otherwise
    (`protocol._CLAIM_START`, whatever order the broker delivers in), and the sweeper's re-sends.
    `trace` is a W3C carrier to parent the run's trace on; by default the caller's current span
    is the parent.
    """
    check_key(idempotency_key)
    if available_at is not None and not isinstance(available_at, datetime):
        raise InvalidInput(f"available_at must be a datetime or None, not {type(available_at).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) < priority < 2**31:
        raise InvalidInput(f"priority must be a 32-bit integer, not {priority!r}")
    kind = get_kind(kind_name, version)
    stored, digest = canonical_input(kind, input)
    ckey = kind.concurrency_key(kind.input_model.model_validate(stored)) if kind.concurrency_key else None
    if ckey is not None and not isinstance(ckey, str):
        ckey = str(ckey)
    run_id = uuid.uuid4()
    with tracing.enqueue_span(kind.name, kind.version, run_id, parent=trace) as (span, carrier):
        ref, out = _insert(
            s, kind, stored, digest, idempotency_key, run_id, ckey, available_at, priority, carrier
        )
        span.set_attribute("engine.created", ref.created)
        if not ref.created:
            span.set_attribute("engine.run_id", str(ref.task_run_id))
    return ref, out


# The run and its first stage in one statement (`protocol.stage_rows` gives the step arrays; an
# empty first stage inserts the run alone). No row back: the key names an existing run.
_INSERT_RUN = text(
    """
    WITH run AS (
        INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash,
                                     priority, concurrency_key, available_at, trace,
                                     current_stage, current_step)
        VALUES (:run, :kind, :version, :key, CAST(:input AS jsonb), :hash, :priority, :ckey,
                coalesce(:at, now()), CAST(:trace AS jsonb), :stage, :label)
        ON CONFLICT (kind, idempotency_key) DO NOTHING
        RETURNING id
    ), ins AS ("""
    + STAGE_STEPS.format(run="run.id", runs="run,")
    + """
    )
    SELECT run.id AS run_id, ins.id, ins.name FROM run LEFT JOIN ins ON true ORDER BY ins.item_index
    """
)
_EXISTING = text("SELECT id, input_hash FROM engine.task_run WHERE kind = :kind AND idempotency_key = :key")


def _insert(
    s: Session,
    kind: Kind,
    stored: dict[str, Any],
    digest: str,
    idempotency_key: str,
    run_id: uuid.UUID,
    ckey: str | None,
    available_at: datetime | None,
    priority: int,
    trace: Mapping[str, Any] | None,
) -> tuple[TaskRunRef, list[Dispatch]]:
    plan = PlanContext(run_id=run_id, kind=kind, raw_input=stored, _session=s)
    first = stage_rows(kind, 0, plan)
    due_now = available_at is None
    inserted = s.execute(
        _INSERT_RUN,
        {
            "run": run_id,
            "kind": kind.name,
            "version": kind.version,
            "key": idempotency_key,
            "input": json.dumps(stored),
            "hash": digest,
            "priority": priority,
            "ckey": ckey,
            "at": available_at,
            "trace": json.dumps(dict(trace)) if trace else None,
            "stage": 0,
            "label": kind.canvas[0].label,
            **first,
            "due": due_now,
        },
    ).all()
    if not inserted:
        existing = s.execute(_EXISTING, {"kind": kind.name, "key": idempotency_key}).one()
        if existing.input_hash != digest:
            raise IdempotencyConflict(kind.name, idempotency_key, existing.id)
        return TaskRunRef(existing.id, created=False), []
    ref = TaskRunRef(run_id, created=True)
    if first["names"]:
        out = stage_dispatches(kind, inserted, priority) if due_now else []
        # With held siblings, item 0 starts the run; the rest go out when it is claimed.
        return ref, out[:1] if kind.holds_start_siblings else out
    for stage in range(1, len(kind.canvas)):  # the first stage was an empty fan-out
        has_steps, out = create_stage(
            s, run_id, kind, stage, plan, available_at=available_at, priority=priority
        )
        if has_steps:
            return ref, out
    s.execute(
        text("UPDATE engine.task_run SET status = 'succeeded', finished_at = now() WHERE id = :id"),
        {"id": run_id},
    )
    return ref, []


def enqueue(
    kind: str,
    input: Mapping[str, Any],
    *,
    idempotency_key: str,
    available_at: datetime | None = None,
    priority: int = 0,
    trace: Mapping[str, Any] | None = None,
    version: int | None = None,
) -> TaskRunRef:
    """Idempotent forever: the same `(kind, key)` always names the same run."""
    with db.transaction() as s:
        ref, out = insert_run(
            s,
            kind,
            input,
            idempotency_key=idempotency_key,
            available_at=available_at,
            priority=priority,
            trace=trace,
            version=version,
        )
    dispatch.publish_after_commit(out)
    return ref


def get(run_id: uuid.UUID) -> TaskRunView | None:
    """The read-only projection of a run (and of its current step)."""
    with db.transaction() as s:
        row = s.execute(
            text(
                """
                SELECT r.*, st.attempts AS step_attempts, st.wait_topic, st.wait_until,
                       st.pending_since, st.due_at, st.blocked_reason, now() AS db_now
                  FROM engine.task_run r
                  LEFT JOIN LATERAL (
                       SELECT max(attempts) AS attempts, max(wait_topic) AS wait_topic,
                              min(wait_until) AS wait_until,
                              min(created_at) FILTER (WHERE status = 'pending') AS pending_since,
                              min(next_attempt_at) FILTER (WHERE status = 'pending') AS due_at,
                              max(blocked_reason) FILTER (WHERE status = 'pending') AS blocked_reason
                         FROM engine.step
                        WHERE run_id = r.id AND stage = r.current_stage) st ON true
                 WHERE r.id = :id
                """
            ),
            {"id": run_id},
        ).first()
    if row is None:
        return None
    return TaskRunView(
        id=row.id,
        kind=row.kind,
        version=row.version,
        status=RunStatus(row.status),
        current_step=row.current_step,
        attempts=row.step_attempts or 0,
        last_error=row.last_error,
        result=row.result,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        cancel_requested=row.cancel_requested_at is not None,
        wait_topic=row.wait_topic if row.status == "waiting" else None,
        wait_until=row.wait_until if row.status == "waiting" else None,
        pending_reason=_pending_reason(row),
    )


def find(kind: str, idempotency_key: str) -> TaskRunView | None:
    """The run a `(kind, idempotency_key)` names, if it was ever enqueued (invariant 5)."""
    with db.transaction() as s:
        found = store_runs.find_by_keys(s, [(kind, idempotency_key)])
    return get(found[0].id) if found else None


def _pending_reason(row: Any) -> str | None:
    """Why a run is not moving: a future start, a full concurrency limit, or no worker serving
    its version picked it up."""
    if row.status not in ("pending", "running") or row.due_at is None:
        return None
    if row.due_at > row.db_now:
        return f"scheduled for {row.due_at.isoformat()}"
    if row.blocked_reason:
        return str(row.blocked_reason)
    waited = (row.db_now - max(row.due_at, row.pending_since)).total_seconds()
    if waited > get_settings().republish_after_s:
        return (
            f"not picked up for {waited:.0f}s: is a worker serving {row.kind}@{row.version} "
            f"(queue {row.kind}.v{row.version}) running?"
        )
    return None


def signal(topic: str, payload: Any = None) -> int:
    """Store the signal, then wake every run parked on the topic; returns how many woke."""
    check_topic(topic)
    body = to_json_text(payload, "signal payload")
    if len(body) > get_settings().max_input_bytes:
        raise PayloadTooLarge("signal payload too large")
    with db.transaction() as s:
        s.execute(text("SELECT pg_advisory_xact_lock(hashtext(:t))"), {"t": topic})
        s.execute(
            text("INSERT INTO engine.task_signal (topic, payload) VALUES (:t, CAST(:p AS jsonb))"),
            {"t": topic, "p": body},
        )
        out = woken_dispatches(waits.wake_topic(s, topic))
    # Many waiters on one topic travel WAKE_BATCH to a message (`dispatch.batched`).
    dispatch.publish_after_commit(dispatch.batched(out, dispatch.wake_batch_size()))
    return len(out)


def woken_dispatches(woken: Sequence[Woken]) -> list[Dispatch]:
    """The messages for steps a wake sent back to work."""
    return [step_dispatch(w.id, w.kind, w.version, w.name, w.priority) for w in woken]


def cancel(run_id: uuid.UUID, reason: str) -> None:
    """Business first: record the request (and the kind's business hook), then stop the run.

    A running step is not killed; it sees `cancel_requested()` and stops itself, and the run is
    finalised when it does (or when its lease expires).
    """
    check_reason(reason)
    with db.transaction() as s:
        run = s.execute(
            text("SELECT id, kind, version, input, status FROM engine.task_run WHERE id = :id FOR UPDATE"),
            {"id": run_id},
        ).first()
        if run is None:
            raise KeyError(f"no run {run_id}")
        if run.status in TERMINAL:
            return
        kind = get_kind(run.kind, run.version)
        if kind.on_cancel is not None:
            kind.on_cancel(s, run.id, kind.input_model.model_validate(run.input))
        s.execute(
            text(
                "UPDATE engine.task_run SET cancel_requested_at = coalesce(cancel_requested_at, "
                "now()), cancel_reason = :reason, updated_at = now() WHERE id = :id"
            ),
            {"reason": reason[:2000], "id": run_id},
        )
        out = finalize_cancel(s, run_id)
    dispatch.publish_after_commit(out)


def retry_failed(run_id: uuid.UUID) -> int:
    """Operator decision on a dead letter: retry from the failed step(s) with fresh attempts."""
    with db.transaction() as s:
        run = s.execute(
            text("SELECT kind, version, status FROM engine.task_run WHERE id = :id FOR UPDATE"),
            {"id": run_id},
        ).first()
        if run is None or run.status != "failed":
            return 0
        rows = s.execute(
            text(
                "UPDATE engine.step SET status = 'pending', attempts = 0, next_attempt_at = now(),"
                " published_at = now(), finished_at = NULL WHERE run_id = :id "
                "AND status IN ('failed', 'pending') RETURNING id, name"
            ),
            {"id": run_id},
        ).all()
        s.execute(
            text(
                "UPDATE engine.task_run SET status = 'running', finished_at = NULL, "
                "updated_at = now() WHERE id = :id"
            ),
            {"id": run_id},
        )
    dispatch.publish_after_commit([step_dispatch(r.id, run.kind, run.version, r.name) for r in rows])
    return len(rows)


def abandon(run_id: uuid.UUID, reason: str) -> None:
    """Operator decision on a dead letter: give up, with the kind's compensation."""
    check_reason(reason)
    with db.transaction() as s:
        s.execute(
            text(
                "UPDATE engine.task_run SET status = 'running', cancel_requested_at = now(), "
                "cancel_reason = :reason WHERE id = :id AND status = 'failed'"
            ),
            {"reason": f"abandoned: {reason}"[:2000], "id": run_id},
        )
        out = finalize_cancel(s, run_id)
    dispatch.publish_after_commit(out)


__all__ = [
    "abandon",
    "cancel",
    "enqueue",
    "get",
    "insert_run",
    "retry_failed",
    "signal",
]
