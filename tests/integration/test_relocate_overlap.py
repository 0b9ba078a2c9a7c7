"""Two relocates of one library item: never a row pointing at a deleted file, never a stray copy.

`proj/kinds/relocate.py`: a run whose copy finds an earlier relocate of the same item still live
fails at once, naming it (`runs.live_ahead`), and the switch is a compare-and-set on the root
the copy started from. Before, both runs copied and both switched: the row followed whichever
switched last and the other's full copy stayed behind, or, when one moved the item back, the
row pointed at the root whose file the other had just deleted.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

import proj.celery  # noqa: F401 - registers every kind
from proj import db
from proj.acquisition.models import DownloadTask, LibraryItem
from proj.engine import runs
from tests.acq_fixtures import *  # noqa: F403
from tests.conftest import new_key
from tests.support.services import dump_engine_state, scalar, sql, wait_for

SLOW_COPY = {"COPY_CHUNK_BYTES": "65536", "FAULT_CHUNK_DELAY_S": "0.05"}  # 64 KiB per 50 ms
REL = "Big/big.bin"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_status(run_id: uuid.UUID) -> str | None:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def wait_ended(procs, run_id: uuid.UUID, timeout: float = 60) -> str:  # noqa: ANN001 - conftest fixture
    try:
        wait_for(lambda: run_status(run_id) in ("succeeded", "failed", "canceled"), timeout, what="the run")
    except AssertionError:
        print(dump_engine_state())
        for name in procs.procs:
            print(f"--- {name}\n" + procs.log(name)[-4000:])
        raise
    return str(run_status(run_id))


def library_item(root: Path, size: int = 4 * 1024 * 1024) -> tuple[int, uuid.UUID, str]:
    """A finished request with one library file under `root`: (item id, task id, digest)."""
    task_id = uuid.uuid4()
    src = root / str(task_id) / REL
    src.parent.mkdir(parents=True)
    src.write_bytes(os.urandom(size))
    digest = sha256(src)
    with db.sessions().begin() as s:
        s.add(
            DownloadTask(
                id=task_id,
                requester="olga",
                title="Overlap",
                infohash=uuid.uuid4().hex[:40].ljust(40, "0"),
                torrent=b"-",
                files=[{"rel_path": "big.bin", "size": size}],
                total_size=size,
                status="notified",
            )
        )
        s.flush()
        item = LibraryItem(download_task_id=task_id, rel_path=REL, root=str(root), size=size, sha256=digest)
        s.add(item)
        s.flush()
        return item.id, task_id, digest


def relocate(item_id: int, new_root: Path) -> uuid.UUID:
    return runs.enqueue(
        "relocate", {"library_item_id": item_id, "new_root": str(new_root)}, idempotency_key=new_key()
    ).task_run_id


def copies(task_id: uuid.UUID, *roots: Path) -> list[Path]:
    """Every file of the task under the roots (temp files included)."""
    return sorted(
        p for r in roots if (r / str(task_id)).exists() for p in (r / str(task_id)).rglob("*") if p.is_file()
    )


def copy_underway(run_id: uuid.UUID, task_id: uuid.UUID, dst_root: Path) -> bool:
    """The copy step runs and has begun writing under `dst_root`, so its body has read the row.
    A step only claimed (status running) may not have read it yet: a row moved then is copied
    from where it was moved to, and the switch rightly lands (a CI run saw exactly that)."""
    running = scalar(
        "SELECT count(*) FROM engine.step WHERE run_id = %s AND name = 'copy' AND status = 'running'",
        (run_id,),
    )
    return running == 1 and bool(copies(task_id, dst_root))


def test_a_second_relocate_of_an_item_fails_at_once_and_leaves_one_copy(procs, tmp_path: Path) -> None:
    """While A → B copies, A → C is enqueued: C fails naming B's run, and exactly one copy of
    the file remains, the one the row points at. Before: both copied and switched, the row
    followed the last switch and a full copy stayed behind in the other root."""
    a, b, c = tmp_path / "lib-a", tmp_path / "lib-b", tmp_path / "lib-c"
    item_id, task_id, digest = library_item(a)
    procs.worker("w1", concurrency=2, env=SLOW_COPY)
    procs.beat(env=SLOW_COPY)

    first = relocate(item_id, b)
    wait_for(lambda: copy_underway(first, task_id, b), 30, what="the first copy to be underway")
    second = relocate(item_id, c)

    assert wait_ended(procs, second) == "failed"
    error = scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (second,))
    assert str(first) in str(error), error
    assert wait_ended(procs, first) == "succeeded"

    assert scalar("SELECT root FROM acq.library_item WHERE id = %s", (item_id,)) == str(b)
    assert copies(task_id, a, b, c) == [b / str(task_id) / REL]
    assert sha256(b / str(task_id) / REL) == digest
    events = sql(
        "SELECT what FROM acq.task_event WHERE download_task_id = %s AND what = 'relocated'", (task_id,)
    )
    assert len(events) == 1

    # Once the first has ended, the next relocate of the item runs.
    third = relocate(item_id, c)
    assert wait_ended(procs, third) == "succeeded"
    assert copies(task_id, a, b, c) == [c / str(task_id) / REL]


def test_a_switch_refuses_a_row_moved_since_its_copy_began(procs, tmp_path: Path) -> None:
    """The row moves to C while A → B copies (as a failed relocate retried by hand would move
    it): the switch must not point the row at B and delete A. It fails, removes its own copy at
    B, and the row still names C, whose file is intact. Before: the row named B and the moved
    item's root C held a copy nothing pointed at."""
    a, b, c = tmp_path / "lib-a", tmp_path / "lib-b", tmp_path / "lib-c"
    item_id, task_id, digest = library_item(a)
    procs.worker("w1", concurrency=1, env=SLOW_COPY)
    procs.beat(env=SLOW_COPY)

    run_id = relocate(item_id, b)
    wait_for(lambda: copy_underway(run_id, task_id, b), 30, what="the copy to be underway")
    moved = c / str(task_id) / REL
    moved.parent.mkdir(parents=True)
    shutil.copyfile(a / str(task_id) / REL, moved)
    with db.sessions().begin() as s:
        s.get(LibraryItem, item_id).root = str(c)  # type: ignore[union-attr]

    assert wait_ended(procs, run_id) == "failed"
    assert "refused" in str(scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (run_id,)))
    assert scalar("SELECT root FROM acq.library_item WHERE id = %s", (item_id,)) == str(c)
    assert sha256(moved) == digest
    assert copies(task_id, b) == [], "the refused switch left its copy behind"
    assert (a / str(task_id) / REL).exists(), "nothing pointed away from A through this run"
