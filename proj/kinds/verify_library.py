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


def verify(ctx: StepContext) -> dict[str, Any]:
    with db.transaction() as s:
        items = list(s.scalars(select(LibraryItem).where(LibraryItem.status == "ok")))
    bad: set[int] = set()
    for item in items:
        ctx.checkpoint()
        path = item_path(item)
        if not path.exists() or library.sha256_file(path) != item.sha256:
            bad.add(item.id)
    result = {"checked": len(items), "corrupt": len(bad)}
    with ctx.finish(result) as s:
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
