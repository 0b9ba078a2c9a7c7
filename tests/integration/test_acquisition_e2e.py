"""End to end on real parts: request → approve → download over loopback → library → webhook."""

from __future__ import annotations

import pytest

from proj import db
from proj.acquisition import qbt, service
from proj.acquisition.models import DownloadTask
from proj.engine.celery_engine import CeleryTaskEngine
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Receiver, Swarm
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import sha256_tree
from tests.support.services import dump_engine_state, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(240)


def request(swarm: Swarm, webhook: Receiver | None = None) -> object:
    with db.sessions().begin() as s:
        return service.request_download(
            s,
            requester="alice",
            torrent=swarm.payload.torrent,
            webhook_url=webhook.url if webhook else None,
        )


def task_status(task_id) -> str:
    return scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,))


def library_digests(swarm: Swarm, task_id) -> dict[str, str]:
    root = swarm.library / str(task_id) / swarm.payload.path.name
    return sha256_tree(root) if root.exists() else {}


def test_request_to_library_to_webhook(procs, swarm: Swarm, webhook: Receiver) -> None:
    procs.worker("w1", concurrency=2, env=swarm.worker_env())
    procs.beat(env=swarm.worker_env())
    task_id = request(swarm, webhook)
    acquire_key = f"acquire:{task_id}"
    wait_for(
        lambda: (
            scalar("SELECT status FROM engine.task_run WHERE idempotency_key = %s", (acquire_key,))
            == "waiting"
        ),
        30,
        what="acquire to park on the approval",
    )
    # Nothing is added before approval: qBittorrent holds no torrent, the ledger no operation.
    assert swarm.managed.client().torrents_info() == []
    assert scalar("SELECT count(*) FROM ledger.asset_operation") == 0

    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "operator")
    try:
        wait_for(lambda: task_status(task_id) == "notified", 120, what="the whole pipeline")
    except AssertionError:
        print(dump_engine_state(), procs.log("w1")[-6000:], sep="\n")
        raise

    # The library holds exactly the seeded bytes.
    assert library_digests(swarm, task_id) == swarm.payload.digests
    items = sql("SELECT rel_path, size, sha256 FROM acq.library_item WHERE download_task_id = %s", (task_id,))
    assert len(items) == len(swarm.payload.digests)
    # One torrent in qBittorrent, tagged as ours; one ledger result per operation.
    torrents = swarm.managed.client().torrents_info()
    assert [t.hash for t in torrents] == [swarm.payload.infohash]
    assert qbt.MANAGED_TAG in torrents[0].tags
    ops = sql("SELECT op_key, status FROM ledger.asset_operation ORDER BY op_key")
    assert [k for k, _ in ops].count(f"qbt-add:{task_id}") == 1
    assert all(st == "done" for _, st in ops), ops
    # The webhook was received exactly once, with the idempotency key.
    wait_for(lambda: webhook.keys(), 10, what="webhook")
    assert webhook.keys() == [f"notify:{task_id}"]
    # The on-finish hook (`proj signal download:<hash>`) ran and stored its signal.
    wait_for(swarm.hook_log.exists, 20, what="the on-finish hook")
    assert (
        scalar(
            "SELECT count(*) FROM engine.task_signal WHERE topic = %s",
            (f"download:{swarm.payload.infohash}",),
        )
        >= 1
    )
    events = [
        r[0]
        for r in sql("SELECT what FROM acq.task_event WHERE download_task_id = %s ORDER BY id", (task_id,))
    ]
    assert events[:2] == ["requested", "approved"]
    assert "imported" in events and events[-1] == "requester notified"
    with db.transaction() as s:
        assert s.get(DownloadTask, task_id).progress == 1.0
