"""A full library disk (issue #18, item 3): LIBRARY_ROOT on a small tmpfs of its own.

- Too small from the start: `import` refuses before the first byte is copied (no copy ledger
  operation exists), retries, then dead-letters with "library full: needs N bytes, M free".
- Filled in the middle of a copy (another writer takes the rest): the copy fails with that
  reason, its temp file is gone, no partial file is in the library, and the run dead-letters.
- Either way, once space is freed, `proj resolve RUN --retry` completes it: the exact bytes in
  the library, one webhook.
A machine where tmpfs cannot be mounted fails these tests with the reason.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from proj import db
from proj.acquisition import service
from proj.engine.celery_engine import CeleryTaskEngine
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Receiver, Swarm
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import sha256_tree
from tests.support.disks import fill
from tests.support.services import dump_engine_state, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(240)
PROJ = str(Path(sys.executable).parent / "proj")


@pytest.fixture
def small_library(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "small-library"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the library (root needed): {mounted.stderr.decode()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def resize(root: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(root)], check=True)


def request_and_approve(swarm: Swarm, webhook: Receiver) -> uuid.UUID:
    with db.sessions().begin() as s:
        task_id = service.request_download(
            s, requester="alice", torrent=swarm.payload.torrent, webhook_url=webhook.url
        )
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    return task_id


def import_run(task_id: uuid.UUID) -> tuple[uuid.UUID, str, dict | None]:
    rows = sql(
        "SELECT id, status, last_error FROM engine.task_run WHERE idempotency_key = %s",
        (f"import:{task_id}",),
    )
    return rows[0] if rows else (None, "", None)


def dead_letter(task_id: uuid.UUID, procs) -> dict:
    try:
        wait_for(lambda: import_run(task_id)[1] == "failed", 120, what="the import to dead-letter")
    except AssertionError:
        print(dump_engine_state(), procs.log("w1")[-4000:], sep="\n")
        raise
    return import_run(task_id)[2] or {}


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and ".part-" in p.name)


def resolve_and_finish(task_id: uuid.UUID, swarm: Swarm, webhook: Receiver, root: Path) -> None:
    run_id = import_run(task_id)[0]
    done = subprocess.run([PROJ, "resolve", str(run_id), "--retry"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    wait_for(
        lambda: scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) == "notified",
        120,
        what="the resolved import to reach the library and the requester",
    )
    assert sha256_tree(root / str(task_id) / swarm.payload.path.name) == swarm.payload.digests
    assert leftovers(root) == []
    items = scalar("SELECT count(*) FROM acq.library_item WHERE download_task_id = %s", (task_id,))
    assert items == len(swarm.payload.digests)
    wait_for(webhook.keys, 15, what="the webhook")
    assert webhook.keys() == [f"notify:{task_id}"]


def test_import_checks_free_space_before_copying(
    procs, swarm: Swarm, webhook: Receiver, small_library: Path
) -> None:
    """2 MiB of library for a 3 MiB payload: refused before any copy, then resolved."""
    env = swarm.worker_env(LIBRARY_ROOT=str(small_library))
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = request_and_approve(swarm, webhook)
    err = dead_letter(task_id, procs)
    total = sum(f.stat().st_size for f in swarm.payload.path.rglob("*") if f.is_file())
    assert f"library full: needs {total} bytes" in err["message"], err
    assert " free on " in err["message"] and err.get("step") == "verify", err
    assert scalar("SELECT count(*) FROM ledger.asset_operation WHERE op_key LIKE 'copy:%%'") == 0
    assert [p for p in small_library.rglob("*") if p.is_file()] == []
    resize(small_library, "16m")  # the operator frees space
    resolve_and_finish(task_id, swarm, webhook, small_library)


def test_library_filling_mid_copy_fails_clearly_and_leaves_nothing(
    procs, swarm: Swarm, webhook: Receiver, small_library: Path
) -> None:
    """Room for the payload at the start; another writer fills the disk during the copy."""
    resize(small_library, "5m")
    env = swarm.worker_env(
        LIBRARY_ROOT=str(small_library), FAULT_CHUNK_DELAY_S="0.4", COPY_CHUNK_BYTES="262144"
    )
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = request_and_approve(swarm, webhook)
    wait_for(lambda: leftovers(small_library), 120, interval=0.05, what="a copy to be under way")
    filler = fill(small_library)  # take every free byte left
    err = dead_letter(task_id, procs)
    assert "library full: needs" in err["message"] and " free on " in err["message"], err
    assert leftovers(small_library) == []  # the interrupted copy's temp file was removed
    in_library = [p for p in (small_library / str(task_id)).rglob("*") if p.is_file()]
    for p in in_library:  # a file in the library is whole, never partial
        rel = p.relative_to(small_library / str(task_id) / swarm.payload.path.name).as_posix()
        assert sha256_tree(p.parent)[p.name] == swarm.payload.digests[rel]
    filler.unlink()  # the operator frees space
    resolve_and_finish(task_id, swarm, webhook, small_library)


def test_an_import_waits_for_its_library_disk_and_writes_nothing_meanwhile(
    procs, swarm: Swarm, webhook: Receiver, tmp_path: Path
) -> None:
    """The library's disk is not mounted when the import runs: LIBRARY_ROOT lies on it, and only
    the bare mount point is there. Before, the copy's `mkdir -p` created LIBRARY_ROOT on the
    system disk and filled it (or the import spent its three attempts and left a dead letter).
    Now each attempt is an outage (`LibraryUnavailable`): none is spent, nothing is written
    under the mount point, the run says why it waits, and the import finishes once the disk is
    mounted."""
    mount_point = tmp_path / "nas"
    mount_point.mkdir()
    root = mount_point / "library"
    env = swarm.worker_env(LIBRARY_ROOT=str(root))
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = request_and_approve(swarm, webhook)
    verify = (
        "SELECT s.outages, s.attempts - s.outages FROM engine.step s JOIN engine.task_run r"
        " ON r.id = s.run_id WHERE r.idempotency_key = %s AND s.name = 'verify'"
    )
    key = (f"import:{task_id}",)
    wait_for(lambda: (sql(verify, key) or [(0, 0)])[0][0] >= 2, 60, what="two attempts to meet the outage")
    assert sql(verify, key)[0][1] == 0, dump_engine_state()
    assert list(mount_point.iterdir()) == []  # nothing on the system disk
    error = import_run(task_id)[2] or {}
    assert error.get("type") == "LibraryUnavailable" and "is its disk mounted?" in error["message"], error
    notes = "SELECT count(*) FROM acq.task_event WHERE download_task_id = %s AND what = %s"
    assert scalar(notes, (task_id, "library disk not mounted")) == 1  # on its timeline, once

    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the library (root needed): {mounted.stderr.decode()}")
    try:
        root.mkdir()  # the disk is back, with its library folder
        wait_for(
            lambda: scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) == "notified",
            120,
            what="the import to finish once the disk is mounted",
        )
        assert sha256_tree(root / str(task_id) / swarm.payload.path.name) == swarm.payload.digests
        assert import_run(task_id)[1] == "succeeded"
        wait_for(webhook.keys, 15, what="the webhook")
        assert webhook.keys() == [f"notify:{task_id}"]
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)
