"""`relocate`: move a library item to another root — a large, cancellable copy, then a switch.

One relocate of an item at a time: runs carry the item as their concurrency key, and a run whose
copy finds an earlier one still live fails at once, naming it (`runs.live_ahead`). Two moves at
once could otherwise leave the row pointing at a root whose file the other deleted. The switch
is also a compare-and-set on the root the copy started from, so a move it did not see (a failed
run retried by hand) is refused, not overwritten. Proof: `tests/integration/test_relocate_overlap.py`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, field_validator
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from proj import db
from proj.acquisition import library, service
from proj.acquisition.models import LibraryItem
from proj.engine import runs
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, Done, NotDone, effect
from proj.engine.errors import NonRetryable
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.kinds.common import library_path
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


def copy(ctx: StepContext) -> dict[str, Any]:
    _first_in_line(ctx)
    item = _item(ctx)
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
    delay = get_settings().fault_chunk_delay_s  # fault injection: a copy slow enough to cancel

    def do(att: Attempt) -> dict[str, Any]:
        def checkpoint() -> None:  # per chunk: cancel, lease and ledger attempt still ours?
            if delay:
                time.sleep(delay)
            ctx.checkpoint()
            att.check()

        library.remove_temp_files(dst, keep=_files_of_task(item, Path(ctx.input.new_root)))
        copied = library.copy_file(
            src,
            dst,
            att.token.hex,
            checkpoint=checkpoint,
            progress=lambda d, t: ctx.report_progress(d, t, "relocating") if d == t else None,
            chunk=get_settings().copy_chunk_bytes,
        )
        _refuse_rotten(item, dst, copied)
        return copied

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        if dst.exists() and dst.stat().st_size == item.size and library.sha256_file(dst) == item.sha256:
            return Done({"path": str(dst), "size": item.size, "sha256": item.sha256})
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


def switch(ctx: StepContext) -> dict[str, Any]:
    """The row points at the new copy before the old one is deleted: never zero copies."""
    item = _item(ctx)
    # The root the copy started from (committed with the copy step): a retry of this step after
    # the row already points at the new root must still delete the old copy.
    from_root = ctx.result("copy").get("from_root", item.root)
    old = library_path(item.download_task_id, item.rel_path, Path(from_root))
    new = library_path(item.download_task_id, item.rel_path, Path(ctx.input.new_root))
    with ctx.fenced() as s:
        moved = _switch_root(s, item.id, from_root, ctx.input.new_root)
        if moved:  # once: a retry after this commit finds the row moved already
            service.event(
                s,
                item.download_task_id,
                "relocated",
                rel_path=item.rel_path,
                root=ctx.input.new_root,
                from_root=from_root,
            )
        current = s.scalar(select(LibraryItem.root).where(LibraryItem.id == item.id))
    if not moved and current != ctx.input.new_root:
        # Moved by someone else since our copy began: the row is theirs; our copy is nobody's.
        here = library_path(item.download_task_id, item.rel_path, Path(str(current)))
        if new != here:
            new.unlink(missing_ok=True)
        raise NonRetryable(
            f"library item {item.id} was moved to {current} while this run copied it from "
            f"{from_root}: the switch to {ctx.input.new_root} is refused"
        )
    if old != new:  # the same file under another spelling of its root is the only copy
        old.unlink(missing_ok=True)
        library.remove_temp_files(old, keep=_files_of_task(item, Path(from_root)))
    return {"root": ctx.input.new_root}


def _switch_root(s: Session, item_id: int, from_root: str, new_root: str) -> bool:
    """Point the row at `new_root` if it still points at `from_root`; True if it landed."""
    done = s.execute(
        update(LibraryItem)
        .where(LibraryItem.id == item_id, LibraryItem.root == from_root)
        .values(root=new_root)
    )
    return bool(done.rowcount == 1)


RELOCATE = register(
    Kind(
        name="relocate",
        version=1,
        retry=RetryPolicy.file(),
        input_model=RelocateInput,
        canvas=(step("copy", copy), step("switch", switch)),
        # Not a limit (none is set): the key orders an item's relocates for `runs.live_ahead`.
        concurrency_key=lambda inp: f"library-item:{inp.library_item_id}",
        description="move a library item to another root (cancellable chunked copy)",
    )
)
