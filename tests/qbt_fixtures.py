"""pytest fixtures around `proj.qbt.local`: use with `from tests.qbt_fixtures import *`.

`qbt_seeder` and `qbt_managed` are started qbittorrent-nox instances on loopback (function
scope); `qbt_payload` is random data with its .torrent. Every instance is stopped at test
teardown and a session-level check fails the run if any qbittorrent-nox we started survived.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proj.qbt.local import LocalQbittorrent, make_torrent, seed_save_path

__all__ = [
    "FINISHED_FILE",
    "QbtPayload",
    "finished_hashes",
    "qbt_factory",
    "qbt_managed",
    "qbt_no_strays",
    "qbt_payload",
    "qbt_seeder",
    "sha256_tree",
]

FINISHED_FILE = "finished.txt"
PAYLOAD_SIZES = {"part-a.bin": 2 * 1024 * 1024, "sub/part-b.bin": 1024 * 1024 + 12345}

_started_pids: set[int] = set()


def sha256_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, keyed by relative posix path."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def finished_hashes(qbt: LocalQbittorrent) -> list[str]:
    """Infohashes the managed instance's on-finished hook has written so far."""
    path = qbt.profile_dir / FINISHED_FILE
    return path.read_text().split() if path.exists() else []


@dataclass(frozen=True)
class QbtPayload:
    """Random data on disk plus its .torrent: what a seeder shares."""

    path: Path
    torrent: bytes
    infohash: str
    digests: dict[str, str]

    @property
    def seed_save_path(self) -> Path:
        return seed_save_path(self.path)


def _pgrep_qbittorrent() -> set[int]:
    """Pids of running qbittorrent-nox processes, read from /proc (no tool that may be missing)."""
    pids = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "qbittorrent-nox":  # comm keeps 15 characters: it fits
                pids.add(int(comm.parent.name))
        except OSError:  # the process ended meanwhile
            continue
    return pids


@pytest.fixture(scope="session")
def qbt_no_strays() -> Iterator[None]:
    """Session teardown: no qbittorrent-nox started by these tests may still run."""
    yield
    strays = _pgrep_qbittorrent() & _started_pids
    for pid in strays:  # don't leave them behind even when failing
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not strays, f"stray qbittorrent-nox processes after tests: {sorted(strays)}"


@pytest.fixture
def qbt_factory(
    tmp_path_factory: pytest.TempPathFactory, qbt_no_strays: None
) -> Iterator[Callable[..., LocalQbittorrent]]:
    """Start named instances (kwargs go to LocalQbittorrent); all are stopped at teardown."""
    if shutil.which("qbittorrent-nox") is None:
        pytest.fail(
            "qbittorrent-nox is not installed: run `bash scripts/setup` (apt-get install qbittorrent-nox)"
        )
    instances: list[LocalQbittorrent] = []

    def start(name: str, **kwargs: object) -> LocalQbittorrent:
        # Short dirs: the IPC socket path inside the profile must stay under 108 bytes.
        profile = kwargs.pop("profile_dir", None) or tmp_path_factory.mktemp(f"qbt-{name}")
        qbt = LocalQbittorrent(Path(profile), name=name, **kwargs)  # type: ignore[arg-type]
        instances.append(qbt)
        qbt.start()
        if qbt.pid:
            _started_pids.add(qbt.pid)
        return qbt

    yield start
    for qbt in reversed(instances):
        qbt.stop()


@pytest.fixture
def qbt_seeder(qbt_factory: Callable[..., LocalQbittorrent]) -> LocalQbittorrent:
    """A plain instance meant to seed locally generated data."""
    return qbt_factory("seeder")


@pytest.fixture
def qbt_managed(
    qbt_factory: Callable[..., LocalQbittorrent], tmp_path_factory: pytest.TempPathFactory
) -> LocalQbittorrent:
    """The 'managed' downloader; its on-finished hook appends %K (the torrent id) to
    profile_dir/finished.txt."""
    profile = tmp_path_factory.mktemp("qbt-managed")
    hook = f'sh -c "echo %K >> {profile / FINISHED_FILE}"'
    return qbt_factory("managed", profile_dir=profile, on_finished=hook)


@pytest.fixture
def qbt_payload(tmp_path_factory: pytest.TempPathFactory) -> QbtPayload:
    """~3 MiB of random data in two files (one in a subdir) and its multi-file .torrent."""
    root = tmp_path_factory.mktemp("qbt-data") / "payload"
    for rel, size in PAYLOAD_SIZES.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(os.urandom(size))
    torrent, infohash = make_torrent(root, piece_size=64 * 1024)
    return QbtPayload(path=root, torrent=torrent, infohash=infohash, digests=sha256_tree(root))
