"""`compensate`: after cancel or abandon, remove the torrent and every partial or temp file (for a
relocate: the copy it made)."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel
from sqlalchemy import func, select, update

from proj import db
from proj.acquisition import library, qbt, service, torrents
from proj.acquisition.models import DownloadTask, LibraryItem
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, Done, NotDone, effect
from proj.engine.kind import Kind, register, step
from proj.kinds import relocate
from proj.kinds.common import (
    library_path,
    library_rel,
    recorded_root,
    release_torrent,
    torrent_add,
    torrent_library_paths,
    while_qbittorrent_down,
)


class CompensateInput(BaseModel):
    """What the engine passes for a canceled or abandoned run (`Kind.compensation`)."""

    run_id: uuid.UUID
    kind: str
    input: dict[str, Any]


def _task(ctx: StepContext) -> DownloadTask | None:
    task_id = ctx.input.input.get("download_task_id")
    if not task_id:
        return None
    with db.transaction() as s:
        return s.get(DownloadTask, uuid.UUID(str(task_id)))


def is_repair(ctx: StepContext) -> bool:
    """Whether the run given up is a re-import (`verify_library` found corruption): the repair of
    a request already delivered, whose torrent, files and status are not the repair's to undo.

    Why: giving up a repair (abandoned, or canceled) marked the delivered request `canceled`
    and would remove its still-seeding torrent with its data
    (`tests/integration/test_library_review.py::test_giving_up_a_reimport_leaves_the_delivered_request_alone`).
    """
    return ctx.input.kind == "import" and bool(ctx.input.input.get("generation"))


def remove_torrent(ctx: StepContext) -> dict[str, Any]:
    """Pause-and-remove with its partial data, unless another request still holds the torrent
    (`common.release_torrent`); reconcile: the infohash is gone (else decide again)."""
    task = _task(ctx)
    if task is None:
        return {"skipped": True}
    if is_repair(ctx):
        return {"skipped": True, "reason": "a re-import's: the request was delivered"}
    infohash = task.infohash
    add = torrent_add(task.id)  # the ledger knows every add we attempted
    if add is None:
        # Rejected (or canceled) before the add was ever attempted: qBittorrent is not touched.
        return {"skipped": True, "reason": "no torrent was added"}
    if add.get("adopted"):
        # It was in qBittorrent before this request's add: not ours to remove (nor its files).
        return {"skipped": True, "reason": "the torrent was not added by this request"}

    def do(att: Attempt) -> dict[str, Any]:
        # Kept while another request holds it (or it is not tagged ours): this request's own
        # library files still go (`clean_files`), the torrent's download data stays.
        kept = release_torrent(task.id, infohash, delete_files=True)
        return {"kept": infohash, "reason": kept} if kept else {"removed": infohash}

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        return Done({"removed": infohash}) if qbt.find(infohash) is None else NotDone("still there")

    return effect(
        ctx, f"qbt-remove:{task.id}", {"infohash": infohash}, do, reconcile, effect_kind="qbittorrent"
    )


def clean_files(ctx: StepContext) -> dict[str, Any]:
    """Temp files always go; library files go unless the import was recorded (finished). A
    relocate's: the copy the run made, unless the row points at it (`relocate.give_up`)."""
    if ctx.input.kind == "relocate":
        return relocate.give_up(ctx.input.run_id, ctx.input.input)
    task = _task(ctx)
    if task is None:
        return {"skipped": True}
    meta = torrents.parse(task.torrent)
    with db.transaction() as s:
        recorded = set(s.scalars(select(LibraryItem.rel_path).where(LibraryItem.download_task_id == task.id)))
    temps = removed = 0
    for f in meta.files:
        rel = library_rel(meta, f)
        root = recorded_root(task.id, rel)  # a canceled re-import wrote where the file lies
        dst = library_path(task.id, rel, root)
        # A file named like a temp file is not one.
        temps += library.remove_temp_files(dst, keep=torrent_library_paths(task.id, meta, root))
        if rel not in recorded and dst.exists():
            dst.unlink()
            removed += 1
    return {"temp_files": temps, "partial_files": removed}


def mark_compensated(ctx: StepContext) -> dict[str, Any]:
    task = _task(ctx)
    if task is None:
        return {"skipped": True}
    if is_repair(ctx):
        return _repair_given_up(ctx, task)
    result = {"status": "canceled"}
    # The event and the step's result commit together: a worker killed between two commits
    # would run the step again and write the event twice
    # (`tests/integration/test_events_once.py::test_compensated_once_after_a_lost_step_commit`).
    with ctx.finish(result) as s:
        # A rejected request keeps saying so; anything else ends `canceled`.
        s.execute(
            update(DownloadTask)
            .where(DownloadTask.id == task.id, DownloadTask.status != service.RequestStatus.REJECTED)
            .values(status=service.RequestStatus.CANCELED, updated_at=func.now())
        )
        service.event(s, task.id, "compensated", run_id=str(ctx.input.run_id), kind=ctx.input.kind)
    return result


def _repair_given_up(ctx: StepContext, task: DownloadTask) -> dict[str, Any]:
    """The request keeps its status; its timeline says the repair was given up (`is_repair`)."""
    result = {"status": task.status, "repair": "given up"}
    with ctx.finish(result) as s:
        generation = ctx.input.input.get("generation")
        service.event(s, task.id, "re-import given up", run_id=str(ctx.input.run_id), generation=generation)
    return result


COMPENSATE = register(
    Kind(
        name="compensate",
        version=1,
        retry=qbt.QBT_RETRY,
        input_model=CompensateInput,
        canvas=(
            step("remove_torrent", while_qbittorrent_down(remove_torrent)),
            step("clean_files", clean_files),
            step("mark", mark_compensated),
        ),
        description="remove the torrent and partial/temp files of a canceled or abandoned run",
    )
)
