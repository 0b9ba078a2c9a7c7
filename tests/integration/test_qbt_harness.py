"""The local qbittorrent-nox harness really moves data between two loopback clients."""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torf

from proj.qbt.local import (
    LocalQbittorrent,
    add_peer,
    add_torrent,
    make_torrent,
    pbkdf2_password_hash,
    render_ini,
    wait_complete,
    wait_seeding,
)
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import PAYLOAD_SIZES, QbtPayload, finished_hashes, sha256_tree

pytestmark = pytest.mark.timeout(180)

SEED_RATE = 1024 * 1024  # bytes/s: ~3 MiB payload then takes ~3 s, a transfer we can watch


def test_make_torrent_single_file_and_directory(tmp_path: Path) -> None:
    single = tmp_path / "one.bin"
    single.write_bytes(b"x" * 100_000)
    raw, infohash = make_torrent(single, tracker="http://127.0.0.1:1/announce")
    back = torf.Torrent.read_stream(raw)
    assert back.infohash == infohash and len(infohash) == 40 and infohash == infohash.lower()
    assert back.name == "one.bin" and back.trackers == [["http://127.0.0.1:1/announce"]]

    folder = tmp_path / "dir"
    (folder / "deep").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"a" * 5000)
    (folder / "deep" / "b.txt").write_bytes(b"b" * 7000)
    raw, infohash = make_torrent(folder, piece_size=16384)
    back = torf.Torrent.read_stream(raw)
    assert back.infohash == infohash and back.piece_size == 16384
    assert sorted(str(f) for f in back.files) == ["dir/a.txt", "dir/deep/b.txt"]


def test_password_hash_matches_qbittorrent_format() -> None:
    salt = bytes(range(16))
    salt_b64, key_b64 = pbkdf2_password_hash("pw", salt=salt).split(":")
    assert base64.b64decode(salt_b64) == salt
    assert base64.b64decode(key_b64) == hashlib.pbkdf2_hmac("sha512", b"pw", salt, 100_000, 64)
    ini = render_ini({"S": {"A/B": 'sh -c "x, y"', "Bytes": b"@ByteArray(q:w)", "T": True}})
    assert 'A\\B="sh -c \\"x, y\\""' in ini and 'Bytes="@ByteArray(q:w)"' in ini


def test_password_login_and_secret_not_leaked(
    qbt_factory: Callable[..., LocalQbittorrent],
) -> None:
    import qbittorrentapi

    secret = "Hunter2-not-in-logs"
    qbt = qbt_factory("auth", username="tester", password=secret, localhost_auth_bypass=False)
    assert qbt.client().app_preferences()["web_ui_username"] == "tester"
    bad = qbittorrentapi.Client(host=qbt.webui_url, username="tester", password="wrong")
    with pytest.raises(qbittorrentapi.LoginFailed):
        bad.auth_log_in()
    qbt.stop()
    texts = [repr(qbt), qbt.config_path.read_text(), qbt.log_tail(10_000)]
    assert all(secret not in t for t in texts)


def test_seeder_to_managed_transfer_fires_hook(
    qbt_seeder: LocalQbittorrent, qbt_managed: LocalQbittorrent, qbt_payload: QbtPayload
) -> None:
    seeder, managed = qbt_seeder.client(), qbt_managed.client()
    seeder.transfer_set_upload_limit(SEED_RATE)
    h = qbt_payload.infohash

    add_torrent(seeder, qbt_payload.torrent, h, save_path=qbt_payload.seed_save_path, seed=True)
    wait_seeding(seeder, h)

    started = time.monotonic()
    info = add_torrent(managed, qbt_payload.torrent, h, tags="managed")
    assert info.tags == "managed" and info.progress < 1.0
    add_peer(managed, h, qbt_seeder.peer_address)

    done = wait_complete(managed, h, timeout=60)
    elapsed = time.monotonic() - started
    print(f"transfer of {done.size} bytes took {elapsed:.1f}s")  # shown with -s
    assert done.size == sum(PAYLOAD_SIZES.values())
    assert elapsed > 1.5, "upload limit not applied: this was not a real rate-limited transfer"

    got = sha256_tree(Path(done.save_path) / qbt_payload.path.name)
    assert got == qbt_payload.digests

    deadline = time.monotonic() + 15  # the hook runs detached, just after completion
    while h not in finished_hashes(qbt_managed) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert finished_hashes(qbt_managed) == [h]

    # The bytes came from our seeder over loopback (its stats refresh lazily, so poll).
    deadline = time.monotonic() + 10
    while seeder.torrents_info(torrent_hashes=h)[0].uploaded < done.size:
        assert time.monotonic() < deadline, "seeder never accounted the upload"
        time.sleep(0.3)


def test_a_restart_keeps_its_web_ui_and_takes_a_new_peer_port_if_its_own_was_taken(
    qbt_factory: Callable[..., LocalQbittorrent],
) -> None:
    """While an instance is down another process may be given its peer port (any outgoing
    connection can get it). Restarted on it regardless, qBittorrent answered its API and reached
    no peer: a download stalled so in CI (`test_qbt_review.py::
    test_a_download_survives_qbittorrent_being_down_while_its_wait_rechecks`). The restart keeps
    the Web UI's port, which clients name, and listens on a fresh peer port instead."""
    import socket

    qbt = qbt_factory("restart")
    webui, listen = qbt.webui_port, qbt.listen_port
    qbt.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past its TIME_WAITs
        squatter.bind(("127.0.0.1", listen))
        squatter.listen()
        qbt.restart()
        assert qbt.webui_port == webui
        assert qbt.listen_port != listen
        with socket.create_connection(("127.0.0.1", qbt.listen_port), timeout=5):
            pass  # it accepts peers
    moved = qbt.listen_port
    qbt.restart()  # nobody took its port meanwhile: both ports kept
    assert (qbt.webui_port, qbt.listen_port) == (webui, moved)
