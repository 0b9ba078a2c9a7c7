"""pytest fixtures for the front door (`/api`, `/admin`): use with
`from tests.front_door_fixtures import *` (`tests/integration/test_front_door.py`,
`tests/integration/test_front_door_review.py`).

Why one place: both files built the same settings and the same bearer-token client, each its
own copy (`app_settings`/`api` and `settings`/`api`), and the review imported its secrets and
helpers from the other test module. `app_settings` is the process settings with the three
secrets set; `api` is the app as `proj admin` builds it (`create_app`), carrying the API token.
`api` re-raises a server exception in the test (a 500 fails at its cause); a module that wants a
500 seen as the user sees it overrides `raise_server_exceptions` to False (the review does).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from proj.admin.app import create_app
from proj.settings import Settings, get_settings
from tests.support.services import scalar, sql

__all__ = [
    "API_TOKEN",
    "HOOK_TOKEN",
    "PASSWORD",
    "api",
    "app_settings",
    "events",
    "post_request",
    "raise_server_exceptions",
    "written",
]

API_TOKEN = "api-" + uuid.uuid4().hex
HOOK_TOKEN = "hook-" + uuid.uuid4().hex
PASSWORD = "pw-" + uuid.uuid4().hex


@pytest.fixture
def app_settings() -> Settings:
    """The process settings with the admin password, the API token and the hook token set."""
    return get_settings().model_copy(
        update={
            "admin_password": SecretStr(PASSWORD),
            "api_token": SecretStr(API_TOKEN),
            "hook_token": SecretStr(HOOK_TOKEN),
        }
    )


@pytest.fixture
def raise_server_exceptions() -> bool:
    """Whether `api` re-raises a server exception in the test; override it in a module."""
    return True


@pytest.fixture
def api(app_settings: Settings, raise_server_exceptions: bool) -> Iterator[TestClient]:
    """The app (`create_app`) behind a client that sends `Authorization: Bearer API_TOKEN`."""
    with TestClient(create_app(app_settings), raise_server_exceptions=raise_server_exceptions) as c:
        c.headers["Authorization"] = f"Bearer {API_TOKEN}"
        yield c


def post_request(
    c: TestClient, data: bytes, headers: dict[str, str] | None = None, **fields: str
) -> httpx.Response:
    form = {"requester": "alice", **fields}
    files = {"torrent": ("film.torrent", data, "application/x-bittorrent")}
    return c.post("/api/requests", data=form, files=files, headers=headers or {})


def written() -> tuple[int, int, int, int]:
    """Every table a request, a decision or a signal could write."""
    return (
        scalar("SELECT count(*) FROM acq.download_task"),
        scalar("SELECT count(*) FROM acq.task_event"),
        scalar("SELECT count(*) FROM outbox.outbox_event"),
        scalar("SELECT count(*) FROM engine.task_signal"),
    )


def events(task_id: str) -> list[tuple[str, dict[str, Any]]]:
    rows = sql("SELECT what, detail FROM acq.task_event WHERE download_task_id = %s ORDER BY id", (task_id,))
    return [(w, d or {}) for w, d in rows]
