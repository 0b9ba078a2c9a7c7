"""Helpers shared by the acquisition kinds: inputs, loading the task, the cancel guard."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import select, text
from sqlalchemy.orm import Session

import ledger
from proj import db
from proj.acquisition import qbt, service, torrents
from proj.acquisition.models import DownloadTask, LibraryItem, TaskEvent
from proj.engine.context import StepContext
from proj.engine.effects import Attempt
from proj.engine.errors import CancelRequested, Unavailable
from proj.settings import get_settings

UNREACHABLE = "qBittorrent unreachable"
R = TypeVar("R")


class TaskInput(BaseModel):
    """Most kinds act on one download task."""

    download_task_id: uuid.UUID


def load_task(ctx: StepContext) -> DownloadTask:
    """Read the business row; a cancel written on it stops the run before any effect."""
    with db.transaction() as s:
        task = service.load(s, ctx.input.download_task_id)
    if task.cancel_requested_at is not None:
        raise CancelRequested(f"download task {task.id} was canceled")
    return task


def library_root() -> Path:
    return Path(get_settings().library_root)


def download_dir() -> Path:
    return Path(get_settings().download_dir)


def inside(root: Path, path: Path) -> Path:
    """Resolve `path` and insist it stays under `root` (belt and braces after parsing)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ValueError(f"{path} escapes {root}")
    return resolved


library_rel = torrents.library_rel


def library_path(task_id: uuid.UUID, rel: str, root: Path | None = None) -> Path:
    """Where a file lands: `<root>/<task id>/<rel>`, never outside `root`."""
    root = root or library_root()
    return inside(root, root / str(task_id) / rel)


def recorded_root(task_id: uuid.UUID, rel: str) -> Path:
    """The root a task's library file lies in: its row's (it may have been relocated), else the
    library root (a file not recorded yet lands there).

    Why: a re-import after corruption copied every file into the library root and pointed every
    row there, undoing relocations and leaving the relocated (rotten) copy referenced by nothing
    (`tests/integration/test_library_review.py::test_a_reimport_repairs_a_relocated_file_where_it_lies`).
    """
    with db.transaction() as s:
        root = s.scalar(
            text(
                """
                SELECT root FROM acq.library_item
                 WHERE download_task_id = :task_id AND rel_path = :rel
                """
            ),
            {"task_id": task_id, "rel": rel},
        )
    return Path(root) if root is not None else library_root()


def torrent_library_paths(
    task_id: uuid.UUID, meta: torrents.TorrentMeta, root: Path | None = None
) -> set[Path]:
    """Where every file of the torrent lands (under `root`, by default the library root): none
    of them is ever a temp file to remove."""
    return {library_path(task_id, library_rel(meta, f), root) for f in meta.files}


def torrent_add(task_id: uuid.UUID) -> dict[str, Any] | None:
    """The task's add as the ledger knows it (`acquire.add_torrent`'s op key): None when it was
    never attempted, else its stored result (empty while it has none). `{"adopted": true}`: the
    torrent was already in qBittorrent, so the task did not add it and must not remove it."""
    with db.transaction() as s:
        op = ledger.get_operation(s, f"qbt-add:{task_id}")
        if op is None:
            return None
        return op.result if isinstance(op.result, dict) else {}


# ------------------------------------------------------------------ a torrent shared by requests

# Every decision about one infohash in qBittorrent (find-and-add, decide-and-remove) is taken
# under this lock, held by the transaction open around it (`torrent_decision`).
# Its transaction may sit idle for `qbt.QBT_LOCK_IDLE_MS` (a frozen holder gives the lock up).
LOCK_TORRENT = text(
    "SELECT pg_advisory_xact_lock(hashtextextended('torrent:' || :infohash, 0)),"
    " set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)"
)

# The other requests holding the torrent: their add was attempted (the ledger op exists; its row
# commits before its effect runs), they are not closed (rejected, canceling, canceled), and they
# have not let it go (their compensation's remove or their seeding goal's retire was attempted).
OTHER_HOLDERS = text(
    """
    SELECT t.id FROM acq.download_task t
     WHERE t.infohash = :infohash
       AND t.id <> :task_id
       AND t.status <> ALL (CAST(:closed AS text[]))
       AND EXISTS (SELECT 1 FROM ledger.asset_operation a WHERE a.op_key = 'qbt-add:' || t.id::text)
       AND NOT EXISTS (
            SELECT 1 FROM ledger.asset_operation r
             WHERE r.op_key IN ('qbt-remove:' || t.id::text, 'qbt-retire:' || t.id::text))
     ORDER BY t.created_at, t.id
    """
)


@contextmanager
def torrent_decision(infohash: str) -> Iterator[Session]:
    """A transaction holding the infohash's advisory lock, open around qBittorrent calls.

    Why: two requests may carry the same infohash and share one torrent. Without the lock, one
    request's add could find the torrent just before another's cancel deletes it (with its data),
    or a cancel could miss a holder whose add is under way. With it, an add either finds the
    torrent that stays, or waits and adds it afresh after the delete
    (`tests/integration/test_shared_torrent.py`).
    """
    with db.transaction() as s:
        s.execute(LOCK_TORRENT, {"infohash": infohash, "idle_ms": qbt.QBT_LOCK_IDLE_MS})
        yield s


def other_holders(s: Session, task_id: uuid.UUID, infohash: str) -> list[uuid.UUID]:
    """The other requests that still hold this infohash's torrent (`OTHER_HOLDERS`), oldest first.

    Why: a torrent two requests share must stay while either still downloads, imports or seeds
    it; only the last to let go removes it. Read under `torrent_decision`'s lock: a holder's
    ledger row commits before its add takes the lock, and a releaser's before its remove does,
    so of two releasing at once the later always sees the other gone
    (`tests/integration/test_shared_torrent.py`).
    """
    closed = [str(c) for c in service.CLOSED]
    rows = s.execute(OTHER_HOLDERS, {"infohash": infohash, "task_id": task_id, "closed": closed})
    return [uuid.UUID(str(r.id)) for r in rows]


def release_torrent(task_id: uuid.UUID, infohash: str, *, delete_files: bool) -> str | None:
    """Remove the task's torrent from qBittorrent (its download data too with `delete_files`),
    unless it is not ours (no managed tag) or another request still holds it; returns why it was
    kept, or None once it is gone.

    Why: the cancel of one request (`compensate.remove_torrent`, which deletes the data) or its
    seeding goal (`retire_seed.retire`) must not remove a torrent another request still uses
    (`tests/integration/test_shared_torrent.py`). The delete waits until qBittorrent no longer
    lists it, still under the lock: an add after it finds nothing and adds afresh.
    """
    with torrent_decision(infohash) as s:
        t = qbt.find(infohash)
        if t is not None and not qbt.is_managed(t):  # never a torrent without our tag
            return f"not tagged {qbt.MANAGED_TAG}"
        holders = other_holders(s, task_id, infohash)
        if holders:
            return f"held by request {holders[0]}"
        if t is not None:
            if delete_files:
                qbt.client().torrents_pause(torrent_hashes=infohash)
            qbt.client().torrents_delete(delete_files=delete_files, torrent_hashes=infohash)
            qbt.wait_unlisted(infohash)
    return None


def note_unreachable(task_id: uuid.UUID, exc: BaseException) -> None:
    """qBittorrent did not answer: the request's timeline says why it does not move, once per
    outage (the step retries, or its wait parks again).

    Why: a re-check that raised spent the network retry policy (1 s … 8 s) in ~15 s, so a
    qBittorrent restarting or down for maintenance turned every downloading request into a dead
    letter (`tests/integration/test_qbt_review.py::
    test_a_download_survives_qbittorrent_being_down_while_its_wait_rechecks`).
    """
    note_outage(task_id, UNREACHABLE, exc)


def note_outage(task_id: uuid.UUID, what: str, exc: BaseException) -> None:
    """Put `what` on the request's timeline, with the error, unless it is its latest event
    already: once per outage, however many attempts wait it out."""
    with db.transaction() as s:
        last = s.scalar(
            select(TaskEvent.what)
            .where(TaskEvent.download_task_id == task_id)
            .order_by(TaskEvent.id.desc())
            .limit(1)
        )
        if last != what:
            service.event(s, task_id, what, error=str(exc)[:300])


def while_qbittorrent_down(body: Callable[[StepContext], R]) -> Callable[[StepContext], R]:
    """A step body that changes qBittorrent, for which qBittorrent not answering is an outage
    (`qbt.Down`, an `Unavailable`): the step retries without spending its attempts, for up to
    `qbt.QBT_RETRY.outage_s`, and the request's timeline says qBittorrent is unreachable.

    Why: its ten attempts (about 8 min) ended in a dead letter when qBittorrent was down longer,
    a NAS rebooting for an update or a container re-pulled over a slow link
    (`tests/integration/test_qbt_review.py::test_a_request_approved_while_qbittorrent_is_down_is_added_once_it_is_back`).
    """

    @functools.wraps(body)
    def run(ctx: StepContext) -> R:
        try:
            return body(ctx)
        except Exception as exc:
            if not qbt.unreachable(exc):
                raise
            note_unreachable(ctx.input.download_task_id, exc)
            raise qbt.Down(f"qBittorrent at {get_settings().qbt_url} did not answer: {exc}") from exc

    return run


LIBRARY_UNAVAILABLE = "library disk not mounted"


class LibraryUnavailable(Unavailable):
    """The library root is not there: its disk is unmounted (or not yet mounted)."""


def library_mounted(task_id: uuid.UUID, root: Path) -> None:
    """`require_mounted`, and the request's timeline says so once per outage."""
    try:
        require_mounted(root)
    except LibraryUnavailable as exc:
        note_outage(task_id, LIBRARY_UNAVAILABLE, exc)
        raise


def require_mounted(root: Path) -> None:
    """Raise `LibraryUnavailable` unless `root` is there: a directory, and not empty when the
    library has files recorded under it (the bare mount point of a disk that dropped).

    Why: with the library's disk unmounted, an import created `LIBRARY_ROOT` again (`mkdir -p`)
    on the system disk under the bare mount point, filled it, and recorded files that vanished
    when the disk came back; or it failed its three attempts and left a dead letter. Now the
    import waits the outage out, spending no attempt, for up to a day (`RetryPolicy.outage_s`)
    and never writes outside a root that is there
    (`tests/faults/test_faults_disk.py::test_an_import_waits_for_its_library_disk_and_writes_nothing_meanwhile`).
    """
    try:
        present = root.is_dir()
        empty = present and not any(root.iterdir())
    except OSError as exc:
        raise LibraryUnavailable(f"library root {root} cannot be read ({exc}): is its disk mounted?") from exc
    if not present:
        raise LibraryUnavailable(f"library root {root} does not exist: is its disk mounted?")
    if empty:
        with db.transaction() as s:
            recorded = s.scalar(select(LibraryItem.id).where(LibraryItem.root == str(root)).limit(1))
        if recorded is not None:
            raise LibraryUnavailable(
                f"library root {root} is empty but the library has files recorded there: is its disk mounted?"
            )


def copy_checkpoint(ctx: StepContext, att: Attempt) -> Callable[[], None]:
    """What a chunked copy (`library.copy_file`) calls between chunks: it stops the copy on a
    cancel, a lost lease or a superseded ledger attempt, so a cancel or a second worker never
    waits for a whole large file. `FAULT_CHUNK_DELAY_S` slows each chunk (fault injection: a copy
    slow enough to cancel or to kill mid-way)."""
    delay = get_settings().fault_chunk_delay_s

    def checkpoint() -> None:
        if delay:
            time.sleep(delay)
        ctx.checkpoint()
        att.check()

    return checkpoint
