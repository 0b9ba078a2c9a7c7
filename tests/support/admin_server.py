"""`proj admin`'s app served by uvicorn in a thread on a free loopback port, for tests that need
real HTTP (browsers, curl hooks)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from proj.admin.app import create_app
from proj.qbt.local import free_port
from proj.settings import Settings
from tests.support.services import wait_for


@contextmanager
def serve_admin(settings: Settings) -> Iterator[str]:
    """Serve the admin app until the block ends; yields its base URL once `/admin/healthz` answers."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="admin-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/admin/healthz", timeout=1).text == "ok"
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 20, what="admin server")
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
