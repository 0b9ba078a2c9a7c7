"""A torrent with padding files (BEP 47), and a hybrid v1/v2 torrent (BEP 52), through a real
qBittorrent and the whole pipeline.

libtorrent (qBittorrent) writes no padding file: before, the import's piece check looked for
each one on disk and failed ("payload does not match the torrent: …/.pad/…"), so every such
request (a hybrid v1/v2 torrent has padding after nearly every file) became a dead letter. Now
the download is checked with the padding read as zeros and only the payload reaches the library.

A hybrid torrent is listed by qBittorrent under its v2 infohash cut to 40 hex digits, not its v1
infohash: before, the request looked the torrent up by the v1 one, found nothing after adding it
("qBittorrent did not list …") and never got past `add_torrent`. Now its id is what qBittorrent
lists (`torrents.torrent_id`). The parsing and the piece check alone:
`tests/unit/test_padding_files.py`."""

from __future__ import annotations

import hashlib
import os

import pytest

from proj import db
from proj.acquisition import service
from proj.engine.celery_engine import CeleryTaskEngine
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Swarm
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import QbtPayload, sha256_tree
from tests.support.services import dump_engine_state, scalar, sql, wait_for
from tests.support.torrents import hybrid, padded

pytestmark = pytest.mark.timeout(240)

SIZES = {"e01.mkv": 700_000, "subs/e01.srt": 3_000, "e02.mkv": 500_001}
PIECE = 64 * 1024
DONE = ("imported", "notified")  # no webhook: notified follows at once


@pytest.fixture(params=["v1", "hybrid"])
def qbt_payload(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> QbtPayload:
    """Overrides `tests.qbt_fixtures.qbt_payload`: three files, each padded to a piece boundary.
    "v1": a v1 torrent, every file but the last padded (`tests.support.torrents.padded`);
    "hybrid": a v1/v2 torrent as libtorrent makes one (`tests.support.torrents.hybrid`), which
    qBittorrent seeds only if its v1 pieces and its v2 merkle trees agree. `infohash` is the id
    qBittorrent lists it under."""
    root = tmp_path_factory.mktemp("padded") / "Show"
    for rel, size in SIZES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(size))
    if request.param == "hybrid":
        torrent, v1, infohash = hybrid(root, PIECE)
        assert infohash != v1
    else:
        torrent, infohash = padded(root, PIECE)
    return QbtPayload(path=root, torrent=torrent, infohash=infohash, digests=sha256_tree(root))


def test_a_torrent_with_padding_files_is_downloaded_checked_and_imported_without_them(
    procs, swarm: Swarm
) -> None:
    """Both payloads (`qbt_payload`): the hybrid one also shows the request finds the torrent in
    qBittorrent by the id it lists it under."""
    assert b".pad" in swarm.payload.torrent and not (swarm.payload.path / ".pad").exists()
    procs.worker("w1", concurrency=2, env=swarm.worker_env())
    procs.beat(env=swarm.worker_env())
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="alice", torrent=swarm.payload.torrent)
    stored = scalar("SELECT infohash FROM acq.download_task WHERE id = %s", (task_id,))
    assert stored == swarm.payload.infohash  # the id qBittorrent lists the torrent under
    wait_for(
        lambda: (
            scalar("SELECT status FROM engine.task_run WHERE idempotency_key = %s", (f"acquire:{task_id}",))
            == "waiting"
        ),
        30,
        what="acquire to park on the approval",
    )
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "operator")
    try:
        wait_for(
            lambda: (
                scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) in DONE
                or scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'")
            ),
            120,
            what="the download imported (or a run failed)",
        )
        assert scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) in DONE
    except AssertionError:
        print(dump_engine_state(), procs.log("w1")[-6000:], sep="\n")
        raise

    # qBittorrent wrote the payload and no padding; the library holds exactly the payload.
    downloaded = swarm.downloads / swarm.payload.path.name
    assert sha256_tree(downloaded) == swarm.payload.digests
    library = swarm.library / str(task_id) / swarm.payload.path.name
    assert sha256_tree(library) == swarm.payload.digests
    items = sql(
        "SELECT rel_path, size, sha256 FROM acq.library_item WHERE download_task_id = %s ORDER BY rel_path",
        (task_id,),
    )
    assert items == sorted(
        (f"Show/{rel}", size, hashlib.sha256((swarm.payload.path / rel).read_bytes()).hexdigest())
        for rel, size in SIZES.items()
    )
    assert scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'") == 0
