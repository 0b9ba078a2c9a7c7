"""Migration 0015 gives a hybrid v1/v2 torrent's request the id qBittorrent lists the torrent
under (its v2 infohash cut to 40 hex digits) in place of the v1 infohash it was stored under,
which found nothing in qBittorrent; a v1 torrent's request keeps its id, and the downgrade
gives the hybrid one its v1 infohash back. Run on a scratch database of its own."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.schema import migrate, rows, scratch_database
from tests.support.torrents import hybrid, padded

BEFORE, AFTER = "0014_outages", "0015_hybrid_torrent_ids"


@pytest.fixture
def scratch() -> Iterator[str]:
    with scratch_database("hybrid_ids") as url:
        yield url


def _request(url: str, torrent: bytes, infohash: str) -> uuid.UUID:
    task = uuid.uuid4()
    rows(
        url,
        "INSERT INTO acq.download_task (id, requester, title, infohash, torrent, files, total_size, status) "
        "VALUES (%s, 'alice', 'Show', %s, %s, '[]', 1, 'approved')",
        (task, infohash, torrent),
    )
    return task


def _ids(url: str, *tasks: uuid.UUID) -> list[str]:
    return [rows(url, "SELECT infohash FROM acq.download_task WHERE id = %s", (t,))[0][0] for t in tasks]


def test_a_hybrid_request_takes_the_id_qbittorrent_lists_it_under(scratch: str, tmp_path: Path) -> None:
    root = tmp_path / "Show"
    root.mkdir()
    (root / "e01.mkv").write_bytes(os.urandom(40_000))
    (root / "e02.mkv").write_bytes(os.urandom(20_000))
    two, v1_of_hybrid, listed_as = hybrid(root, 16384)
    one, v1 = padded(root, 16384)
    migrate(scratch, BEFORE)
    stuck = _request(scratch, two, v1_of_hybrid)  # what a request stored before
    plain = _request(scratch, one, v1)

    migrate(scratch, AFTER)
    assert _ids(scratch, stuck, plain) == [listed_as, v1]

    migrate(scratch, BEFORE, down=True)
    assert _ids(scratch, stuck, plain) == [v1_of_hybrid, v1]
