"""/admin timeline hooks of the acquisition kinds: the download task's story from `acq.*`.

Invariant 11: a run's timeline reads the business tables, never raw step attempts. Each hook
finds the run's download task (`input.download_task_id`; for `compensate` the compensated run's
input; for `relocate` the library item's task), then shows its `acq.task_event` rows, the flags
raised about it, its current status, and the run's own side effects from the operation ledger.

Imported by `proj.kinds` (so workers, the admin and the CLI all register the same hooks);
`proj.admin.timeline` pulls no web framework in.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.admin.timeline import (
    RunInfo,
    State,
    TimelineEvent,
    TimelineHook,
    ledger_timeline,
    register_timeline,
    short_json,
)

SOURCE = "acq"

# How an event reads at a glance; anything else is "info".
_STATES: dict[str, State] = {
    "approved": "ok",
    "downloaded": "ok",
    "verified": "ok",
    "imported": "ok",
    "re-imported": "ok",
    "requester notified": "ok",
    "seeding retired": "ok",
    "relocated": "ok",
    "torrent added": "active",
    "cancel requested": "warn",
    # an outage the request waits out (`proj.kinds.common.note_outage`): nothing is wrong with it
    "qBittorrent unreachable": "warn",
    "library disk not mounted": "warn",
    "webhook unreachable": "warn",
    "compensated": "warn",
    "corruption found": "error",
    # a copy read other bytes than `verify` checked (`proj.kinds.importing`)
    "download corrupt": "error",
    "download changed during its copy": "warn",
}


def _uuid(value: Any) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except (TypeError, ValueError):
        return None


# A task's business events, or with `:rel` only those about that file (and the request itself).
TASK_EVENTS = text(
    """
    SELECT what, detail, at FROM acq.task_event
     WHERE download_task_id = :id
       AND (CAST(:rel AS text) IS NULL OR detail->>'rel_path' = :rel OR what = 'requested')
     ORDER BY id
    """
)
# Flags naming the task (a missing torrent) or one of its library items (a corrupt file), or with
# `:rel` that file's item only.
TASK_FLAGS = text(
    """
    SELECT f.kind, f.subject, f.detail, f.at FROM acq.flag f
     WHERE f.subject = :tid
        OR f.subject IN (SELECT id::text FROM acq.library_item
                          WHERE download_task_id = :id AND (CAST(:rel AS text) IS NULL OR rel_path = :rel))
     ORDER BY f.id
    """
)


def _task_events(s: Session, task_id: uuid.UUID, rel_path: str | None = None) -> list[TimelineEvent]:
    """The task's business events (only those about `rel_path`, if given), flags and status."""
    task = s.execute(
        text("SELECT title, requester, status FROM acq.download_task WHERE id = :id"), {"id": task_id}
    ).first()
    if task is None:
        return [TimelineEvent(None, f"no download task {task_id}", source=SOURCE, state="warn")]
    rows = s.execute(TASK_EVENTS, {"id": task_id, "rel": rel_path}).all()
    events = [
        TimelineEvent(
            r.at,
            r.what,
            short_json(r.detail) if r.detail else "",
            source=SOURCE,
            state=_STATES.get(r.what, "info"),
            data={"download_task_id": str(task_id)},
        )
        for r in rows
    ]
    flags = s.execute(TASK_FLAGS, {"tid": str(task_id), "id": task_id, "rel": rel_path}).all()
    events += [
        TimelineEvent(f.at, f"flagged: {f.kind}", short_json(f.detail), source=SOURCE, state="error")
        for f in flags
    ]
    events.append(
        TimelineEvent(
            None,
            f"download task is {task.status}",
            f"{task.title!r} requested by {task.requester}",
            source=SOURCE,
            state="info",
            data={"download_task_id": str(task_id), "status": task.status},
        )
    )
    return events


Finder = Callable[[Session, RunInfo], tuple[uuid.UUID | None, str | None]]


def _hook(find: Finder) -> TimelineHook:
    """The task's events (as found by `find`) followed by the run's own ledger operations."""

    def hook(s: Session, run: RunInfo) -> Iterable[TimelineEvent]:
        task_id, rel_path = find(s, run)
        events = [] if task_id is None else _task_events(s, task_id, rel_path)
        return events + ledger_timeline(s, run)

    return hook


def _by_input(s: Session, run: RunInfo) -> tuple[uuid.UUID | None, str | None]:
    return _uuid(run.input.get("download_task_id")), None


def _by_compensated_input(s: Session, run: RunInfo) -> tuple[uuid.UUID | None, str | None]:
    inner = run.input.get("input") or {}
    return _uuid(inner.get("download_task_id") if isinstance(inner, dict) else None), None


def _by_library_item(s: Session, run: RunInfo) -> tuple[uuid.UUID | None, str | None]:
    row = s.execute(
        text("SELECT download_task_id, rel_path FROM acq.library_item WHERE id = :id"),
        {"id": run.input.get("library_item_id")},
    ).first()
    return (row.download_task_id, row.rel_path) if row is not None else (None, None)


for _kind in ("acquire", "import", "notify", "retire_seed"):
    register_timeline(_kind, _hook(_by_input))
register_timeline("compensate", _hook(_by_compensated_input))
register_timeline("relocate", _hook(_by_library_item))
