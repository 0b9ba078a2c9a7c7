"""Defects found by review of the acquisition domain, each shown failing on the code before its fix.

Every assertion reads the library on disk, the business tables or qBittorrent.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest

import proj.celery  # noqa: F401 - registers every kind
from proj import db
from proj.acquisition import service
from proj.acquisition.models import DownloadTask, LibraryItem
from proj.engine import runs
from proj.engine.celery_engine import CeleryTaskEngine
from proj.qbt.local import add_torrent, make_torrent, wait_complete
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Swarm, make_swarm
from tests.conftest import new_key
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import QbtPayload, sha256_tree
from tests.support.services import dump_engine_state, scalar, sql, wait_for
from tests.support.torrents import multi_file

pytestmark = pytest.mark.timeout(120)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_status(run_id: uuid.UUID) -> str | None:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def wait_run(procs, run_id: uuid.UUID, timeout: float = 60) -> str:  # noqa: ANN001 - conftest fixture
    """Wait for the run to end; return its status (printing the engine state if it failed)."""
    try:
        wait_for(lambda: run_status(run_id) in ("succeeded", "failed", "canceled"), timeout, what="the run")
    except AssertionError:
        print(dump_engine_state())
        raise
    status = run_status(run_id)
    if status != "succeeded":
        print(dump_engine_state())
        for name in procs.procs:
            print(f"--- {name}\n" + procs.log(name)[-4000:])
    return status


def add_task(task_id: uuid.UUID, torrent: bytes, files: list[dict], status: str) -> None:
    with db.sessions().begin() as s:
        s.add(
            DownloadTask(
                id=task_id,
                requester="rita",
                title="Review",
                infohash=uuid.uuid4().hex[:40].ljust(40, "0"),
                torrent=torrent,
                files=files,
                total_size=sum(f["size"] for f in files),
                status=status,
            )
        )


# ----------------------------------------------------------------------------------- relocate


@pytest.mark.parametrize("spelling", ["trailing-slash", "dot-segment"])
def test_relocate_to_the_same_root_spelled_differently_keeps_the_file(
    procs, tmp_path: Path, spelling: str
) -> None:
    """`/lib/` (or `/lib/.`) names the root the item is already in: the copy lands on the file
    itself, and the switch must not then delete "the old copy" — it is the only one."""
    root = tmp_path / "lib"
    task_id = uuid.uuid4()
    rel = "Film/film.bin"
    path = root / str(task_id) / rel
    path.parent.mkdir(parents=True)
    path.write_bytes(os.urandom(300_000))
    digest = sha256(path)
    add_task(task_id, b"-", [{"rel_path": "film.bin", "size": 300_000}], "notified")
    with db.sessions().begin() as s:
        item = LibraryItem(
            download_task_id=task_id, rel_path=rel, root=str(root), size=300_000, sha256=digest
        )
        s.add(item)
        s.flush()
        item_id = item.id
    procs.worker("w1", concurrency=1)
    procs.beat()

    new_root = f"{root}/" if spelling == "trailing-slash" else f"{root}/."
    run_id = runs.enqueue(
        "relocate", {"library_item_id": item_id, "new_root": new_root}, idempotency_key=new_key()
    ).task_run_id
    assert wait_run(procs, run_id) == "succeeded"

    item_root = scalar("SELECT root FROM acq.library_item WHERE id = %s", (item_id,))
    assert (Path(item_root) / str(task_id) / rel).resolve() == path.resolve()
    assert path.exists(), "the library's only copy of the file was deleted"
    assert sha256(path) == digest


# ------------------------------------------------------------------------- temp-file names


def test_compensation_keeps_a_recorded_file_named_like_a_temp_file(procs, tmp_path: Path) -> None:
    """Torrent file names are untrusted: a file `.e01.mkv.part-x` next to `e01.mkv` is a library
    file of its own, not a temp file of `e01.mkv`. A recorded (imported) file is never removed by
    compensation; neither is one whose name holds glob characters."""
    root = tmp_path / "library"
    task_id = uuid.uuid4()
    names = ["e01.mkv", ".e01.mkv.part-x", "[e]01.mkv", ".e01.mkv.part-0123"]
    torrent = multi_file(*([n] for n in names), name="show")
    add_task(task_id, torrent, [{"rel_path": n, "size": 10} for n in names], "imported")
    folder = root / str(task_id) / "show"
    folder.mkdir(parents=True)
    with db.sessions().begin() as s:
        for n in names:
            (folder / n).write_bytes(n.encode().ljust(10, b"."))
            s.add(
                LibraryItem(
                    download_task_id=task_id, rel_path=f"show/{n}", root=str(root), size=10, sha256="0" * 64
                )
            )
    leftover = folder / ".e01.mkv.part-deadbeef"  # a real temp file of an interrupted copy
    leftover.write_bytes(b"partial")
    procs.worker("w1", concurrency=1, env={"LIBRARY_ROOT": str(root)})
    procs.beat(env={"LIBRARY_ROOT": str(root)})

    run_id = runs.enqueue(
        "compensate",
        {"run_id": str(uuid.uuid4()), "kind": "import", "input": {"download_task_id": str(task_id)}},
        idempotency_key=new_key(),
    ).task_run_id
    assert wait_run(procs, run_id) == "succeeded"

    assert sorted(p.name for p in folder.iterdir()) == sorted(names), "a recorded library file was removed"
    assert not leftover.exists()


# ------------------------------------------------------------- a one-file multi-file torrent


def test_import_of_a_multi_file_torrent_whose_only_file_has_the_torrents_name(procs, tmp_path: Path) -> None:
    """A folder `x` holding one file `x` is a multi-file torrent: qBittorrent keeps its folder
    (`<save>/x/x`); the import must copy that file, not try to copy the folder."""
    downloads, library_root = tmp_path / "downloads", tmp_path / "library"
    (downloads / "x").mkdir(parents=True)
    library_root.mkdir()
    (downloads / "x" / "x").write_bytes(os.urandom(100_000))
    torrent, _ = make_torrent(downloads / "x")
    assert b"5:files" in torrent, "torf made a multi-file torrent"
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="rita", torrent=torrent)
    sql("UPDATE acq.download_task SET status = 'downloaded' WHERE id = %s", (task_id,))
    env = {"LIBRARY_ROOT": str(library_root), "DOWNLOAD_DIR": str(downloads)}
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)

    run_id = runs.enqueue(
        "import", {"download_task_id": str(task_id)}, idempotency_key=f"import:{task_id}"
    ).task_run_id
    assert wait_run(procs, run_id) == "succeeded"
    copied = [p for p in (library_root / str(task_id)).rglob("*") if p.is_file()]
    assert [sha256(p) for p in copied] == [sha256(downloads / "x" / "x")]
    # then `notify` ends it (no webhook here), maybe already
    assert scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) in (
        "imported",
        "notified",
    )


def test_a_one_file_multi_file_torrent_end_to_end_through_qbittorrent(
    procs, qbt_factory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same torrent downloaded by a real qBittorrent: its layout is `<save>/x/x`."""
    data = tmp_path_factory.mktemp("one") / "x"
    data.mkdir()
    (data / "x").write_bytes(os.urandom(300_000))
    torrent, infohash = make_torrent(data, piece_size=64 * 1024)
    payload = QbtPayload(path=data, torrent=torrent, infohash=infohash, digests=sha256_tree(data))
    swarm = make_swarm(qbt_factory, payload, tmp_path_factory.mktemp("acq"), "true")
    procs.worker("w1", concurrency=2, env=swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="2"))
    procs.beat(env=swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="2"))
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="rita", torrent=torrent)
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    import_done = lambda: scalar(  # noqa: E731
        "SELECT status FROM engine.task_run WHERE idempotency_key = %s", (f"import:{task_id}",)
    )
    wait_for(lambda: import_done() in ("succeeded", "failed"), 90, what="the import")
    assert (swarm.downloads / "x" / "x").is_file(), "qBittorrent keeps a multi-file torrent's folder"
    assert import_done() == "succeeded", dump_engine_state()
    assert sha256_tree(swarm.library / str(task_id)) == {"x/x": payload.digests["x"]}


# ------------------------------------------------------------------- a torrent we did not add


def operators_torrent_then_request(procs, swarm: Swarm, tags: str | None = None, **env: str) -> uuid.UUID:  # noqa: ANN001
    """The operator's own torrent (no managed tag) is complete in qBittorrent; then the same
    torrent is requested and approved, and its add finds it there."""
    client = swarm.managed.client()
    add_torrent(client, swarm.payload.torrent, swarm.payload.infohash, save_path=swarm.downloads, tags=tags)
    client.torrents_add_peers(peers=swarm.seeder.peer_address, torrent_hashes=swarm.payload.infohash)
    wait_complete(client, swarm.payload.infohash, timeout=60)
    procs.worker("w1", concurrency=2, env=swarm.worker_env(**env))
    procs.beat(env=swarm.worker_env(**env))
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="rita", torrent=swarm.payload.torrent)
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    return task_id


def kind_status(kind: str) -> str | None:
    return scalar("SELECT status FROM engine.task_run WHERE kind = %s", (kind,))


def wait_add_done(task_id: uuid.UUID) -> None:
    op = f"qbt-add:{task_id}"
    wait_for(
        lambda: scalar("SELECT status FROM ledger.asset_operation WHERE op_key = %s", (op,)) == "done",
        60,
        what="the add",
    )


def cancel_and_compensate(task_id: uuid.UUID) -> None:
    service.cancel_download(CeleryTaskEngine(), db.sessions(), task_id, "user")
    wait_for(lambda: kind_status("compensate") in ("succeeded", "failed"), 60, what="compensation")
    assert kind_status("compensate") == "succeeded", dump_engine_state()


def operators_torrent_intact(swarm: Swarm) -> None:
    client = swarm.managed.client()
    assert [t.hash for t in client.torrents_info()] == [swarm.payload.infohash], "the operator's torrent"
    assert sha256_tree(swarm.downloads / swarm.payload.path.name) == swarm.payload.digests


def test_cancel_does_not_remove_a_torrent_the_task_did_not_add(procs, swarm: Swarm) -> None:
    """Canceling the request must not remove the operator's torrent, nor delete its files."""
    task_id = operators_torrent_then_request(procs, swarm)
    wait_add_done(task_id)
    cancel_and_compensate(task_id)
    operators_torrent_intact(swarm)


def test_the_seeding_goal_does_not_remove_a_torrent_the_task_did_not_add(procs, swarm: Swarm) -> None:
    """The request is imported from the operator's torrent; its seeding goal must not remove it."""
    task_id = operators_torrent_then_request(procs, swarm, SEED_TIME_S="1")
    wait_for(lambda: kind_status("retire_seed") in ("succeeded", "failed"), 90, what="the seeding goal")
    assert kind_status("retire_seed") == "succeeded", dump_engine_state()
    assert sha256_tree(swarm.library / str(task_id) / swarm.payload.path.name) == swarm.payload.digests
    operators_torrent_intact(swarm)


def test_a_tagged_torrent_found_by_the_add_is_ours_and_cancel_removes_it(procs, swarm: Swarm) -> None:
    """A torrent already listed with the managed tag when the add runs is this request's own: an
    earlier attempt's add that qBittorrent listed only after that attempt's reconcile had looked.
    It is not adopted, so the cancel's compensation removes it (no torrent leaks)."""
    from proj.acquisition import qbt

    task_id = operators_torrent_then_request(procs, swarm, tags=qbt.MANAGED_TAG)
    wait_add_done(task_id)
    result = scalar("SELECT result FROM ledger.asset_operation WHERE op_key = %s", (f"qbt-add:{task_id}",))
    assert not result.get("adopted"), result
    cancel_and_compensate(task_id)
    wait_for(lambda: swarm.managed.client().torrents_info() == [], 30, what="the torrent removed")


def test_a_request_without_a_webhook_finishes_notified_and_cannot_be_canceled(procs, swarm: Swarm) -> None:
    """With no webhook the notify step has nobody to tell, but the request has finished: it ends
    `notified` (not `imported` for ever), so a later cancel is refused instead of marking an
    imported request canceled and removing its seeding torrent."""
    procs.worker("w1", concurrency=2, env=swarm.worker_env())
    procs.beat(env=swarm.worker_env())
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="rita", torrent=swarm.payload.torrent)
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    wait_for(lambda: kind_status("notify") in ("succeeded", "failed"), 150, what="the notify run")
    assert kind_status("notify") == "succeeded", dump_engine_state()
    assert scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) == "notified"
    with pytest.raises(service.RequestConflict):
        service.cancel_download(CeleryTaskEngine(), db.sessions(), task_id, "too late")
    assert [t.hash for t in swarm.managed.client().torrents_info()] == [swarm.payload.infohash]
