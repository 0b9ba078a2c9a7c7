"""Business operations on download tasks. Each writes its rows and its outbox event in the
caller's transaction; signals are sent after commit, as hints only."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

import outbox
from proj.acquisition import torrents
from proj.acquisition.models import Approval, DownloadTask, TaskEvent
from proj.engine.errors import BadInput
from proj.engine.port import TaskEngine


class UnknownTask(BadInput):
    """No download task with that id."""


# The order a task's status moves in; `canceling`/`canceled` are outside it (never overwritten).
STATUS_ORDER = ("requested", "approved", "downloading", "downloaded", "importing", "imported", "notified")


def advance_status(session: Session, task_id: uuid.UUID, status: str, **values: Any) -> bool:
    """Move the task's status forward, never back; True if it moved.

    A step whose fenced write committed but whose own commit did not (killed worker, lost lease,
    dropped connection) runs again; by then the run it handed off to may have moved the task on
    (`notified`). Its retry must not undo that, nor overwrite a cancel (`canceling`).
    """
    earlier = STATUS_ORDER[: STATUS_ORDER.index(status)]
    moved = session.execute(
        update(DownloadTask)
        .where(DownloadTask.id == task_id, DownloadTask.status.in_(earlier))
        .values(status=status, **values)
    )
    return bool(moved.rowcount)


def event(session: Session, task_id: uuid.UUID, what: str, **detail: Any) -> None:
    """Append to the business timeline (what /admin shows instead of raw step attempts)."""
    session.add(TaskEvent(download_task_id=task_id, what=what, detail=detail or None))


def load(session: Session, task_id: uuid.UUID | str, *, lock: bool = False) -> DownloadTask:
    q = select(DownloadTask).where(DownloadTask.id == uuid.UUID(str(task_id)))
    task = session.scalar(q.with_for_update() if lock else q)
    if task is None:
        raise UnknownTask(f"no download task {task_id}")
    return task


def request_download(
    session: Session,
    *,
    requester: str,
    torrent: bytes,
    title: str | None = None,
    webhook_url: str | None = None,
    task_id: uuid.UUID | None = None,
) -> uuid.UUID:
    """Record a request and queue its `acquire` run through the outbox (same transaction).

    The torrent is validated first: junk or a file name escaping the library root is refused
    before anything is written.
    """
    meta = torrents.parse(torrent)
    if not isinstance(requester, str) or not requester or len(requester) > 200:
        raise BadInput("requester must be 1..200 characters")
    if webhook_url is not None and (
        not isinstance(webhook_url, str) or not webhook_url.startswith(("http://", "https://"))
    ):
        raise BadInput("webhook_url must be an http(s) URL")
    if title is not None and not isinstance(title, str):
        raise BadInput("title must be text")
    for what, value in (("requester", requester), ("title", title), ("webhook_url", webhook_url)):
        if value is not None and not _storable(value):
            raise BadInput(f"{what} must not contain NUL characters or unpaired surrogates")
    task_id = task_id or uuid.uuid4()
    session.add(
        DownloadTask(
            id=task_id,
            requester=requester,
            title=title or meta.name,
            infohash=meta.infohash,
            torrent=bytes(torrent),
            files=[{"rel_path": f.rel_path, "size": f.size} for f in meta.files],
            total_size=meta.total_size,
            webhook_url=webhook_url,
        )
    )
    session.flush()
    event(session, task_id, "requested", requester=requester, infohash=meta.infohash)
    outbox.add(session, "acquire", f"acquire:{task_id}", {"download_task_id": str(task_id)})
    return task_id


def _storable(text: str) -> bool:
    """Postgres text holds neither a NUL nor an unpaired surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def approve(session: Session, task_id: uuid.UUID, approved_by: str) -> bool:
    """Write the approval (the truth the `acquire` wait checks). True if newly approved."""
    task = load(session, task_id, lock=True)
    if task.cancel_requested_at is not None:
        raise BadInput(f"download task {task_id} was canceled")
    done = session.execute(
        pg_insert(Approval)
        .values(download_task_id=task_id, approved_by=approved_by)
        .on_conflict_do_nothing()
        .returning(Approval.download_task_id)
    ).first()
    if done is not None:
        task.status = "approved"
        event(session, task_id, "approved", by=approved_by)
    return done is not None


def approval_topic(task_id: uuid.UUID | str) -> str:
    return f"approval:{task_id}"


def download_topic(infohash: str) -> str:
    return f"download:{infohash}"


def approve_and_signal(engine: TaskEngine, session_factory: Any, task_id: uuid.UUID, by: str) -> None:
    """Commit the approval, then wake the waiting run (a lost signal only costs the timeout)."""
    with session_factory.begin() as s:
        approve(s, task_id, by)
    engine.signal(approval_topic(task_id))


def request_cancel(session: Session, task_id: uuid.UUID, by: str) -> bool:
    """Flag the business row (once); True if this call flagged it. The timeline gets one event."""
    flagged = session.execute(
        update(DownloadTask)
        .where(DownloadTask.id == task_id, DownloadTask.cancel_requested_at.is_(None))
        .values(cancel_requested_at=func.now(), status="canceling")
        .returning(DownloadTask.id)
    ).first()
    if flagged is not None:
        event(session, task_id, "cancel requested", by=by)
    return flagged is not None


def mark_cancel_requested(session: Session, run_id: uuid.UUID, inp: Any) -> None:
    """Kind hook for `TaskEngine.cancel`: the business row learns first."""
    request_cancel(session, uuid.UUID(str(inp.download_task_id)), by=f"run {run_id}")


def cancel_download(engine: TaskEngine, session_factory: Any, task_id: uuid.UUID, reason: str) -> int:
    """Cancel a request: flag the business row, then stop its acquire/import runs."""
    with session_factory.begin() as s:
        load(s, task_id, lock=True)
        request_cancel(s, task_id, by=reason)
        run_ids = s.scalars(
            text(
                "SELECT id FROM engine.task_run WHERE idempotency_key = ANY(:keys) "
                "AND status NOT IN ('succeeded', 'failed', 'canceled')"
            ),
            {"keys": [f"acquire:{task_id}", f"import:{task_id}"]},
        ).all()
    for run_id in run_ids:
        engine.cancel(run_id, reason)
    return len(run_ids)
