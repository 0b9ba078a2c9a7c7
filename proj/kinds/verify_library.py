"""`verify_library` (periodic): check every library file, re-hash a rolling share of them, flag
corruption, queue a re-import.

Each run stats every file (gone, or another size: flagged at once) and re-hashes the least
recently verified files (a new file counts as verified by its import) against their recorded
sha256 until it has read 1/`VERIFY_CYCLE_RUNS`
(30) of the library's bytes, and at least `VERIFY_MIN_HASH_BYTES` (64 GiB). So every byte is
read at least once every 30 runs (a month at the daily default) whatever the library's size,
a library under 64 GiB is read whole every run, and a run's cost is bounded: a 20 TB library
reads about 680 GB a day (some 45 min at 250 MB/s) instead of all 20 TB every day. Rot that
keeps a file's size and mtime (a failing disk, a tool rewriting bytes under `touch -r`) shows
only in the bytes: it is found within one cycle. `VERIFY_CYCLE_RUNS=1` re-hashes everything
every run. Proof: `tests/integration/test_library_leftovers.py::
test_verify_library_finds_rot_that_keeps_size_and_mtime_within_its_cycle`,
`::test_verify_library_finds_a_truncated_or_missing_file_in_the_next_run`.
"""

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
from proj.settings import get_settings


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


def hash_budget(total_bytes: int) -> int:
    """Bytes to re-hash this run: 1/`VERIFY_CYCLE_RUNS` of the library (rounded up), and at
    least `VERIFY_MIN_HASH_BYTES`."""
    settings = get_settings()
    return max(-(-total_bytes // settings.verify_cycle_runs), settings.verify_min_hash_bytes)


def size_holds(path: Path, size: int) -> bool:
    """What a stat can tell, for every file every run: it is there, with its recorded size."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def bytes_hold(path: Path, sha256: str) -> bool:
    """The file reads whole and its sha256 is the recorded one. A read error (EIO from a failing
    disk) is damage too: it failed the step, and every run after stopped at the same file (the
    least recently verified comes first), flagging nothing and verifying nothing else again
    (`tests/integration/test_library_leftovers.py::
    test_verify_library_takes_a_file_it_cannot_read_for_corrupt_and_checks_the_others`)."""
    try:
        return library.sha256_file(path) == sha256
    except OSError:
        return False


# When a file's bytes were last known good: its last re-hash, else its import (whose copy was
# held to the verified sha256). Why not "never verified first": a library growing by its share
# between runs spent every run on its new files and never reached the old ones, whose rot then
# went unfound past the cycle (`tests/integration/test_library_leftovers.py::
# test_verify_library_reaches_its_old_files_while_new_ones_keep_arriving`).
last_checked = func.coalesce(LibraryItem.verified_at, LibraryItem.created_at)


def dropped_roots(items: list[LibraryItem], bad: set[int], checked_before: list[str]) -> list[str]:
    """Roots of damaged items that are gone now though they were there when the run began.

    Why: the roots are checked once, before the files; a disk unmounted while the run read (a
    long run) left its bare mount point, and every file after that failed its stat and was
    marked corrupt, each queuing a re-import, as the check at the start is there to prevent
    (`tests/integration/test_library_leftovers.py::
    test_verify_library_whose_disk_drops_midway_flags_the_root_not_the_files_after`).
    """
    suspects = sorted({i.root for i in items if i.id in bad} - set(checked_before))
    return [root for root in suspects if not root_available(Path(root))]


def verify(ctx: StepContext) -> dict[str, Any]:
    """Stat every `ok` item; re-hash the least recently verified, within `hash_budget`."""
    with db.transaction() as s:
        listed = list(
            s.scalars(
                select(LibraryItem)
                .where(LibraryItem.status == "ok")
                .order_by(last_checked.asc(), LibraryItem.id)
            )
        )
    unavailable = sorted({i.root for i in listed if not root_available(Path(i.root))})
    items = [i for i in listed if i.root not in unavailable]
    budget = hash_budget(sum(i.size for i in items))
    bad: set[int] = set()
    hashed: list[int] = []
    spent = 0
    for item in items:  # the least recently verified first
        ctx.checkpoint()
        path = item_path(item)
        if not size_holds(path, item.size):
            bad.add(item.id)
        elif spent < budget:
            spent += item.size
            hashed.append(item.id)
            if not bytes_hold(path, item.sha256):
                bad.add(item.id)
    for root in dropped_roots(items, bad, unavailable):
        unavailable.append(root)
        bad -= {i.id for i in items if i.root == root}
    result: dict[str, Any] = {
        "checked": len(items),
        "hashed": len(hashed),
        "hashed_bytes": spent,
        "corrupt": len(bad),
    }
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
            .where(LibraryItem.id.in_([i for i in hashed if i not in bad]))
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
        description="periodic: stat every library file, re-hash a rolling share, flag corruption, re-import",
    )
)
