"""`import`: verify the payload → copy each file into the library (fan-out, one ledger op per
file) → record library items and queue `notify` and `retire_seed`."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, NoReturn

from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

import outbox
from proj import db
from proj.acquisition import library, service, torrents
from proj.acquisition.models import DownloadTask, LibraryItem
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, Done, NotDone, effect
from proj.engine.errors import NonRetryable
from proj.engine.kind import Kind, RetryPolicy, fan_out, register, step
from proj.kinds.common import (
    TaskInput,
    copy_checkpoint,
    download_dir,
    library_mounted,
    library_path,
    library_rel,
    library_root,
    load_task,
    recorded_root,
    torrent_library_paths,
)
from proj.settings import get_settings


class ImportInput(TaskInput):
    """`generation` > 0 re-imports (after `verify_library` found corruption): new ledger ops."""

    generation: int = 0


def verify(ctx: StepContext) -> dict[str, Any]:
    """Sizes and every piece hash must match before a byte reaches the library. Each file's
    sha256, read in the same pass, is noted in the result: the digest a copy must reproduce
    (`copy_one`), whatever happens to the download folder meanwhile."""
    task = load_task(ctx)
    meta = torrents.parse(task.torrent)
    digests = torrents.verify_pieces(task.torrent, download_dir())
    # Before the first byte is copied: the library's disk is there, and the files not yet in
    # the library fit on it.
    library_mounted(task.id, library_root())
    library.check_space(library_root(), _missing_bytes(task, meta))
    files = [
        {
            "rel_path": f.rel_path,
            "size": f.size,
            "mtime_ns": _source_stamp(meta, f)[1],
            "sha256": digests[f.rel_path],
        }
        for f in meta.files
    ]
    result = {"name": meta.name, "files": files}
    with ctx.finish(result) as s:
        # A re-import repairs files (the task's story is done); a retry does not go back.
        if ctx.input.generation or service.advance_status(s, task.id, "importing"):
            service.event(s, task.id, "verified", files=len(meta.files), bytes=meta.total_size)
    return result


def _source_stamp(meta: torrents.TorrentMeta, f: torrents.TorrentFile) -> tuple[int, int]:
    """A downloaded file's (size, mtime_ns): what the piece check saw, to tell whether it moved."""
    st = torrents.source_path(meta, download_dir(), f).stat()
    return st.st_size, st.st_mtime_ns


class SourceChanged(RuntimeError):
    """The downloaded file changed while it was copied: the copy is removed and retried."""


class DownloadCorrupt(torrents.BadTorrent, NonRetryable):
    """A downloaded file whose pieces matched at `verify` no longer does when its copy read it:
    the run fails at once (a dead letter, as a payload that does not match at `verify` ends).
    A retry a second later would read the same bytes; the cure is qBittorrent's recheck, which
    downloads the bad pieces again, then `proj resolve --retry`."""


# The request's timeline, when a copy read other bytes than `verify` checked.
DOWNLOAD_CORRUPT = "download corrupt"
DOWNLOAD_CHANGED = "download changed during its copy"


def _still_verified(ctx: StepContext, task: DownloadTask, src: Path, item: dict[str, Any]) -> None:
    """Before a copy: a source whose size or mtime moved since the piece check has its pieces
    checked again (`DownloadCorrupt` if they no longer match), so a copy is not spent on bytes
    that cannot be the verified ones. Rot that keeps both is caught by the copy's digest
    (`_not_what_was_verified`).

    Why: a copy retried after the operator fixed its cause (or simply run later) copied whatever
    the download folder then held, a file a tagger had rewritten or the disk had rotted, and its
    digest became the truth `verify_library` checks against
    (`tests/integration/test_library_review.py::
    test_a_copy_retried_after_its_source_changed_does_not_record_the_new_bytes`).
    """
    seen = item.get("mtime_ns")
    if seen is None:  # verified by a version that did not note it
        return
    st = src.stat()
    if (st.st_size, st.st_mtime_ns) != (int(item["size"]), int(seen)):
        _pieces_still_match(ctx, task, item["rel_path"], "its size or mtime changed")


def _not_what_was_verified(
    ctx: StepContext, task: DownloadTask, rel_path: str, mismatch: library.DigestMismatch
) -> NoReturn:
    """A copy read bytes whose sha256 is not the one `verify` noted (its temp file is gone
    already): check this file's pieces again to tell rot from a passing change.

    - The pieces fail: the download rotted (or was rewritten) after `verify` checked it, though
      its size and mtime may be as they were. `DownloadCorrupt`: the run fails at once, saying
      "payload does not match the torrent's piece hashes", and the timeline says which file.
    - The pieces match again (a tagger wrote the file and put it back, a read that returned
      other bytes once): `SourceChanged`, and the next attempt copies again, held to the same
      digest; three such attempts end in a dead letter like any other failure.

    Either way the library never records a digest other than the verified one
    (`tests/integration/test_library_leftovers.py::
    test_a_download_rotting_after_its_piece_check_never_reaches_the_library`,
    `::test_a_download_changed_and_restored_during_its_copy_is_copied_again`).
    """
    _pieces_still_match(ctx, task, rel_path, str(mismatch))
    _note(ctx, task.id, DOWNLOAD_CHANGED, rel_path=rel_path, error=str(mismatch))
    raise SourceChanged(f"{mismatch}; its pieces match again, so the copy is retried") from mismatch


def _pieces_still_match(ctx: StepContext, task: DownloadTask, rel_path: str, what: str) -> None:
    """Check the pieces covering `rel_path` again; if they fail, the request's timeline says
    `download corrupt` and the step raises `DownloadCorrupt` (the run fails at once)."""
    try:
        torrents.verify_pieces(task.torrent, download_dir(), only=rel_path)
    except torrents.BadTorrent as bad:
        _note(ctx, task.id, DOWNLOAD_CORRUPT, rel_path=rel_path, error=str(bad))
        raise DownloadCorrupt(
            f"{bad}: {rel_path} changed after the import verified it ({what}); recheck the torrent "
            "in qBittorrent, which downloads the bad pieces again, then retry"
        ) from bad


def _note(ctx: StepContext, task_id: uuid.UUID, what: str, **detail: Any) -> None:
    """An event on the request's timeline, only while this attempt holds its lease."""
    with ctx.fenced() as s:
        service.event(s, task_id, what, **{k: str(v)[:300] for k, v in detail.items()})


def _already_copied(dst: Path, size: int) -> bool:
    return dst.exists() and dst.stat().st_size == size


def _missing_bytes(task: DownloadTask, meta: torrents.TorrentMeta) -> int:
    """Bytes still to copy into the library root. A file relocated elsewhere is repaired in its
    own root (`copy_one` checks the space there), so it does not count against this one."""
    root = library_root()
    with db.transaction() as s:
        elsewhere = set(
            s.scalars(
                select(LibraryItem.rel_path).where(
                    LibraryItem.download_task_id == task.id, LibraryItem.root != str(root)
                )
            )
        )
    return sum(
        f.size
        for f in meta.files
        if (rel := library_rel(meta, f)) not in elsewhere
        and not _already_copied(library_path(task.id, rel, root), f.size)
    )


def _paths(task: DownloadTask, meta: torrents.TorrentMeta, rel_path: str) -> tuple[Path, Path, str, Path]:
    """Source in the download folder, destination in the library, the library-relative path and
    the root the destination is in (a recorded file's own: it may have been relocated)."""
    f = next(f for f in meta.files if f.rel_path == rel_path)
    rel = library_rel(meta, f)
    root = recorded_root(task.id, rel)
    return torrents.source_path(meta, download_dir(), f), library_path(task.id, rel, root), rel, root


def copy_one(ctx: StepContext) -> dict[str, Any]:
    """One file, once: temp file, chunks (each a cancel/lease checkpoint), fsync, rename."""
    task = load_task(ctx)
    rel_path, size = ctx.item["rel_path"], int(ctx.item["size"])
    meta = torrents.parse(task.torrent)
    src, dst, rel, root = _paths(task, meta, rel_path)
    others = torrent_library_paths(task.id, meta, root)  # never taken for this file's temp files
    plan = {"src": str(src), "dst": str(dst), "size": size}
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > 0.5 or done == total:
            last[0] = now
            ctx.report_progress(done, total, f"copying {rel_path}")

    def do(att: Attempt) -> dict[str, Any]:
        _still_verified(ctx, task, src, ctx.item)
        library_mounted(task.id, root)  # never `mkdir -p` a root whose disk dropped since `verify`
        before = src.stat()
        verified = ctx.item.get("sha256")  # None: verified by a version that did not note it
        # Earlier attempts' leftovers (this attempt is current), never another file of the torrent.
        library.remove_temp_files(dst, keep=others)
        library.check_space(dst.parent, size)  # clear reason now, rather than ENOSPC halfway
        try:
            copied = library.copy_file(
                src,
                dst,
                att.token.hex,
                checkpoint=copy_checkpoint(ctx, att),
                progress=progress,
                chunk=get_settings().copy_chunk_bytes,
                expect_sha256=verified,
            )
        except library.DigestMismatch as mismatch:
            _not_what_was_verified(ctx, task, rel_path, mismatch)
        after = src.stat()
        if verified is None and (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            dst.unlink(missing_ok=True)  # the next attempt checks the pieces again
            raise SourceChanged(f"{src} changed while it was copied")
        return {**copied, **library.file_id(dst)}  # which file is ours (`_moved_meanwhile`)

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        # A copy is done when it holds the verified bytes (read once), never merely the source's
        # bytes of now; a version that noted no digest compares with the source.
        if dst.exists() and dst.stat().st_size == size:
            digest = library.sha256_file(dst)
            if digest == (ctx.item.get("sha256") or library.sha256_file(src)):
                found = {"path": str(dst), "size": size, "sha256": digest, "reconciled": True}
                return Done({**found, **library.file_id(dst)})
        return NotDone("destination missing or different")

    key = f"copy:{task.id}:{ctx.input.generation}:{rel_path}"
    result = effect(ctx, key, plan, do, reconcile, effect_kind="file")
    return {**result, "rel_path": rel, "root": str(root)}


def record(ctx: StepContext) -> dict[str, Any]:
    """Library rows, status and the next events commit together under this step's lease."""
    task = load_task(ctx)
    copies = ctx.result("copy")
    default_root = str(library_root())  # a copy recorded before copies named their root
    generation = ctx.input.generation
    result: dict[str, Any] = {"files": len(copies), **({"generation": generation} if generation else {})}
    moved: list[str] = []
    with ctx.finish(result) as s:
        for c in copies:
            root = c.get("root", default_root)
            if _moved_meanwhile(s, task.id, c):
                moved.append(c["rel_path"])
                continue
            s.execute(
                pg_insert(LibraryItem)
                .values(
                    download_task_id=task.id,
                    rel_path=c["rel_path"],
                    root=root,
                    size=c["size"],
                    sha256=c["sha256"],
                )
                .on_conflict_do_update(
                    index_elements=[LibraryItem.download_task_id, LibraryItem.rel_path],
                    set_={"sha256": c["sha256"], "size": c["size"], "status": "ok", "root": root},
                )
            )
        if ctx.input.generation:
            # A re-import (after `verify_library` found corruption) only repairs the files: the
            # requester was told and the seeding goal was queued by the first import. Queuing
            # `retire_seed` again would carry a new `seed_until` under the same key
            # (`OutboxConflict`, the record step could never commit).
            relocated = {"left_where_relocated": moved} if moved else {}
            service.event(s, task.id, "re-imported", files=len(copies), generation=generation, **relocated)
            return result
        # A retry after this block committed must not move a notified task back to `imported`.
        if service.advance_status(s, task.id, "imported"):
            service.event(s, task.id, "imported", files=len(copies))
        outbox.add(s, "notify", f"notify:{task.id}", {"download_task_id": str(task.id)})
        # An earlier attempt may have committed this block and lost its lease (killed, frozen,
        # disconnected) before the step's own commit: keep the seeding goal it queued, a new
        # `seed_until` under the same key is an `OutboxConflict` on every retry.
        seed_key = f"retire_seed:{task.id}"
        queued = s.scalar(
            select(outbox.OutboxEvent.payload).where(
                outbox.OutboxEvent.kind == "retire_seed", outbox.OutboxEvent.idempotency_key == seed_key
            )
        )
        if queued is None:
            # The database's clock, not this worker's: a skewed host must not move the goal.
            seed_until = s.scalar(
                text("SELECT now() + make_interval(secs => :s)"), {"s": get_settings().seed_time_s}
            )
            queued = {"download_task_id": str(task.id), "seed_until": seed_until.isoformat()}
        outbox.add(s, "retire_seed", seed_key, queued)
    return result


# The row of one library file, locked: a relocate's switch (`relocate.LOCK_ITEM`) waits for us.
ROW_OF_FILE = text(
    """
    SELECT root
      FROM acq.library_item
     WHERE download_task_id = :task_id AND rel_path = :rel_path
       FOR UPDATE
    """
)


def _moved_meanwhile(s: Session, task_id: uuid.UUID, copied: dict[str, Any]) -> bool:
    """Whether the file's row now points at another file than the one this copy wrote (a
    relocate switched it since the copy chose its root); then this copy, if still there, goes.

    Why: a re-import copies every file of its task where its row says it lies, the healthy ones
    too. A relocate of one of them could switch between that copy and this record: the switch
    deleted the old root's file, and the record pointed the row back at it, at nothing (or at
    this copy, the relocate's left orphaned). The relocated copy was checked against the same
    recorded sha256, so it stays as the switch left it
    (`tests/integration/test_library_leftovers.py::
    test_a_reimport_leaves_a_file_relocated_meanwhile_where_the_move_put_it`).
    """
    root = s.scalar(ROW_OF_FILE, {"task_id": task_id, "rel_path": copied["rel_path"]})
    if root is None or "path" not in copied:
        return False
    ours = Path(copied["path"])
    if library_path(task_id, copied["rel_path"], Path(root)) == ours:  # its root, however spelled
        return False
    if "ino" in copied:
        library.remove_if_same_file(ours, copied["dev"], copied["ino"])
    return True


def on_cancel(s: Session, run_id: uuid.UUID, inp: ImportInput) -> None:
    """A first import's cancel is the request's (`service.mark_cancel_requested`); a re-import's
    is only the repair's: the delivered request is not flagged `canceling`
    (`tests/integration/test_library_review.py::test_giving_up_a_reimport_leaves_the_delivered_request_alone`).
    """
    if not inp.generation:
        service.mark_cancel_requested(s, run_id, inp)


# The file policy's three attempts; a library disk that is not mounted (`LibraryUnavailable`) is
# an outage, waited out for up to a day without spending them (`common.require_mounted`).
IMPORT_RETRY = RetryPolicy(max_attempts=3, initial_s=1.0, max_s=60.0, outage_s=24 * 3600.0)

IMPORT = register(
    Kind(
        name="import",
        version=1,
        retry=IMPORT_RETRY,
        input_model=ImportInput,
        canvas=(
            step("verify", verify),
            fan_out("copy", copy_one, over=lambda ctx: ctx.result("verify")["files"]),
            step("record", record),
        ),
        on_cancel=on_cancel,
        compensation="compensate",
        description="verify pieces → copy each file (fan-out) → record library items",
    )
)
