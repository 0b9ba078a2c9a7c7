"""`proj demo --serve` prints its curl commands only once its admin server accepts connections
(`proj.demo.serve.start_admin`). Before, it printed them as soon as the server's thread started,
and in one CI run the test's first POST, on a loaded machine, was refused ("Connection refused")
before uvicorn had bound its socket."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from proj.demo.serve import free_port, start_admin


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_admin_server_accepts_connections_once_started(monkeypatch: pytest.MonkeyPatch) -> None:
    real_startup = uvicorn.Server.startup

    async def slow_startup(self: uvicorn.Server, *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(1.0)  # a loaded machine: the socket is bound a second after the thread starts
        await real_startup(self, *args, **kwargs)

    monkeypatch.setattr(uvicorn.Server, "startup", slow_startup)
    port = free_port(0)
    began = time.monotonic()
    server, thread = start_admin(FastAPI(), port)
    try:
        assert _accepts(port)
        assert time.monotonic() - began >= 1.0
    finally:
        server.should_exit = True
        thread.join(10)
    assert not thread.is_alive()


# uvicorn ends its thread with SystemExit when it cannot bind
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_admin_server_that_cannot_bind_is_an_error_not_a_hang() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(RuntimeError, match=f"did not start on 127.0.0.1:{port}"):
            start_admin(FastAPI(), port, timeout_s=20)
        assert time.monotonic() - began < 10
