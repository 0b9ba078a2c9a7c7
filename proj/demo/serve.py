"""The end of `proj demo`: how an operator does the same flow by CLI, browser and curl.

Without `--serve` the demo prints the three paths against a deployment of one's own. With
`--serve` it keeps its embedded stack up (Postgres, Redis, the swarm, worker and beat), serves
/admin and /api on loopback with fresh credentials, and prints the same paths with the real
URL, tokens and a .torrent to try, until Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    import uvicorn

ADMIN_PORT = 8088


@dataclass(frozen=True)
class FrontDoor:
    """Where the operator's three doors are, and the secrets that open them."""

    url: str
    admin_user: str
    admin_password: str
    api_token: str
    hook_token: str
    torrent: str  # a .torrent file to request
    env: dict[str, str]  # what a second terminal exports to use the CLI on this stack


def howto(door: FrontDoor | None) -> Text:
    """The operator's path, request → approve → library, three ways."""
    url = door.url if door else "http://127.0.0.1:8088"
    token = door.api_token if door else "$API_TOKEN"
    hook_token = door.hook_token if door else "$HOOK_TOKEN"
    torrent = shlex.quote(door.torrent) if door else "FILE.torrent"
    auth = f"{door.admin_user} / {door.admin_password}" if door else "ADMIN_USERNAME / ADMIN_PASSWORD"
    lines = []
    if door:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in door.env.items())
        lines += ["In another terminal, on this demo's stack:", f"  export {exports}", ""]
    lines += [
        "By CLI:",
        f"  ID=$(proj request {torrent} --requester you | head -1)",
        "  proj approve $ID",
        "  proj requests              # status, progress, size, age",
        "  proj reject ID --reason R  |  proj cancel ID",
        "",
        f"In a browser: {url}/admin  ({auth})",
        "  Requests → New request → upload the .torrent → Approve; the page follows it to the library.",
        "",
        "By curl (the JSON API; schema at /api/openapi.json):",
        f'  curl -sS -H "Authorization: Bearer {token}" -F torrent=@{torrent} -F requester=you \\',
        f"       {url}/api/requests",
        f'  curl -sS -X POST -H "Authorization: Bearer {token}" {url}/api/requests/ID/approve',
        f'  curl -sS -H "Authorization: Bearer {token}" {url}/api/requests/ID',
        "",
        "qBittorrent's on-finish hook, from its own host or container:",
        f'  curl -fsS -X POST -H "Authorization: Bearer {hook_token}" "{url}/api/hooks/qbittorrent?hash=%K"',
    ]
    if not door:
        lines += ["", "`proj demo --serve` keeps this demo's stack up and prints these with real values."]
    return Text("\n".join(lines))


def print_howto(console: Console, door: FrontDoor | None) -> None:
    """Plain lines, never cut or wrapped: every command must survive a copy and paste."""
    title = "try it yourself" if door else "the same flow, by CLI, browser and curl"
    console.rule(title, align="left")
    console.print(howto(door), soft_wrap=True, highlight=False)


def free_port(preferred: int = ADMIN_PORT) -> int:
    """`preferred` if it is free on loopback, else any free port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port on 127.0.0.1")


def start_admin(app: Any, port: int, timeout_s: float = 30.0) -> tuple[uvicorn.Server, threading.Thread]:
    """Serve `app` on 127.0.0.1:`port` from a thread; return once it accepts connections.

    Why: the demo printed "serving" and its curl commands as soon as the thread started, and a
    command run at once (on a loaded machine, the test's first POST) was refused before uvicorn
    had bound its socket (`tests/unit/test_demo_serve.py`)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="demo-admin", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the demo's admin server did not start on 127.0.0.1:{port}")
        time.sleep(0.02)
    return server, thread


def serve(console: Console, work: Path, torrent: bytes) -> None:
    """Serve /admin and /api on loopback until Ctrl-C, with fresh credentials printed once."""
    from pydantic import SecretStr

    from proj.admin.app import create_app
    from proj.settings import get_settings

    password, api_token, hook_token = (secrets.token_urlsafe(12) for _ in range(3))
    settings = get_settings().model_copy(
        update={
            "admin_password": SecretStr(password),
            "api_token": SecretStr(api_token),
            "hook_token": SecretStr(hook_token),
        }
    )
    port = free_port()
    server, thread = start_admin(create_app(settings), port)
    sample = work / "try-me.torrent"
    sample.write_bytes(torrent)
    env_names = ("DATABASE_URL", "BROKER_URL")
    door = FrontDoor(
        url=f"http://127.0.0.1:{port}",
        admin_user=settings.admin_username,
        admin_password=password,
        api_token=api_token,
        hook_token=hook_token,
        torrent=str(sample),
        env={k: os.environ[k] for k in env_names if os.environ.get(k)},
    )
    print_howto(console, door)
    console.print("serving until Ctrl-C …")
    try:
        while thread.is_alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping the demo's stack")
    finally:
        server.should_exit = True
        thread.join(10)
