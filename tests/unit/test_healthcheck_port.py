"""`proj healthcheck --role admin|flower --port N`: the probe asks the port it is given (a
container that serves the admin or Flower on another port than the default is not called
unhealthy), and a port where nothing answers fails it. Needs no service: a tiny HTTP server on a
free loopback port stands in for the admin's `/admin/healthz` and Flower's `/healthcheck`."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from proj.cli import cli


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        self.send_response(200 if self.path in ("/admin/healthz", "/healthcheck") else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server_port() -> Iterator[int]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("role", ["admin", "flower"])
def test_healthcheck_asks_the_port_it_is_given(role: str, server_port: int) -> None:
    result = CliRunner().invoke(
        cli, ["healthcheck", "--role", role, "--port", str(server_port), "--timeout", "2"]
    )
    assert result.exit_code == 0, result.output
    assert f":{server_port}: healthy" in result.output

    closed = _free_port()
    result = CliRunner().invoke(cli, ["healthcheck", "--role", role, "--port", str(closed), "--timeout", "2"])
    assert result.exit_code == 1, result.output
    assert f":{closed}: not answering" in result.output


def test_healthcheck_port_comes_from_the_environment(server_port: int) -> None:
    result = CliRunner().invoke(
        cli, ["healthcheck", "--role", "admin"], env={"PROJ_HEALTH_PORT": str(server_port)}
    )
    assert result.exit_code == 0, result.output
