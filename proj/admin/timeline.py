"""Business timelines for `/admin/runs/{id}` (invariant 11: never raw step attempts).

A kind that owns business tables registers a hook that reads them::

    from proj.admin.timeline import TimelineEvent, register_timeline

    def acquire_timeline(session, run):
        row = session.execute(text("SELECT ... FROM acq.download_task WHERE run_id = :id"), ...)
        return [TimelineEvent(at=row.approved_at, title="approved by bob", source="acq")]

    register_timeline("acquire", acquire_timeline)

Kinds without a hook get the generic fallback: the operation ledger (`ledger.asset_operation`),
which records every external side effect with its plan, attempt and result. The run's own status
changes (created, started, cancel requested, finished) come from `engine.task_run` and are always
shown. This module imports no web framework, so kind modules can register hooks cheaply.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import text
from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

State = Literal["ok", "info", "active", "warn", "error"]


@dataclass(frozen=True)
class TimelineEvent:
    """One line of a business timeline. `at=None` sorts last (e.g. a plan not yet attempted)."""

    at: datetime | None
    title: str
    detail: str = ""
    source: str = "run"
    state: State = "info"
    data: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class RunInfo:
    """What a timeline hook gets about the run: identity, input and lifecycle timestamps."""

    id: uuid.UUID
    kind: str
    version: int
    status: str
    idempotency_key: str
    input: Mapping[str, Any]
    current_step: str | None = None
    last_error: Mapping[str, Any] | None = None
    result: Any = None
    cancel_reason: str | None = None
    created_at: datetime | None = None
    available_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Any) -> RunInfo:
        """From a run row: `proj.engine.store.views.Run`, or any row with `_asdict()` (a
        NamedTuple, a SQLAlchemy `Row`) holding at least the identity columns and `input`."""
        m = row._asdict()
        return cls(
            id=m["id"],
            kind=m["kind"],
            version=m["version"],
            status=m["status"],
            idempotency_key=m["idempotency_key"],
            input=m["input"] or {},
            current_step=m.get("current_step"),
            last_error=m.get("last_error"),
            result=m.get("result"),
            cancel_reason=m.get("cancel_reason"),
            created_at=m.get("created_at"),
            available_at=m.get("available_at"),
            started_at=m.get("started_at"),
            finished_at=m.get("finished_at"),
            cancel_requested_at=m.get("cancel_requested_at"),
        )


TimelineHook = Callable[[Session, RunInfo], Iterable[TimelineEvent]]

_HOOKS: dict[str, TimelineHook] = {}


def register_timeline(kind: str, fn: TimelineHook) -> TimelineHook:
    """Use `fn` instead of the ledger fallback for runs of `kind` (any version). Returns `fn`."""
    _HOOKS[kind] = fn
    return fn


def unregister_timeline(kind: str) -> None:
    """Forget a hook (tests)."""
    _HOOKS.pop(kind, None)


def has_hook(kind: str) -> bool:
    return kind in _HOOKS


def hook_for(kind: str) -> TimelineHook:
    return _HOOKS.get(kind, ledger_timeline)


def _parse_ts(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            return None
    return None


def short_json(value: Any, limit: int = 160) -> str:
    """A compact, bounded rendering of a JSON value for one timeline line."""
    if value is None:
        return ""
    s = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def ledger_table_exists(s: Session) -> bool:
    return bool(s.scalar(text("SELECT to_regclass('ledger.asset_operation') IS NOT NULL")))


def ledger_timeline(s: Session, run: RunInfo) -> list[TimelineEvent]:
    """Generic fallback: the run's side effects from the operation ledger.

    Rows are read as JSON (`to_jsonb`) so the view keeps working while the ledger's columns
    evolve; a database without the ledger simply has no business events.
    """
    if not ledger_table_exists(s):
        return []
    rows = s.scalars(
        text("SELECT to_jsonb(o) FROM ledger.asset_operation o WHERE o.run_id = :id"),
        {"id": run.id},
    ).all()
    events: list[TimelineEvent] = []
    for op in rows:
        key, kind = op.get("op_key", "?"), op.get("effect_kind") or "effect"
        step = op.get("step")
        where = f" (step {step})" if step else ""
        planned = _parse_ts(op.get("created_at")) or _parse_ts(op.get("attempt_started_at"))
        events.append(
            TimelineEvent(
                at=planned,
                title=f"planned {kind}: {key}",
                detail=short_json(op.get("plan")) + where,
                source="ledger",
                state="info",
                data={"op_key": key},
            )
        )
        status = op.get("status")
        started = _parse_ts(op.get("attempt_started_at"))
        attempts = op.get("attempts")
        if status == "done" or op.get("result") is not None:
            how = op.get("resolution")
            events.append(
                TimelineEvent(
                    at=_parse_ts(op.get("finished_at")) or _parse_ts(op.get("updated_at")) or started,
                    title=f"{kind} done{' by ' + how if how else ''}: {key}",
                    detail=short_json(op.get("result")),
                    source="ledger",
                    state="ok",
                    data={"op_key": key},
                )
            )
        elif started is not None:
            events.append(
                TimelineEvent(
                    at=started,
                    title=f"{kind} in progress: {key}",
                    detail=f"attempt {attempts}" if attempts else "",
                    source="ledger",
                    state="active",
                    data={"op_key": key},
                )
            )
        if op.get("last_error") and status != "done":
            err = op["last_error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            events.append(
                TimelineEvent(
                    at=_parse_ts(op.get("updated_at")) or started,
                    title=f"{kind} error: {key}",
                    detail=short_json(msg),
                    source="ledger",
                    state="error",
                    data={"op_key": key},
                )
            )
    return events


def run_events(run: RunInfo, parked: Mapping[str, Any] | None = None) -> list[TimelineEvent]:
    """The run's own lifecycle, from `engine.task_run` columns (and its parked step, if any)."""
    ev = [TimelineEvent(run.created_at, f"created {run.kind}@{run.version}", run.idempotency_key)]
    if run.available_at and run.created_at and run.available_at > run.created_at:
        ev.append(
            TimelineEvent(run.created_at, "scheduled", f"not before {run.available_at:%Y-%m-%d %H:%M:%S}")
        )
    if run.started_at:
        ev.append(TimelineEvent(run.started_at, "started", state="active"))
    if parked:
        until = parked.get("wait_until")
        ev.append(
            TimelineEvent(
                parked.get("wait_since") or run.started_at,
                f"waiting on {parked.get('wait_topic')}",
                f"step {parked.get('name')}" + (f", re-checks at {until:%H:%M:%S}" if until else ""),
                state="warn",
            )
        )
    if run.cancel_requested_at:
        ev.append(
            TimelineEvent(run.cancel_requested_at, "cancel requested", run.cancel_reason or "", state="warn")
        )
    if run.finished_at and run.status in ("succeeded", "failed", "canceled"):
        state: State = {"succeeded": "ok", "failed": "error", "canceled": "warn"}[run.status]  # type: ignore[assignment]
        detail = ""
        if run.status == "failed" and run.last_error:
            detail = f"{run.last_error.get('type', 'error')}: {run.last_error.get('message', '')}"
        elif run.status == "succeeded":
            detail = short_json(run.result)
        ev.append(TimelineEvent(run.finished_at, run.status, detail, state=state))
    return ev


def build_timeline(s: Session, run: RunInfo, parked: Mapping[str, Any] | None = None) -> list[TimelineEvent]:
    """Run lifecycle + the kind's business events (hook, else ledger), oldest first.

    A failing hook (a business table not migrated yet, a bug) must not take the operator's page
    down: its error becomes a timeline line and the ledger fallback is shown instead.
    """
    hook = hook_for(run.kind)
    business: list[TimelineEvent]
    try:
        with s.begin_nested():
            business = list(hook(s, run))
    except Exception as exc:  # the page must render whatever the hook does
        log.warning("timeline hook for %s failed: %s", run.kind, exc)
        business = [
            TimelineEvent(None, f"timeline hook for {run.kind} failed", str(exc)[:300], state="error")
        ]
        if hook is not ledger_timeline:
            business += ledger_timeline(s, run)
    events = run_events(run, parked) + business
    return sorted(events, key=lambda e: (e.at is None, e.at.timestamp() if e.at else 0.0))
