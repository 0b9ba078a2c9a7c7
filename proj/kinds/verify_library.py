"""`verify_library` (periodic): re-hash library files, flag corruption, queue a re-import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

import outbox
from proj import db
from proj.acquisition import library, service
from proj.acquisition.models import LibraryItem
from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.kinds.common import library_path
from proj.kinds.reconcile_downloads import PeriodicInput, flag


def item_path(item: LibraryItem) -> Path:
    return library_path(item.download_task_id, item.rel_path, Path(item.root))


def mark_corrupt(s: Session, item: LibraryItem) -> bool:
    """`ok` → `corrupt`, only if the row is still the copy that was checked (same place, same
    digest): a re-import or a relocation that landed meanwhile is not flagged. Whether it landed."""
    marked = s.execute(
        update(LibraryItem)
        .where(
            LibraryItem.id == item.id,
            LibraryItem.status == "ok",
            LibraryItem.root == item.root,
            LibraryItem.sha256 == item.sha256,
        )
        .values(status="corrupt")
    )
    return bool(marked.rowcount)


def root_available(root: Path) -> bool:
    """Whether a library root holds anything: a missing root or an empty one (the bare mount
    point of a disk that dropped) says nothing about its files' content.

    Why: with its NAS unmounted every file of a root is missing at once; taking each for
    corruption marked the whole library corrupt and queued a re-import of every request, copying
    it all again into the bare mount point on the system disk. Such a root is flagged and its
    items are left as they are (`tests/integration/test_library_review.py::
    test_verify_library_with_its_disk_gone_flags_the_root_not_every_file`).
    """
    try:
        return root.is_dir() and any(root.iterdir())
    except OSError:
        return False


def verify(ctx: StepContext) -> dict[str, Any]:
    with db.transaction() as s:
        listed = list(s.scalars(select(LibraryItem).where(LibraryItem.status == "ok")))
    unavailable = sorted({i.root for i in listed if not root_available(Path(i.root))})
    items = [i for i in listed if i.root not in unavailable]
    bad: set[int] = set()
    for item in items:
        ctx.checkpoint()
        path = item_path(item)
        if not path.exists() or library.sha256_file(path) != item.sha256:
            bad.add(item.id)
    result: dict[str, Any] = {"checked": len(items), "corrupt": len(bad)}
    if unavailable:
        result["unavailable_roots"] = unavailable
    with ctx.finish(result) as s:
        for root in unavailable:
            flag(s, "library_root_unavailable", root, items=sum(i.root == root for i in listed))
        for item in items:
            if item.id in bad and mark_corrupt(s, item):
                flag(s, "corrupt_file", str(item.id), path=str(item_path(item)))
                service.event(s, item.download_task_id, "corruption found", rel_path=item.rel_path)
                outbox.add(
                    s,
                    "import",
                    f"reimport:{item.download_task_id}:{ctx.input.bucket}",
                    {"download_task_id": str(item.download_task_id), "generation": ctx.input.bucket},
                )
        s.execute(
            update(LibraryItem)
            .where(LibraryItem.id.in_([i.id for i in items if i.id not in bad]))
            .values(verified_at=func.now())
        )
    return result


VERIFY_LIBRARY = register(
    Kind(
        name="verify_library",
        version=1,
        retry=RetryPolicy.file(),
        input_model=PeriodicInput,
        canvas=(step("verify", verify),),
        description="periodic: re-hash library files, flag corruption, queue a re-import",
    )
)
