"""`relocate`: move a library item to another root — a large, cancellable copy, then a switch.

One relocate of an item at a time: runs carry the item as their concurrency key, and a run whose
copy finds an earlier one still live fails at once, naming it (`runs.live_ahead`). Two moves at
once could otherwise leave the row pointing at a root whose file the other deleted. The switch
is also a compare-and-set on the root the copy started from, so a move it did not see (a failed
run retried by hand) is refused, not overwritten. Proof: `tests/integration/test_relocate_overlap.py`.

A run that does not switch removes the copy it made, and only that file (its device and inode,
recorded with the copy): a refused switch at once, a canceled or abandoned run through its
compensation (`give_up`, run by `compensate`). Proof: `tests/integration/test_library_leftovers.py`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator
from sqlalchemy import select, text
from sqlalchemy.orm import Session

import ledger
from proj import db
from proj.acquisition import library, service
from proj.acquisition.models import LibraryItem
from proj.engine import runs
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, Done, NotDone, effect
from proj.engine.errors import NonRetryable
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.kinds.common import copy_checkpoint, library_path
from proj.settings import get_settings


class RelocateInput(BaseModel):
    library_item_id: int
    new_root: str

    @field_validator("new_root")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v or not Path(v).is_absolute():
            raise ValueError("new_root must be an absolute path")
        return v


def _item(ctx: StepContext) -> LibraryItem:
    with db.transaction() as s:
        item = s.get(LibraryItem, ctx.input.library_item_id)
    if item is None:
        raise ValueError(f"no library item {ctx.input.library_item_id}")
    return item


def _files_of_task(item: LibraryItem, root: Path) -> set[Path]:
    """The task's library files as they would lie under `root`: never taken for temp files (a
    torrent may hold `.a.part-x` next to `a`)."""
    with db.transaction() as s:
        rels = s.scalars(
            select(LibraryItem.rel_path).where(LibraryItem.download_task_id == item.download_task_id)
        )
        return {library_path(item.download_task_id, rel, root) for rel in rels}


def _first_in_line(ctx: StepContext) -> None:
    """Refuse to start behind another live relocate of the same item (enqueued earlier)."""
    ahead = runs.live_ahead(ctx.run_id)
    if ahead is not None:
        raise NonRetryable(
            f"library item {ctx.input.library_item_id} is being relocated by run {ahead}: "
            "one relocate of an item at a time; enqueue this one again when that run has ended"
        )


def _not_flagged(item: LibraryItem) -> None:
    """Refuse to copy an item `verify_library` flagged: its re-import is repairing it (see `switch`)."""
    if item.status != "ok":
        raise NonRetryable(
            f"library item {item.id} is flagged {item.status}: its re-import repairs it in {item.root}; "
            "relocate it once the re-import has ended"
        )


def copy(ctx: StepContext) -> dict[str, Any]:
    _first_in_line(ctx)
    item = _item(ctx)
    _not_flagged(item)
    src = library_path(item.download_task_id, item.rel_path, Path(item.root))
    dst = library_path(item.download_task_id, item.rel_path, Path(ctx.input.new_root))
    # Both are resolved: `/lib/`, `/lib/.` or a symlink to `/lib` name the root the item is in.
    if src == dst:
        return {
            "path": str(dst),
            "size": item.size,
            "sha256": item.sha256,
            "noop": True,
            "from_root": item.root,
        }

    def do(att: Attempt) -> dict[str, Any]:
        library.remove_temp_files(dst, keep=_files_of_task(item, Path(ctx.input.new_root)))
        copied = library.copy_file(
            src,
            dst,
            att.token.hex,
            checkpoint=copy_checkpoint(ctx, att),
            progress=lambda d, t: ctx.report_progress(d, t, "relocating") if d == t else None,
            chunk=get_settings().copy_chunk_bytes,
        )
        _refuse_rotten(item, dst, copied)
        return {**copied, **library.file_id(dst)}  # which file is ours, should we give it up

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        if dst.exists() and dst.stat().st_size == item.size and library.sha256_file(dst) == item.sha256:
            return Done({"path": str(dst), "size": item.size, "sha256": item.sha256, **library.file_id(dst)})
        return NotDone("destination incomplete")

    plan = {"src": str(src), "dst": str(dst), "sha256": item.sha256}
    # Keyed by the run, not by the target root: after A → B → A, a later move to B is a new copy
    # (the old `relocate:<item>:B` result names a file that the move back to A deleted).
    result = effect(ctx, f"relocate:{item.id}:{ctx.run_id}", plan, do, reconcile, effect_kind="file")
    return {**result, "from_root": item.root}


def _refuse_rotten(item: LibraryItem, dst: Path, copied: dict[str, Any]) -> None:
    """The bytes copied must be the ones the item was recorded with, else remove the copy and fail.

    Why: a rotten original (same size, other bytes) was copied, the row switched to the copy
    and the original deleted, so the library claimed a digest its only copy no longer had. The
    original stays for `verify_library` to flag and re-import
    (`tests/integration/test_library_review.py::
    test_relocate_refuses_a_copy_whose_bytes_are_not_the_recorded_ones`).
    """
    if copied["sha256"] == item.sha256:
        return
    dst.unlink(missing_ok=True)
    raise NonRetryable(
        f"library item {item.id} at {item.root} does not hold the bytes it was recorded with "
        f"(sha256 {copied['sha256']}, recorded {item.sha256}): not relocated; "
        "verify_library flags it and re-imports it"
    )


# The item's row, locked: a switch and a compensation decide about its files one at a time.
LOCK_ITEM = text(
    """
    SELECT download_task_id, rel_path, root, status
      FROM acq.library_item
     WHERE id = :item_id
       FOR UPDATE
    """
)

SWITCH_ROOT = text(
    """
    UPDATE acq.library_item
       SET root = :new_root
     WHERE id = :item_id AND root = :from_root AND status = 'ok'
    """
)

# A `give_up` about to remove a copy its run recorded no file for (an attempt cut off after its
# rename) first names that file (device and inode), committed before it sets the file aside: a
# `give_up` killed with the file set aside left it there for good (the next one saw nothing at
# the path), and now the next one finds it by that name and removes it
# (`tests/integration/test_library_leftovers.py::
# test_giving_up_again_removes_an_unrecorded_copy_a_killed_give_up_set_aside`).
RECORD_GIVE_UP_TARGET = text(
    """
    INSERT INTO acq.flag (kind, subject, detail, at)
    VALUES ('relocate_give_up_target', :op_key, CAST(:detail AS jsonb), now())
    ON CONFLICT (kind, subject) DO UPDATE SET detail = excluded.detail, at = excluded.at
    """
)
GIVE_UP_TARGET = text(
    """
    SELECT detail FROM acq.flag WHERE kind = 'relocate_give_up_target' AND subject = :op_key
    """
)
FORGET_GIVE_UP_TARGET = text(
    """
    DELETE FROM acq.flag WHERE kind = 'relocate_give_up_target' AND subject = :op_key
    """
)

# A later relocate of the item that planned a copy to the same path: that file may be its own.
LATER_COPY_TO = text(
    """
    SELECT count(*)
      FROM ledger.asset_operation
     WHERE op_key LIKE :item_prefix
       AND op_key <> :op_key
       AND plan ->> 'dst' = :dst
       AND created_at > :created_at
    """
)


def switch(ctx: StepContext) -> dict[str, Any]:
    """The row points at the new copy before the old one is deleted: never zero copies.

    The switch is a compare-and-set, under the row's lock, on what the copy saw: the same root,
    the item not flagged, and the copy still whole at its path. Otherwise the run fails
    saying which, having removed its own copy (`_remove_own_copy`), never the original nor the
    file the row points at. Why the flag: `verify_library` marks an item `corrupt` and queues
    its re-import in one commit, and the re-import repairs the file where the row says it lies;
    moving the row under it let a re-import that had chosen the old root record it again after
    the switch deleted its file there, orphaning the new copy or pointing the row at nothing
    (`tests/integration/test_library_leftovers.py::
    test_a_relocate_of_an_item_flagged_for_repair_refuses_its_switch_and_removes_its_copy`).
    """
    item = _item(ctx)
    copied: dict[str, Any] = ctx.result("copy")
    new_root = ctx.input.new_root
    # The root the copy started from (committed with the copy step): a retry of this step after
    # the row already points at the new root must still delete the old copy.
    from_root = copied.get("from_root", item.root)
    old = library_path(item.download_task_id, item.rel_path, Path(from_root))
    new = library_path(item.download_task_id, item.rel_path, Path(new_root))
    with ctx.fenced() as s:
        row = s.execute(LOCK_ITEM, {"item_id": item.id}).one()
        refused = None if row.root == new_root else _refusal(item.id, row, from_root, new_root, copied, new)
        if refused is not None:
            here = library_path(item.download_task_id, item.rel_path, Path(row.root))
            _remove_own_copy(copied, new, keep={here, old})
        elif row.root != new_root and _switch_root(s, item.id, from_root, new_root):
            service.event(
                s,
                item.download_task_id,
                "relocated",
                rel_path=item.rel_path,
                root=new_root,
                from_root=from_root,
            )
    if refused is not None:
        raise NonRetryable(refused)
    if old != new:  # the same file under another spelling of its root is the only copy
        old.unlink(missing_ok=True)
        library.remove_temp_files(old, keep=_files_of_task(item, Path(from_root)))
    return {"root": new_root}


def _refusal(
    item_id: int, row: Any, from_root: str, new_root: str, copied: Mapping[str, Any], new: Path
) -> str | None:
    """Why the switch may not land (the row's lock held), or None."""
    if row.root != from_root:
        return (
            f"library item {item_id} was moved to {row.root} while this run copied it from "
            f"{from_root}: the switch to {new_root} is refused"
        )
    if row.status != "ok":
        return (
            f"library item {item_id} was flagged {row.status} while this run copied it: its re-import "
            f"repairs it in {from_root}, so the switch to {new_root} is refused and this run's copy "
            "removed; relocate it again once the re-import has ended"
        )
    if not _copy_intact(copied, new):
        return (
            f"the copy at {new} is gone or not whole: "
            f"the switch to {new_root} is refused; relocate library item {item_id} again"
        )
    return None


def _copy_intact(copied: Mapping[str, Any], new: Path) -> bool:
    """A whole copy is still at `new`: the row never points at nothing. By size, not inode: a
    filesystem whose inode numbers are not stable (some FUSE or SMB mounts) must not make every
    switch fail; the inode only ever decides what may be removed, where a mismatch keeps."""
    try:
        return bool(new.stat().st_size == copied["size"])
    except FileNotFoundError:
        return False


def _remove_own_copy(copied: Mapping[str, Any], new: Path, keep: set[Path]) -> str:
    """Remove the copy this run made at `new`, never a path in `keep` (the original, the file
    the row points at) nor a no-op's; what became of it."""
    if copied.get("noop") or new in keep:
        return "kept"
    if "ino" in copied:
        return "removed" if library.remove_if_same_file(new, copied["dev"], copied["ino"]) else "kept"
    new.unlink(missing_ok=True)  # a copy recorded before copies noted their inode
    return "removed"


def _switch_root(s: Session, item_id: int, from_root: str, new_root: str) -> bool:
    """Point the row at `new_root` if it still points at `from_root` and is not flagged; True if
    it landed."""
    done = s.execute(SWITCH_ROOT, {"item_id": item_id, "from_root": from_root, "new_root": new_root})
    return bool(done.rowcount == 1)  # type: ignore[attr-defined]  # a CursorResult


def give_up(run_id: uuid.UUID, inp: Mapping[str, Any]) -> dict[str, Any]:
    """A canceled or abandoned relocate's compensation (`compensate.clean_files` calls it): remove
    the copy the run made and its temp file, never the original nor the file the row points at.

    Why: a relocate canceled between its copy and its switch (or a dead letter abandoned) left a
    full copy in the new root that nothing pointed at, for good. The run's copy is its ledger
    operation (`relocate:<item>:<run>`): the plan names the path, the result the file (device
    and inode), so a file another relocate has put at the same path since stays. An attempt cut
    off after its rename but before its result (a killed worker) recorded no inode: that file
    goes unless a later relocate of the item planned a copy to the same path. Decided under the
    row's lock, as the switch is
    (`tests/integration/test_library_leftovers.py::test_a_relocate_canceled_after_its_copy_removes_that_copy`,
    `::test_giving_up_a_relocate_removes_only_the_file_it_copied`).
    """
    item_id = int(inp["library_item_id"])
    op_key = f"relocate:{item_id}:{run_id}"
    with db.transaction() as s:
        op = ledger.get_operation(s, op_key)
        if op is None:
            return {"skipped": True, "reason": "nothing was copied"}
        dst, src = Path(op.plan["dst"]), Path(op.plan["src"])
        temps = 0
        if op.attempt_token is not None and library.temp_path(dst, op.attempt_token.hex).exists():
            library.temp_path(dst, op.attempt_token.hex).unlink(missing_ok=True)
            temps = 1
        row = s.execute(LOCK_ITEM, {"item_id": item_id}).one_or_none()
        keep = {src}
        if row is not None:
            keep.add(library_path(row.download_task_id, row.rel_path, Path(row.root)))
        result = op.result if isinstance(op.result, dict) else None
        settled = _settle_own_aside(result, dst) or _settle_unrecorded_aside(s, op_key, dst)
        if not dst.exists():
            copy = "removed" if settled else "absent"
        elif result is not None:
            copy = _remove_own_copy(result, dst, keep)
        elif dst in keep or _later_copy_to(s, item_id, op_key, dst, op.created_at):
            copy = "kept"
        else:  # whichever file is there now, removed as one: a rename landing meanwhile stays
            copy = _remove_unrecorded_copy(op_key, dst)
        s.execute(FORGET_GIVE_UP_TARGET, {"op_key": op_key})
    return {"copy": copy, "path": str(dst), "temp_files": temps}


def _remove_unrecorded_copy(op_key: str, dst: Path) -> str:
    """Remove the file at `dst` as one, having named it first (`RECORD_GIVE_UP_TARGET`)."""
    target = library.file_id(dst)
    with db.transaction() as s:  # committed before the file is set aside
        s.execute(RECORD_GIVE_UP_TARGET, {"op_key": op_key, "detail": json.dumps(target)})
    return "removed" if library.remove_if_same_file(dst, **target) else "kept"


def _settle_unrecorded_aside(s: Session, op_key: str, dst: Path) -> bool:
    """Settle what a killed `_remove_unrecorded_copy` left set aside: removed (it was the file
    it meant to remove)."""
    named = s.scalar(GIVE_UP_TARGET, {"op_key": op_key})
    if not named:
        return False
    return library.settle_aside(dst, int(named["dev"]), int(named["ino"]))


def _settle_own_aside(result: Mapping[str, Any] | None, dst: Path) -> bool:
    """Settle what a `give_up` or `switch` killed in `remove_if_same_file` left set aside about
    this run's copy (put back if not ours, removed if ours) before `dst` is looked at: a library
    file set aside is missing from `dst` until then (`tests/integration/test_library_leftovers.py::
    test_giving_up_a_relocate_again_puts_back_a_library_file_a_killed_give_up_set_aside`)."""
    if result is None or "ino" not in result or result.get("noop"):
        return False
    return library.settle_aside(dst, result["dev"], result["ino"])


def _later_copy_to(s: Session, item_id: int, op_key: str, dst: Path, created_at: Any) -> bool:
    """Whether a relocate of the item enqueued after this one planned its copy to `dst` too."""
    params = {
        "item_prefix": f"relocate:{item_id}:%",
        "op_key": op_key,
        "dst": str(dst),
        "created_at": created_at,
    }
    return bool(s.scalar(LATER_COPY_TO, params))


RELOCATE = register(
    Kind(
        name="relocate",
        version=1,
        retry=RetryPolicy.file(),
        input_model=RelocateInput,
        canvas=(step("copy", copy), step("switch", switch)),
        compensation="compensate",  # `give_up`: the copy of a run canceled or abandoned goes
        # Not a limit (none is set): the key orders an item's relocates for `runs.live_ahead`.
        concurrency_key=lambda inp: f"library-item:{inp.library_item_id}",
        description="move a library item to another root (cancellable chunked copy)",
    )
)
