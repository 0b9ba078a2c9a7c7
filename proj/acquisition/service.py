"""Business operations on download tasks. Each writes its rows and its outbox event in the
caller's transaction; signals are sent after commit, as hints only."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import outbox
from proj.acquisition import torrents
from proj.acquisition.models import Approval, DownloadTask, LibraryItem, TaskEvent
from proj.engine.errors import BadInput, EngineError
from proj.engine.port import TaskEngine
from proj.engine.status import TERMINAL
from proj.engine.store.runs import find_by_keys
from proj.settings import get_settings


class UnknownTask(BadInput):
    """No download task with that id."""


class RequestConflict(EngineError):
    """The decision does not fit where the request stands (approve twice, approve after a
    reject or a cancel, reject after an approval). Nothing was written; the API answers 409."""


class KeyConflict(RequestConflict):
    """An `Idempotency-Key` already used by a request with another body."""


class RequestStatus(StrEnum):
    """Where a download task stands. The first seven move forward only (`advance_status`);
    `rejected`, `canceling` and `canceled` are outside that order and never overwritten by it."""

    REQUESTED = "requested"
    APPROVED = "approved"
    DOWNLOADING = "downloading"
    DOWNLOADED = "downloaded"
    IMPORTING = "importing"
    IMPORTED = "imported"
    NOTIFIED = "notified"
    REJECTED = "rejected"
    CANCELING = "canceling"
    CANCELED = "canceled"


# The order a task's status moves in; `rejected`/`canceling`/`canceled` are outside it.
STATUS_ORDER = tuple(RequestStatus)[:7]
CLOSED = (RequestStatus.REJECTED, RequestStatus.CANCELING, RequestStatus.CANCELED)


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
        .values(status=status, updated_at=func.now(), **values)
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
    client_key: str | None = None,
) -> uuid.UUID:
    """Record a request and queue its `acquire` run through the outbox (same transaction).

    The torrent is validated first: junk or a file name escaping the library root is refused
    before anything is written. `client_key` is the caller's `Idempotency-Key`, stored with a
    digest of the request (see `submit_request`).
    """
    meta = torrents.parse(torrent, max_bytes=get_settings().max_torrent_bytes)
    if not isinstance(requester, str) or not requester.strip() or len(requester) > 200:
        raise BadInput("requester must be 1..200 characters, not only spaces")
    if webhook_url is not None and (
        not isinstance(webhook_url, str) or not webhook_url.startswith(("http://", "https://"))
    ):
        raise BadInput("webhook_url must be an http(s) URL")
    if title is not None and (not isinstance(title, str) or len(title) > 500):
        raise BadInput("title must be text of at most 500 characters")
    if webhook_url is not None and len(webhook_url) > 2000:
        raise BadInput("webhook_url must be at most 2000 characters")
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
            client_key=client_key,
            client_digest=request_digest(requester, torrent, title, webhook_url) if client_key else None,
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


def approve(session: Session, task_id: uuid.UUID, approved_by: str) -> None:
    """Write the approval (the truth the `acquire` wait checks) and its timeline event.

    Raises `RequestConflict` when the request was already approved, rejected or canceled:
    a decision is taken once (`tests/integration/test_front_door.py::test_decisions_are_taken_once`).
    """
    check_actor(approved_by)
    task = load(session, task_id, lock=True)
    if task.status == RequestStatus.REJECTED:
        raise RequestConflict(f"request {task_id} was rejected: it cannot be approved")
    if task.cancel_requested_at is not None:
        raise RequestConflict(f"request {task_id} was canceled: it cannot be approved")
    done = session.execute(
        pg_insert(Approval)
        .values(download_task_id=task_id, approved_by=approved_by)
        .on_conflict_do_nothing()
        .returning(Approval.download_task_id)
    ).first()
    if done is None:
        by = session.scalar(select(Approval.approved_by).where(Approval.download_task_id == task_id))
        raise RequestConflict(f"request {task_id} is already approved (by {by})")
    advance_status(session, task_id, RequestStatus.APPROVED)
    event(session, task_id, "approved", by=approved_by)


def reject(session: Session, task_id: uuid.UUID, by: str, reason: str) -> None:
    """Close a request that was not approved: status `rejected`, the cancel flag set (so the
    run's cancel hook adds nothing), the decision on the timeline. The caller then stops the
    run (`reject_and_stop`); its compensation finds no torrent added and leaves qBittorrent be.
    """
    check_actor(by)
    reason = check_reason(reason)
    task = load(session, task_id, lock=True)
    if task.status != RequestStatus.REQUESTED or task.cancel_requested_at is not None:
        raise RequestConflict(f"request {task_id} is {task.status}: only a new request can be rejected")
    approved_by = session.scalar(select(Approval.approved_by).where(Approval.download_task_id == task_id))
    if approved_by is not None:
        raise RequestConflict(f"request {task_id} is already approved (by {approved_by})")
    task.status = RequestStatus.REJECTED
    task.cancel_requested_at = func.now()
    task.updated_at = func.now()
    event(session, task_id, "rejected", by=by, reason=reason)


def check_actor(who: str) -> str:
    if not isinstance(who, str) or not who.strip() or len(who) > 200 or not _storable(who):
        raise BadInput("who decided must be 1..200 characters of text")
    return who


def check_reason(reason: str) -> str:
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 500 or not _storable(reason):
        raise BadInput("a reason must be 1..500 characters of text")
    return reason.strip()


def request_digest(requester: str, torrent: bytes, title: str | None, webhook_url: str | None) -> str:
    """What an `Idempotency-Key` is bound to: the whole request, torrent bytes included."""
    h = hashlib.sha256(hashlib.sha256(torrent).digest())
    h.update(json.dumps([requester, title, webhook_url]).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Submitted:
    id: uuid.UUID
    replayed: bool  # True: an earlier call with the same key and body created it


def submit_request(
    session_factory: Any,
    *,
    requester: str,
    torrent: bytes,
    title: str | None = None,
    webhook_url: str | None = None,
    client_key: str | None = None,
) -> Submitted:
    """The front door's request: `request_download` in its own transaction, idempotent per key.

    Same key and same body returns the request the first call made; same key and another body
    raises `KeyConflict`. Two concurrent first calls race on the unique index; the loser reads
    the winner's row (`tests/integration/test_front_door.py::test_idempotency_key`).
    """
    if client_key is not None and (not client_key or len(client_key) > 200 or not _storable(client_key)):
        raise BadInput("Idempotency-Key must be 1..200 characters")
    for attempt in range(2):
        if client_key is not None:
            with session_factory.begin() as s:
                found = _by_client_key(s, client_key, requester, torrent, title, webhook_url)
            if found is not None:
                return Submitted(found, replayed=True)
        try:
            with session_factory.begin() as s:
                task_id = request_download(
                    s,
                    requester=requester,
                    torrent=torrent,
                    title=title,
                    webhook_url=webhook_url,
                    client_key=client_key,
                )
            return Submitted(task_id, replayed=False)
        except IntegrityError:
            if client_key is None or attempt:
                raise
    raise AssertionError("unreachable")


def _by_client_key(
    s: Session, key: str, requester: str, torrent: bytes, title: str | None, webhook_url: str | None
) -> uuid.UUID | None:
    row = s.execute(
        select(DownloadTask.id, DownloadTask.client_digest).where(DownloadTask.client_key == key)
    ).first()
    if row is None:
        return None
    if row.client_digest != request_digest(requester, torrent, title, webhook_url):
        raise KeyConflict(f"Idempotency-Key {key!r} was used for request {row.id} with another body")
    return uuid.UUID(str(row.id))


def approval_topic(task_id: uuid.UUID | str) -> str:
    return f"approval:{task_id}"


def download_topic(infohash: str) -> str:
    return f"download:{infohash}"


def approve_and_signal(engine: TaskEngine, session_factory: Any, task_id: uuid.UUID, by: str) -> None:
    """Commit the approval, then wake the waiting run (a lost signal only costs the timeout)."""
    with session_factory.begin() as s:
        approve(s, task_id, by)
    engine.signal(approval_topic(task_id))


def reject_and_stop(
    engine: TaskEngine, session_factory: Any, task_id: uuid.UUID, by: str, reason: str
) -> int:
    """Reject a request, then stop its `acquire` run: it ends `canceled` with the reason."""
    with session_factory.begin() as s:
        reject(s, task_id, by, reason)
        run_ids = _open_runs(s, task_id)
    for run_id in run_ids:
        engine.cancel(run_id, f"rejected by {by}: {reason}")
    return len(run_ids)


def request_cancel(session: Session, task_id: uuid.UUID, by: str, reason: str | None = None) -> bool:
    """Flag the business row (once); True if this call flagged it. The timeline gets one event."""
    flagged = session.execute(
        update(DownloadTask)
        .where(DownloadTask.id == task_id, DownloadTask.cancel_requested_at.is_(None))
        .values(cancel_requested_at=func.now(), status=RequestStatus.CANCELING, updated_at=func.now())
        .returning(DownloadTask.id)
    ).first()
    if flagged is not None:
        detail = {"by": by} if reason is None else {"by": by, "reason": reason}
        event(session, task_id, "cancel requested", **detail)
    return flagged is not None


def mark_cancel_requested(session: Session, run_id: uuid.UUID, inp: Any) -> None:
    """Kind hook for `TaskEngine.cancel`: the business row learns first."""
    request_cancel(session, uuid.UUID(str(inp.download_task_id)), by=f"run {run_id}")


def cancel_download(
    engine: TaskEngine, session_factory: Any, task_id: uuid.UUID, reason: str, *, by: str | None = None
) -> int:
    """Cancel a request: flag the business row, then stop its acquire/import runs.

    Canceling a request that is already closed (rejected, canceled) raises `RequestConflict`;
    one that already finished (`notified`) has nothing left to stop and raises it too.
    `BadInput` for an empty or unstorable `by` or `reason`, before anything is written.
    """
    check_reason(reason)
    if by is not None:
        check_actor(by)
    with session_factory.begin() as s:
        task = load(s, task_id, lock=True)
        if task.status in CLOSED:
            raise RequestConflict(f"request {task_id} is already {task.status}")
        if task.status == RequestStatus.NOTIFIED:
            raise RequestConflict(f"request {task_id} has finished: nothing to cancel")
        if by is None:
            request_cancel(s, task_id, by=reason)
        else:
            request_cancel(s, task_id, by=by, reason=reason)
        run_ids = _open_runs(s, task_id)
    for run_id in run_ids:
        engine.cancel(run_id, reason)
    return len(run_ids)


def _open_runs(s: Session, task_id: uuid.UUID) -> list[uuid.UUID]:
    """The request's unfinished acquire/import runs (found by their idempotency keys)."""
    pairs = [("acquire", f"acquire:{task_id}"), ("import", f"import:{task_id}")]
    return [r.id for r in find_by_keys(s, pairs) if r.status not in TERMINAL]


# ------------------------------------------------------------------------------ reading


@dataclass(frozen=True)
class RequestRow:
    """One line of the Requests list (CLI, /admin, API)."""

    id: uuid.UUID
    title: str
    requester: str
    status: str
    progress: float | None
    total_size: int
    files: int
    created_at: datetime
    updated_at: datetime

    def progress_pct(self) -> float:
        """Download progress in %; a request past its download is 100 %."""
        done = (RequestStatus.DOWNLOADED, RequestStatus.IMPORTING, RequestStatus.IMPORTED)
        if self.status in (*done, RequestStatus.NOTIFIED):
            return 100.0
        return round(100.0 * (self.progress or 0.0), 1)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": str(self.id),
            "title": self.title,
            "requester": self.requester,
            "status": self.status,
            "progress": self.progress_pct(),
            "total_size": self.total_size,
            "files": self.files,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }


LIST_LIMIT = 200


def parse_status(status: str | None) -> RequestStatus | None:
    if not status:
        return None
    try:
        return RequestStatus(status)
    except ValueError:
        known = ", ".join(RequestStatus)
        raise BadInput(f"unknown status {status!r}: one of {known}") from None


def list_requests(
    session: Session, *, status: str | None = None, requester: str | None = None, limit: int = 100
) -> list[RequestRow]:
    """Newest first, optionally one status and/or one requester (index `status, created_at`)."""
    return requests_page(session, status=status, requester=requester, limit=limit)[0]


def requests_page(
    session: Session,
    *,
    status: str | None = None,
    requester: str | None = None,
    limit: int = 100,
    after: uuid.UUID | None = None,
) -> tuple[list[RequestRow], uuid.UUID | None]:
    """One page of `list_requests`, and the id to pass as `after` for the next (None: no more).

    `after` is the id of the last request of the previous page; the page goes on from it in the
    same order (keyset: a request added meanwhile neither shifts nor repeats a row). Why: a list
    capped at `LIST_LIMIT` with no way on left older requests out of reach
    (`tests/integration/test_front_door_review.py::test_the_requests_list_pages_on_to_the_oldest`).
    """
    wanted = parse_status(status)
    if requester and not _storable(requester):
        raise BadInput("requester must not contain NUL characters or unpaired surrogates")
    q = select(DownloadTask).order_by(DownloadTask.created_at.desc(), DownloadTask.id)
    if wanted is not None:
        q = q.where(DownloadTask.status == wanted)
    if requester:
        q = q.where(DownloadTask.requester == requester)
    if after is not None:
        mark = session.scalar(select(DownloadTask.created_at).where(DownloadTask.id == after))
        if mark is None:
            raise BadInput(f"no request {after} to page on from")
        q = q.where(
            or_(
                DownloadTask.created_at < mark,
                and_(DownloadTask.created_at == mark, DownloadTask.id > after),
            )
        )
    limit = max(1, min(limit, LIST_LIMIT))
    tasks = session.scalars(q.limit(limit + 1)).all()
    rows = [_row(t) for t in tasks[:limit]]
    return rows, (rows[-1].id if len(tasks) > limit else None)


def _row(t: DownloadTask) -> RequestRow:
    return RequestRow(
        id=t.id,
        title=t.title,
        requester=t.requester,
        status=t.status,
        progress=t.progress,
        total_size=t.total_size,
        files=len(t.files or []),
        created_at=t.created_at,
        updated_at=t.updated_at,
    )


def status_counts(session: Session) -> dict[str, int]:
    rows = session.execute(select(DownloadTask.status, func.count()).group_by(DownloadTask.status)).all()
    return {str(st): int(n) for st, n in rows}


@dataclass(frozen=True)
class RequestDetail:
    """A request with its files (and library copies), business timeline, approval and runs."""

    row: RequestRow
    infohash: str
    webhook_url: str | None
    approved_by: str | None
    files: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    runs: list[dict[str, Any]]

    @property
    def can_approve(self) -> bool:
        return self.row.status == RequestStatus.REQUESTED and self.approved_by is None

    @property
    def can_reject(self) -> bool:
        return self.can_approve

    @property
    def can_cancel(self) -> bool:
        return self.row.status not in (*CLOSED, RequestStatus.NOTIFIED)

    def as_json(self) -> dict[str, Any]:
        return {
            **self.row.as_json(),
            "infohash": self.infohash,
            "webhook_url": self.webhook_url,
            "approved_by": self.approved_by,
            "files": self.files,
            "timeline": self.timeline,
            "runs": self.runs,
        }


def request_detail(session: Session, task_id: uuid.UUID) -> RequestDetail:
    """Raises `UnknownTask`. The timeline is `acq.task_event` (invariant 11), never attempts."""
    task = load(session, task_id)
    copies = {
        li.rel_path: li
        for li in session.scalars(select(LibraryItem).where(LibraryItem.download_task_id == task_id))
    }
    meta = torrents.parse(task.torrent)
    files = []
    for f in task.files or []:
        li = copies.get(_library_rel(meta, f["rel_path"]))
        files.append(
            {
                "path": f["rel_path"],
                "size": f["size"],
                "library": None
                if li is None
                else {"root": li.root, "rel_path": li.rel_path, "sha256": li.sha256, "status": li.status},
            }
        )
    events = session.scalars(
        select(TaskEvent).where(TaskEvent.download_task_id == task_id).order_by(TaskEvent.id)
    ).all()
    timeline = [{"at": e.at.isoformat(), "what": e.what, "detail": e.detail or {}} for e in events]
    approved_by = session.scalar(select(Approval.approved_by).where(Approval.download_task_id == task_id))
    pairs = [(k, f"{k}:{task_id}") for k in ("acquire", "import", "notify", "retire_seed")]
    runs = [
        {"id": str(r.id), "kind": r.kind, "version": r.version, "status": str(r.status)}
        for r in find_by_keys(session, pairs)
    ]
    return RequestDetail(
        row=_row(task),
        infohash=task.infohash,
        webhook_url=task.webhook_url,
        approved_by=approved_by,
        files=files,
        timeline=timeline,
        runs=runs,
    )


def _library_rel(meta: torrents.TorrentMeta, rel_path: str) -> str:
    for f in meta.files:
        if f.rel_path == rel_path:
            return torrents.library_rel(meta, f)
    return rel_path
