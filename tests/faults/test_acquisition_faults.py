"""The acquisition pipeline under real faults. Every assertion reads qBittorrent, the library on
disk, the business tables and the ledger — never just "the engine said succeeded"."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from proj import db
from proj.acquisition import service
from proj.engine.celery_engine import CeleryTaskEngine
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Receiver, Swarm
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import sha256_tree
from tests.support import services
from tests.support.proxy import CutProxy
from tests.support.services import dump_engine_state, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(300)

SLOW_COPY = {"COPY_CHUNK_BYTES": "65536", "FAULT_CHUNK_DELAY_S": "0.05"}  # ~2.5 s per MiB


def start(swarm: Swarm, webhook: Receiver | None = None, approve: bool = True):
    with db.sessions().begin() as s:
        task_id = service.request_download(
            s,
            requester="bob",
            torrent=swarm.payload.torrent,
            webhook_url=webhook.url if webhook else None,
        )
    if approve:
        service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    return task_id


def status(task_id) -> str:
    return scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,))


def finish(procs, task_id, want: str = "imported", timeout: float = 150) -> None:
    """Wait for the business outcome: imported and its `notify` run done (or `want`)."""

    def reached() -> bool:
        if want != "imported":
            return status(task_id) == want
        notified = scalar("SELECT status FROM engine.task_run WHERE kind = 'notify'")
        return status(task_id) in ("imported", "notified") and notified == "succeeded"

    def done() -> bool:
        failed = scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'")
        return reached() or failed > 0

    try:
        wait_for(done, timeout, what=f"task to be {want}")
        assert reached(), "a run failed"
    except AssertionError:
        print(dump_engine_state())
        for name in procs.procs:
            print(f"--- {name}\n" + procs.log(name)[-4000:])
        raise


def library_ok(swarm: Swarm, task_id) -> None:
    """Every file present once, byte-identical; no temp files; one library row per file."""
    root = swarm.library / str(task_id)
    got = sha256_tree(root / swarm.payload.path.name)
    assert got == swarm.payload.digests
    assert not [p for p in root.rglob("*") if ".part-" in p.name], "temp files left behind"
    rows = scalar("SELECT count(*) FROM acq.library_item WHERE download_task_id = %s", (task_id,))
    assert rows == len(swarm.payload.digests)


def ledger_once() -> None:
    """One result per operation: no op key twice, every one finished."""
    rows = sql("SELECT op_key, status FROM ledger.asset_operation")
    assert len({k for k, _ in rows}) == len(rows)
    assert all(st == "done" for _, st in rows), rows


def one_torrent(swarm: Swarm) -> None:
    assert [t.hash for t in swarm.managed.client().torrents_info()] == [swarm.payload.infohash]


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".part-" in p.name]


def test_add_accepted_but_reply_lost_adds_exactly_one_torrent(procs, swarm: Swarm) -> None:
    host, port = swarm.managed.webui_url.removeprefix("http://").split(":")
    proxy = CutProxy((host, int(port)), match=b"/api/v2/torrents/add", cuts=1)
    try:
        env = swarm.worker_env(QBT_URL=proxy.url)
        procs.worker("w1", concurrency=2, env=env)
        procs.beat(env=env)
        task_id = start(swarm)
        finish(procs, task_id)
    finally:
        proxy.close()
    assert proxy.cut_done == 1, "the fault was injected"
    one_torrent(swarm)
    library_ok(swarm, task_id)
    ledger_once()
    # The add whose reply was lost: either qbittorrent-api re-sent it at once and qBittorrent kept
    # one torrent (the ledger's first attempt then saw it listed), or the step's next attempt
    # found it by infohash and recorded it as reconciled instead of adding it again.
    add = sql(
        "SELECT attempts, resolution FROM ledger.asset_operation WHERE op_key = %s", (f"qbt-add:{task_id}",)
    )
    assert add in ([(1, "effect")], [(2, "reconciled")]), add
    print(f"\nlost add reply: ledger (attempts, resolution) {add}")


def test_copy_done_but_not_committed_is_reconciled_not_redone(procs, swarm: Swarm) -> None:
    # The whole worker dies with its child (a lost host): a surviving main process would fork a
    # new child that copies the next file (and, with liveness, recovers this one) at once.
    env = swarm.worker_env(FAULT_KILL_AFTER_EFFECT="file", FAULT_KILL_SCOPE="group")
    procs.worker("victim", concurrency=1, env=env)
    procs.beat(env=swarm.worker_env())
    task_id = start(swarm)
    wait_for(
        lambda: procs.procs["victim"].poll() is not None,
        90,
        what="the worker to die after its first copy",
    )
    copied = [p for p in (swarm.library / str(task_id)).rglob("*") if p.is_file()]
    assert len(copied) == 1 and not temp_files(swarm.library)
    inode = copied[0].stat().st_ino
    procs.kill("victim")
    procs.worker("rescuer", concurrency=2, env=swarm.worker_env())
    finish(procs, task_id)
    assert copied[0].stat().st_ino == inode, "the finished copy was redone"
    library_ok(swarm, task_id)
    ledger_once()
    reconciled = sql(
        "SELECT result->>'reconciled', attempts FROM ledger.asset_operation "
        "WHERE op_key LIKE 'copy:%%' AND attempts > 1"
    )
    assert reconciled == [("true", 2)]


def test_postgres_connections_killed_mid_import(procs, swarm: Swarm) -> None:
    env = swarm.worker_env(**SLOW_COPY)
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    wait_for(lambda: temp_files(swarm.library), 90, what="copy underway")
    assert services.terminate_app_connections() > 0
    time.sleep(1.0)
    services.terminate_app_connections()
    finish(procs, task_id)
    library_ok(swarm, task_id)
    ledger_once()
    one_torrent(swarm)


def test_every_step_delivered_twice(procs, swarm: Swarm, webhook: Receiver) -> None:
    env = swarm.worker_env(FAULT_DUPLICATE_PUBLISH="2")
    procs.worker("w1", concurrency=2, env=env)
    procs.worker("w2", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm, webhook)
    finish(procs, task_id)
    library_ok(swarm, task_id)
    ledger_once()
    one_torrent(swarm)
    time.sleep(1.0)
    assert webhook.keys() == [f"notify:{task_id}"]
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'import'") == 1


def test_lease_lost_by_sigstop_during_a_copy(procs, swarm: Swarm) -> None:
    env = swarm.worker_env(**SLOW_COPY)
    procs.worker("frozen", concurrency=1, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    wait_for(lambda: temp_files(swarm.library), 90, what="copy underway")
    procs.signal("frozen", signal.SIGSTOP)
    procs.worker("awake", concurrency=2, env=env)
    finish(procs, task_id)
    procs.signal("frozen", signal.SIGCONT)
    # The stale attempt wakes, reaches its next checkpoint and finds its lease gone.
    wait_for(lambda: "lease lost" in procs.log("frozen"), 30, what="the stale copy to be refused")
    library_ok(swarm, task_id)
    ledger_once()
    attempts = sql("SELECT attempts FROM ledger.asset_operation WHERE op_key LIKE 'copy:%%'")
    assert max(a for (a,) in attempts) >= 2, "one copy was taken over by a second attempt"


def test_cancel_during_download_compensates(procs, qbt_factory, qbt_payload, tmp_path) -> None:
    seeder = qbt_factory("slowseed", upload_limit=64 * 1024)  # ~50 s for the payload
    from proj.qbt.local import add_torrent, wait_seeding

    add_torrent(
        seeder.client(),
        qbt_payload.torrent,
        qbt_payload.infohash,
        save_path=qbt_payload.seed_save_path,
        seed=True,
    )
    wait_seeding(seeder.client(), qbt_payload.infohash)
    managed = qbt_factory("managed")
    (tmp_path / "library").mkdir()
    (tmp_path / "downloads").mkdir()
    swarm = Swarm(seeder, managed, qbt_payload, tmp_path / "library", tmp_path / "downloads")
    env = swarm.worker_env()
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    wait_for(lambda: any(p.is_file() for p in swarm.downloads.rglob("*")), 60, what="download")
    assert service.cancel_download(CeleryTaskEngine(), db.sessions(), task_id, "user") == 1
    finish(procs, task_id, want="canceled", timeout=60)
    assert managed.client().torrents_info() == []
    assert not [p for p in swarm.downloads.rglob("*") if p.is_file()], "partial download left"
    assert scalar("SELECT status FROM engine.task_run WHERE kind = 'acquire'") == "canceled"
    assert scalar("SELECT status FROM engine.task_run WHERE kind = 'compensate'") == "succeeded"
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'import'") == 0


def test_cancel_during_copy_compensates(procs, swarm: Swarm) -> None:
    env = swarm.worker_env(**SLOW_COPY)
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    wait_for(lambda: temp_files(swarm.library), 90, what="copy underway")
    assert service.cancel_download(CeleryTaskEngine(), db.sessions(), task_id, "user") == 1
    finish(procs, task_id, want="canceled", timeout=60)
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE kind = 'compensate'") == "succeeded",
        30,
        what="compensation",
    )
    assert swarm.managed.client().torrents_info() == []
    assert not temp_files(swarm.library)
    assert not [p for p in swarm.library.rglob("*") if p.is_file()], "partial import left"
    assert scalar("SELECT count(*) FROM acq.library_item") == 0
    assert scalar("SELECT status FROM engine.task_run WHERE kind = 'import'") == "canceled"
