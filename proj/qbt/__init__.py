"""Local qBittorrent harness (qbittorrent-nox on loopback) shared by tests and the demo."""

from proj.qbt.local import (
    LocalQbittorrent,
    QbtHarnessError,
    add_peer,
    add_torrent,
    live_pids,
    make_torrent,
    qbittorrent_version,
    seed_save_path,
    wait_complete,
    wait_for_torrent,
    wait_seeding,
)

__all__ = [
    "LocalQbittorrent",
    "QbtHarnessError",
    "add_peer",
    "add_torrent",
    "live_pids",
    "make_torrent",
    "qbittorrent_version",
    "seed_save_path",
    "wait_complete",
    "wait_for_torrent",
    "wait_seeding",
]
