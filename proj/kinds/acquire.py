"""`acquire`: wait for approval → add the torrent (ledger) → wait for completion → queue import."""

from __future__ import annotations

import os
import socket
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

import outbox
from proj import db
from proj.acquisition import qbt, service
from proj.acquisition.models import Approval, DownloadTask, Flag, TaskEvent
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, Done, NotDone, effect
from proj.engine.errors import NonRetryable
from proj.engine.kind import Kind, register, step, wait_for
from proj.kinds.common import (
    TaskInput,
    download_dir,
    load_task,
    note_unreachable,
    torrent_add,
    torrent_decision,
    while_qbittorrent_down,
)
from proj.settings import get_settings


def approved(ctx: StepContext) -> dict[str, str] | None:
    """The approval row is the truth; the signal only makes us look sooner."""
    load_task(ctx)
    with db.transaction() as s:
        by = s.scalar(
            select(Approval.approved_by).where(Approval.download_task_id == ctx.input.download_task_id)
        )
    return {"approved_by": by} if by else None


def add_torrent(ctx: StepContext) -> dict[str, Any]:
    """Add once: the ledger op is keyed by the task; reconcile looks the infohash up."""
    task = load_task(ctx)
    infohash = task.infohash
    plan = {"infohash": infohash, "tag": qbt.MANAGED_TAG, "save_path": str(download_dir())}

    def do(att: Attempt) -> dict[str, Any]:
        att.check()
        # Under the infohash's lock: a torrent found here is not being removed by another
        # request's cancel or seeding goal (`common.release_torrent` waits for us, or we for it).
        with torrent_decision(infohash):
            found = qbt.find(infohash)
            if found is not None and not qbt.is_managed(found):
                # The operator's own (no managed tag): used, never removed by this request's
                # compensation or seeding goal. A tagged one is ours: an earlier attempt's add
                # that qBittorrent listed only after that attempt's reconcile looked, or another
                # request's for the same infohash, which we now share (`common.other_holders`:
                # the last holder to let go removes it).
                return {"infohash": infohash, "adopted": True}
            if found is not None:
                return {"infohash": infohash}
            add_tagged(task)
        return {"infohash": infohash}

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        found = qbt.find(infohash)
        return Done({"infohash": infohash, "reconciled": True}) if found else NotDone("not in qBittorrent")

    result = effect(ctx, f"qbt-add:{task.id}", plan, do, reconcile, effect_kind="qbittorrent")
    introduce_peers(infohash)
    with ctx.finish(result) as s:
        if service.advance_status(s, task.id, "downloading"):  # not again on a retry
            service.event(s, task.id, "torrent added", infohash=infohash)
    return result


def add_tagged(task: DownloadTask) -> None:
    """Hand the torrent to qBittorrent with our tag, into DOWNLOAD_DIR; wait until it is listed.
    The caller holds the infohash's lock (`torrent_decision`) and found it absent."""
    qbt.client().torrents_add(
        torrent_files={f"{task.infohash}.torrent": task.torrent},
        save_path=str(download_dir()),
        tags=qbt.MANAGED_TAG,
        use_auto_torrent_management=False,
    )
    qbt.wait_listed(task.infohash)


def introduce_peers(infohash: str) -> None:
    """Loopback swarms (tests, demo) have no DHT: tell qBittorrent where the seeders are.

    `QBT_PEERS` may name hosts (`seeder:6881`, a container on the compose network): qBittorrent
    takes addresses only, so names are resolved here.
    """
    peers = [resolve_peer(p.strip()) for p in get_settings().qbt_peers.split(",") if p.strip()]
    if peers:
        qbt.client().torrents_add_peers(peers=peers, torrent_hashes=infohash)


def resolve_peer(peer: str) -> str:
    host, sep, port = peer.rpartition(":")
    if not sep or not host or host.replace(".", "").isdigit() or host.startswith("["):
        return peer
    try:
        return f"{socket.gethostbyname(host)}:{port}"
    except OSError:
        return peer  # qBittorrent says what it makes of it


def downloaded(ctx: StepContext) -> dict[str, Any] | None:
    """qBittorrent is the truth about the download; the on-finish hook only wakes us. When it
    does not answer, the wait parks again (`note_unreachable`)."""
    task = load_task(ctx)
    try:
        return look_at_download(ctx, task)
    except Exception as exc:
        if not qbt.unreachable(exc):
            raise
        note_unreachable(task.id, exc)
        return None


def look_at_download(ctx: StepContext, task: DownloadTask) -> dict[str, Any] | None:
    """Record the progress; the download's place once complete, else nudge it (resume, peers)."""
    t = qbt.find(task.infohash)
    if t is None:
        return missing(ctx, task)
    with db.transaction() as s:
        s.execute(update(DownloadTask).where(DownloadTask.id == task.id).values(progress=float(t.progress)))
    ctx.report_progress(float(t.progress) * task.total_size, task.total_size, "downloading")
    if not in_download_dir(task, t):
        return None
    if t.state in STUCK_STATES:
        unstick(task, t)
        return None
    if not qbt.is_complete(t):
        if t.state in ("pausedDL", "stoppedDL") and qbt.is_managed(t):
            # Only ours: the operator's own (adopted) torrent was paused by them, and stays so
            # (`test_qbt_review.py::test_the_download_wait_leaves_the_operators_own_paused_torrent_paused`).
            qbt.client().torrents_resume(torrent_hashes=task.infohash)
        introduce_peers(task.infohash)
        return None
    return {"infohash": task.infohash, "save_path": t.save_path}


MISSING = "torrent missing from qBittorrent"
READDED = "torrent added again"


def missing(ctx: StepContext, task: DownloadTask) -> None:
    """The torrent is no longer in qBittorrent (deleted in its UI, its profile lost).

    The first look flags the request (`missing_torrent`) and fails the run at once, saying what
    to do: the operator meant to stop it (then cancel the request) or not. A look after that
    failure is an operator's retry: the torrent is added again, through the ledger (one op per
    disappearance), and the wait goes on. An operator's own torrent (adopted) is not ours to
    add back. Why: the wait raised five times and its dead letter could never be revived, a
    retry re-running only the wait (`tests/integration/test_qbt_review.py::
    test_a_torrent_deleted_in_qbittorrent_fails_its_request_at_once_and_a_retry_adds_it_again`).
    """
    with db.transaction() as s:
        last = s.execute(
            select(TaskEvent.id, TaskEvent.what)
            .where(TaskEvent.download_task_id == task.id, TaskEvent.what.in_((MISSING, READDED)))
            .order_by(TaskEvent.id.desc())
            .limit(1)
        ).first()
    adopted = bool((torrent_add(task.id) or {}).get("adopted"))
    if last is None or last.what == READDED or adopted:
        with db.transaction() as s:
            s.execute(
                pg_insert(Flag)
                .values(kind="missing_torrent", subject=str(task.id), detail={"infohash": task.infohash})
                .on_conflict_do_nothing()
            )
            if last is None or last.what == READDED:
                service.event(s, task.id, MISSING, infohash=task.infohash)
        again = "" if adopted else ", or retry it to add the torrent again"
        raise NonRetryable(
            f"torrent {task.infohash} is no longer in qBittorrent (removed there, or its profile "
            f"was lost): cancel the request{again}"
        )
    readd(ctx, task, last.id)


def readd(ctx: StepContext, task: DownloadTask, missing_event: int) -> None:
    """Add the vanished torrent again, once per disappearance (the ledger op names its event)."""

    def do(att: Attempt) -> dict[str, Any]:
        att.check()
        with torrent_decision(task.infohash):
            if qbt.find(task.infohash) is None:
                add_tagged(task)
        return {"infohash": task.infohash}

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        found = qbt.find(task.infohash)
        return Done({"infohash": task.infohash, "reconciled": True}) if found else NotDone("absent")

    op = f"qbt-readd:{task.id}:{missing_event}"
    plan = {"infohash": task.infohash, "tag": qbt.MANAGED_TAG}
    effect(ctx, op, plan, do, reconcile, effect_kind="qbittorrent")
    introduce_peers(task.infohash)
    with db.transaction() as s:
        service.event(s, task.id, READDED, infohash=task.infohash)


# States qBittorrent never leaves by itself: it could not read or write the files (full disk,
# lost mount, permissions), or they vanished from disk.
STUCK_STATES = {"error": "resume", "missingFiles": "recheck"}
STUCK = "torrent in error"


def unstick(task: DownloadTask, t: Any) -> None:
    """Flag the request (`torrent_error`, on its timeline) and, for a torrent of ours, retry:
    resume one in `error`, recheck one whose files are missing (it downloads them again).

    Why: such a torrent stayed so for ever while its request showed `downloading` with no flag
    nor event, and even once the cause was gone nobody resumed it
    (`tests/integration/test_qbt_review.py::
    test_a_torrent_in_error_is_flagged_on_the_request_and_resumed_once_the_cause_is_gone`).
    An operator's own torrent (adopted, untagged) is flagged but left as it is.
    """
    with db.transaction() as s:
        flagged = s.execute(
            pg_insert(Flag)
            .values(
                kind="torrent_error",
                subject=str(task.id),
                detail={"infohash": task.infohash, "state": t.state, "save_path": str(t.save_path)},
            )
            .on_conflict_do_nothing()
        )
        if flagged.rowcount:
            service.event(s, task.id, STUCK, state=t.state)
    if not qbt.is_managed(t):
        return
    if STUCK_STATES[t.state] == "recheck":
        qbt.client().torrents_recheck(torrent_hashes=task.infohash)
    else:
        qbt.client().torrents_resume(torrent_hashes=task.infohash)


MOVED_BACK = "torrent moved back"


def in_download_dir(task: DownloadTask, t: Any) -> bool:
    """True when qBittorrent keeps the torrent in DOWNLOAD_DIR, where the import reads it.

    A torrent of ours (tagged) that the operator moved ("Set location", a category's save path)
    is moved back, and the wait looks again once qBittorrent has moved it (state `moving` until
    then); one of the operator's own (adopted, untagged) is not ours to move, so the request
    fails at once saying where it lies. Why: the download wait declared a moved torrent done and
    the import failed with "payload does not match the torrent" though the payload was whole
    (`tests/integration/test_qbt_review.py::
    test_a_download_qbittorrent_moved_elsewhere_is_brought_back_before_the_import`).
    """
    if t.state == "moving":
        return False
    want = os.path.normpath(str(download_dir()))
    if os.path.normpath(str(t.save_path)) == want:
        return True
    if not qbt.is_managed(t):
        raise NonRetryable(
            f"qBittorrent keeps torrent {task.infohash} in {t.save_path}, not in DOWNLOAD_DIR {want} "
            "where the import reads it, and it is not tagged "
            f"{qbt.MANAGED_TAG}: move it there in qBittorrent, then retry"
        )
    qbt.client().torrents_set_location(location=want, torrent_hashes=task.infohash)
    with db.transaction() as s:
        service.event(s, task.id, MOVED_BACK, came_from=str(t.save_path), to=want)
    return False


def queue_import(ctx: StepContext) -> dict[str, str]:
    """Status, the `import` event and this step's result commit together, fenced by the lease."""
    task = load_task(ctx)
    result = {"queued": f"import:{task.id}"}
    with ctx.finish(result) as s:
        # A retry after this block committed must not move a task the import already took
        # further (`imported`, `notified`) back to `downloaded`.
        if service.advance_status(s, task.id, "downloaded", progress=1.0):
            service.event(s, task.id, "downloaded")
        outbox.add(s, "import", f"import:{task.id}", {"download_task_id": str(task.id)})
    return result


ACQUIRE = register(
    Kind(
        name="acquire",
        version=1,
        retry=qbt.QBT_RETRY,
        input_model=TaskInput,
        canvas=(
            wait_for(
                "approval",
                topic=lambda ctx: service.approval_topic(ctx.input.download_task_id),
                timeout_s=lambda ctx: get_settings().acq_approval_timeout_s,
                check=approved,
            ),
            step("add_torrent", while_qbittorrent_down(add_torrent)),
            wait_for(
                "download",
                topic=lambda ctx: service.download_topic(ctx.result("add_torrent")["infohash"]),
                timeout_s=lambda ctx: get_settings().acq_download_recheck_s,
                check=downloaded,
            ),
            step("queue_import", queue_import),
        ),
        on_cancel=service.mark_cancel_requested,
        compensation="compensate",
        description="approval → add torrent → wait for the download → queue import",
    )
)
