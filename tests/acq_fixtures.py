"""Fixtures for the acquisition service: a loopback swarm, a library, a webhook receiver."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from proj.qbt.local import LocalQbittorrent, add_torrent, wait_seeding
from tests.qbt_fixtures import QbtPayload

VENV_BIN = Path(sys.executable).parent


@dataclass
class Receiver:
    """A local webhook endpoint that counts what it receives (idempotency keys included)."""

    url: str
    calls: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def keys(self) -> list[str]:
        with self.lock:
            return [c["key"] for c in self.calls]


@pytest.fixture
def webhook() -> Iterator[Receiver]:
    received: list[dict] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with lock:
                received.append({"key": self.headers.get("Idempotency-Key"), "body": json.loads(body)})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rec = Receiver(url=f"http://127.0.0.1:{server.server_address[1]}/hook", calls=received, lock=lock)
    yield rec
    server.shutdown()


@dataclass
class Swarm:
    """A seeding qBittorrent holding the payload and the managed one our workers drive."""

    seeder: LocalQbittorrent
    managed: LocalQbittorrent
    payload: QbtPayload
    library: Path
    downloads: Path

    @property
    def hook_log(self) -> Path:
        return self.library.parent / "hook.log"

    def worker_env(self, **extra: str) -> dict[str, str]:
        env = {
            "QBT_URL": self.managed.webui_url,
            "QBT_PEERS": self.seeder.peer_address,
            "LIBRARY_ROOT": str(self.library),
            "DOWNLOAD_DIR": str(self.downloads),
            "ACQ_DOWNLOAD_RECHECK_S": "30",
        }
        env.update(extra)
        return env


@pytest.fixture
def swarm(
    qbt_factory: Callable[..., LocalQbittorrent],
    qbt_payload: QbtPayload,
    tmp_path_factory: pytest.TempPathFactory,
) -> Swarm:
    """Seeder ready; managed client whose on-finish hook runs `proj signal download:%I`."""
    seeder = qbt_factory("seeder", upload_limit=2 * 1024 * 1024)
    add_torrent(
        seeder.client(),
        qbt_payload.torrent,
        qbt_payload.infohash,
        save_path=qbt_payload.seed_save_path,
        seed=True,
    )
    wait_seeding(seeder.client(), qbt_payload.infohash)
    base = tmp_path_factory.mktemp("acq")
    hook = f'sh -c "{VENV_BIN / "proj"} signal download:%I >> {base / "hook.log"} 2>&1"'
    # Reached through a test proxy too: its Host header must not be refused.
    lenient = {"Preferences": {"WebUI/HostHeaderValidation": False, "WebUI/CSRFProtection": False}}
    managed = qbt_factory("managed", on_finished=hook, extra_config=lenient)
    (base / "library").mkdir()
    (base / "downloads").mkdir()
    return Swarm(seeder, managed, qbt_payload, base / "library", base / "downloads")
