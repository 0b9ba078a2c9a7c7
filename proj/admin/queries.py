"""Read models for the admin pages: the engine's read models (`proj.engine.store.views`), shaped
for the pages, and plain SQL over the outbox (not engine state), if present.

Kept apart from the routes so the CLI (`proj outbox`, `proj show`) reads the same numbers.
Tables owned by other packages (`outbox.outbox_event`, `ledger.asset_operation`) are probed with
`to_regclass` first: the admin must render on a database where they are not migrated yet.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.admin.timeline import RunInfo, TimelineEvent, build_timeline, has_hook
from proj.engine.models import RUN_STATUSES
from proj.engine.status import ACTIVE, RunStatus
from proj.engine.store import views
from proj.engine.store.children import Family, family
from proj.engine.store.views import FailedStep, ParkedRun, ParkedTopic, Run, RunListRow

PAGE = 50
INT4_MAX = 2**31 - 1


def table_exists(s: Session, qualified: str) -> bool:
    return bool(s.scalar(text("SELECT to_regclass(:t) IS NOT NULL"), {"t": qualified}))


def parse_uuid(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value.strip())
    except (ValueError, AttributeError):
        return None


# ------------------------------------------------------------------------------------- runs


@dataclass
class RunFilter:
    """The runs list's filters; empty strings mean "any"."""

    kind: str = ""
    version: str = ""
    status: str = ""
    q: str = ""
    page: int = 0


def list_runs(s: Session, f: RunFilter, limit: int = PAGE) -> tuple[list[RunListRow], bool]:
    """Newest first; `q` matches a run id (or its prefix) or part of the idempotency key.

    Filters Postgres could not take as such match nothing instead of failing the page: a NUL
    in a text filter, a version past `integer`, a page past `bigint`'s offset."""
    if "\x00" in f.kind or "\x00" in f.q:
        return [], False
    version = int(f.version) if f.version.strip().isdigit() else None
    if version is not None and version > INT4_MAX:
        return [], False
    page = max(0, f.page)
    if page * limit > INT4_MAX:
        return [], False
    rows = views.list_runs(
        s,
        kind=f.kind or None,
        version=version,
        status=RunStatus(f.status) if f.status in RUN_STATUSES else None,
        search=f.q,
        limit=limit + 1,
        offset=page * limit,
    )
    return rows[:limit], len(rows) > limit


def facets(s: Session) -> dict[str, list[Any]]:
    """Values present in the table, for the filter drop-downs."""
    return {"kinds": views.run_kinds(s), "versions": views.run_versions(s), "statuses": list(RUN_STATUSES)}


def status_counts(s: Session) -> dict[str, int]:
    return {r.status: r.n for r in views.status_counts(s)}


@dataclass
class RunDetail:
    """Everything `/admin/runs/{id}` shows."""

    run: Run
    info: RunInfo
    stages: list[dict[str, Any]]
    timeline: list[TimelineEvent]
    parked: dict[str, Any] | None
    progress: list[dict[str, Any]] = field(default_factory=list)
    has_hook: bool = False
    pending_reason: str | None = None
    family: Family | None = None


def progress_of(s: Session, run_id: uuid.UUID) -> list[dict[str, Any]]:
    """Live progress of the run's running steps (`engine.step.progress`: done/total/message)."""
    out = []
    for r in views.running_progress(s, run_id):
        p = r.progress or {}
        done, total = p.get("done"), p.get("total")
        pct = None
        if isinstance(done, int | float) and isinstance(total, int | float) and total > 0:
            pct = max(0.0, min(100.0, 100.0 * done / total))
        out.append(
            {
                "step": r.name,
                "item": r.item_index,
                "done": done,
                "total": total,
                "pct": None if pct is None else round(pct, 1),
                "message": p.get("message"),
            }
        )
    return out


def stages_of(s: Session, run_id: uuid.UUID) -> list[dict[str, Any]]:
    """Per stage: the step name and how many of its items are in each state (from `engine.step`)."""
    stages: dict[tuple[int, str], dict[str, Any]] = {}
    for r in views.stage_counts(s, run_id):
        st = stages.setdefault(
            (r.stage, r.name), {"stage": r.stage, "name": r.name, "counts": {}, "attempts": 0}
        )
        st["counts"][r.status] = r.n
        st["attempts"] = max(st["attempts"], r.attempts or 0)
        st["max_attempts"] = r.max_attempts
        st["outages"] = max(st.get("outages", 0), r.outages or 0)
    return list(stages.values())


def parked_step(s: Session, run_id: uuid.UUID) -> dict[str, Any] | None:
    row = views.parked_step(s, run_id)
    return row._asdict() if row else None


def load_run(s: Session, run_id: uuid.UUID) -> Run | None:
    return views.run(s, run_id)


def run_detail(s: Session, run_id: uuid.UUID) -> RunDetail | None:
    run = load_run(s, run_id)
    if run is None:
        return None
    info = RunInfo.from_row(run)
    parked = parked_step(s, run_id) if run.status == "waiting" else None
    return RunDetail(
        run=run,
        info=info,
        stages=stages_of(s, run_id),
        timeline=build_timeline(s, info, parked),
        parked=parked,
        progress=progress_of(s, run_id),
        has_hook=has_hook(info.kind),
        pending_reason=_pending_reason(run),
        family=family(s, run_id),
    )


def _pending_reason(run: Run) -> str | None:
    """Why a live run is not moving (a concurrency limit, a future start, no worker for its
    version): the engine's own projection, so the CLI, `get` and this page agree."""
    if run.status not in ("pending", "running"):
        return None
    from proj.engine import runs

    view = runs.get(run.id)
    return view.pending_reason if view else None


def progress_json(s: Session, run_id: uuid.UUID) -> dict[str, Any] | None:
    """What the run page polls: status, current step and live progress."""
    row = views.run_progress(s, run_id)
    if row is None:
        return None
    return {
        "status": row.status,
        "current_step": row.current_step,
        "updated_at": row.updated_at.isoformat(),
        "terminal": row.status not in ACTIVE,
        "progress": progress_of(s, run_id),
    }


# ------------------------------------------------------------------------------ dead letters


@dataclass
class DeadLetter:
    """A failed run with what an operator needs to decide: error, failed step, business context."""

    run: Run
    failed_steps: list[FailedStep]
    context: list[TimelineEvent]


def dead_letters(s: Session, limit: int = PAGE) -> list[DeadLetter]:
    out = []
    for run in views.dead_letters(s, limit):
        failed = views.failed_steps(s, run.id)
        info = RunInfo.from_row(run)
        # Business context = the business part of the timeline (the hook's or the ledger's).
        events = [e for e in build_timeline(s, info) if e.source != "run"]
        out.append(DeadLetter(run=run, failed_steps=failed, context=events[-6:]))
    return out


# ---------------------------------------------------------------------------------- versions


def version_matrix(s: Session) -> list[dict[str, Any]]:
    """Runs per kind@version × status; a non-current version with live runs is *draining*."""
    from proj.engine.kind import all_kinds

    newest: dict[str, int] = {}
    for k in all_kinds():
        newest[k.name] = max(newest.get(k.name, 0), k.version)
    table: dict[tuple[str, int], dict[str, Any]] = {}
    for r in views.version_matrix(s):
        e = table.setdefault(
            (r.kind, r.version),
            {"kind": r.kind, "version": r.version, "counts": {}, "active": 0, "oldest_active": None},
        )
        e["counts"][r.status] = r.n
        if r.status in ACTIVE:
            e["active"] += r.n
            if r.oldest_active and (e["oldest_active"] is None or r.oldest_active < e["oldest_active"]):
                e["oldest_active"] = r.oldest_active
    for (kind, version), e in table.items():
        current = newest.get(kind)
        e["current"] = current
        if current is None:
            e["state"] = "unknown" if e["active"] else "retired"
        elif version < current:
            e["state"] = "draining" if e["active"] else "drained"
        else:
            e["state"] = "current"
    return list(table.values())


# ------------------------------------------------------------------------------------ parked


def parked_runs(s: Session, limit: int = 200) -> tuple[list[ParkedRun], list[ParkedTopic]]:
    """Waiting steps with their topic and timer, and per topic: how many wait, last signal."""
    return views.parked_runs(s, limit), views.parked_topics(s)


# ------------------------------------------------------------------------------------ outbox

OUTBOX = "outbox.outbox_event"


@dataclass
class OutboxSummary:
    """Backlog of the transactional outbox; `present=False` when its table does not exist."""

    present: bool
    counts: dict[str, int] = field(default_factory=dict)
    oldest_pending: Any = None
    pending: list[Any] = field(default_factory=list)
    dead: list[Any] = field(default_factory=list)


OUTBOX_COUNTS = text("SELECT status, count(*) FROM outbox.outbox_event GROUP BY status")
OUTBOX_PENDING = text(
    """
    SELECT id, kind, idempotency_key, payload, status, attempts, next_attempt_at, last_error,
           now() - next_attempt_at AS overdue
      FROM outbox.outbox_event
     WHERE status = 'pending'
     ORDER BY id
     LIMIT :limit
    """
)
OUTBOX_DEAD = text(
    """
    SELECT id, kind, idempotency_key, payload, status, attempts, next_attempt_at, last_error
      FROM outbox.outbox_event
     WHERE status = 'dead'
     ORDER BY id DESC
     LIMIT :limit
    """
)


def outbox_summary(s: Session, limit: int = PAGE) -> OutboxSummary:
    if not table_exists(s, OUTBOX):
        return OutboxSummary(present=False)
    counts = {r[0]: int(r[1]) for r in s.execute(OUTBOX_COUNTS).all()}
    pending = s.execute(OUTBOX_PENDING, {"limit": limit}).all()
    dead = s.execute(OUTBOX_DEAD, {"limit": limit}).all()
    return OutboxSummary(
        present=True,
        counts=counts,
        oldest_pending=pending[0] if pending else None,
        pending=list(pending),
        dead=list(dead),
    )
