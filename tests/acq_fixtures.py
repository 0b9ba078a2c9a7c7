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
    """Seeder ready; managed client whose on-finish hook runs `proj signal download:%K`."""
    base = tmp_path_factory.mktemp("acq")
    hook = f'sh -c "{VENV_BIN / "proj"} signal download:%K >> {base / "hook.log"} 2>&1"'
    return make_swarm(qbt_factory, qbt_payload, base, hook)


def curl_hook(url: str, token: str, log: Path) -> str:
    """qBittorrent's on-finish program in its cross-container form: the HTTP hook, by curl."""
    return (
        f"sh -c \"curl -fsS -X POST -H 'Authorization: Bearer {token}' "
        f"'{url}/api/hooks/qbittorrent?hash=%K' >> {log} 2>&1\""
    )


def make_swarm(
    qbt_factory: Callable[..., LocalQbittorrent], payload: QbtPayload, base: Path, hook: str
) -> Swarm:
    """A seeder sharing `payload`, and the managed client running `hook` when a torrent finishes."""
    seeder = qbt_factory("seeder", upload_limit=2 * 1024 * 1024)
    add_torrent(
        seeder.client(), payload.torrent, payload.infohash, save_path=payload.seed_save_path, seed=True
    )
    wait_seeding(seeder.client(), payload.infohash)
    # Reached through a test proxy too: its Host header must not be refused.
    lenient = {"Preferences": {"WebUI/HostHeaderValidation": False, "WebUI/CSRFProtection": False}}
    managed = qbt_factory("managed", on_finished=hook, extra_config=lenient)
    (base / "library").mkdir()
    (base / "downloads").mkdir()
    return Swarm(seeder, managed, payload, base / "library", base / "downloads")
