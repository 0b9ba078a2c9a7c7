"""`reconcile_downloads` and a torrent the operator added before the request (untagged).

`acquire.add_torrent` adopts such a torrent: the request downloads through it but never removes
it. Reconcile listed only tagged torrents, so it flagged every adopted download `missing_torrent`
while qBittorrent was downloading it. It now looks the untagged ones up by hash, and leaves the
operator's pause alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import proj.celery  # noqa: F401 - registers every kind
from proj import db
from proj.acquisition import qbt, service
from proj.acquisition.models import DownloadTask
from proj.engine import runs
from proj.qbt.local import add_torrent, make_torrent
from tests.acq_fixtures import *  # noqa: F403
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import QbtPayload
from tests.support.services import dump_engine_state, scalar, sql, wait_for

LENIENT = {"Preferences": {"WebUI/HostHeaderValidation": False, "WebUI/CSRFProtection": False}}


def test_reconcile_does_not_flag_an_adopted_download_missing_nor_resume_it(
    procs, qbt_factory, tmp_path: Path, qbt_payload: QbtPayload
) -> None:
    managed = qbt_factory("managed", extra_config=LENIENT)
    client = managed.client()
    # The operator's torrent, untagged, with no seeder: it stays downloading.
    add_torrent(client, qbt_payload.torrent, qbt_payload.infohash, save_path=tmp_path / "dl")
    # Another of the operator's, paused by them.
    paused_dir = tmp_path / "paused"
    paused_dir.mkdir()
    (paused_dir / "p.bin").write_bytes(os.urandom(60_000))
    paused, paused_hash = make_torrent(paused_dir)
    add_torrent(client, paused, paused_hash, save_path=tmp_path / "dl")
    client.torrents_pause(torrent_hashes=paused_hash)
    wait_for(
        lambda: client.torrents_info(torrent_hashes=paused_hash)[0].state in ("pausedDL", "stoppedDL"),
        30,
        what="the operator's pause",
    )
    with db.sessions().begin() as s:
        adopted = service.request_download(s, requester="ada", torrent=qbt_payload.torrent)
        held = service.request_download(s, requester="ada", torrent=paused)
        s.flush()
        s.get(DownloadTask, adopted).status = "downloading"
        s.get(DownloadTask, held).status = "downloading"
    procs.worker("w1", concurrency=1, env={"QBT_URL": managed.webui_url})

    run_id = runs.enqueue(
        "reconcile_downloads", {"bucket": 1}, idempotency_key="reconcile_downloads:1"
    ).task_run_id
    wait_for(
        lambda: (
            scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)) in ("succeeded", "failed")
        ),
        30,
        what="reconcile",
    )
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)) == "succeeded", (
        dump_engine_state()
    )

    assert sql("SELECT kind, subject FROM acq.flag") == []
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,)) == {
        "unknown": 0,
        "missing": 0,
        "resumed": 0,
        "woken": 0,
    }
    assert client.torrents_info(torrent_hashes=paused_hash)[0].state in ("pausedDL", "stoppedDL")
    assert not any(qbt.is_managed(t) for t in client.torrents_info()), "reconcile tagged nothing"
