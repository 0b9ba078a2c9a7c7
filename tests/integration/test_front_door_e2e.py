"""The operator's path end to end on real parts (issue #14).

Real workers and beat, a loopback swarm of two `qbittorrent-nox`, the admin app served over HTTP.
qBittorrent's on-finish hook is the cross-container form, curl to `/api/hooks/qbittorrent` with
`HOOK_TOKEN`, and the periodic re-check is set to 10 minutes: a run that finishes within the
test's time was woken by the hook, and the stored signal says so.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from proj.qbt.local import LocalQbittorrent
from proj.settings import get_settings
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Receiver, Swarm, curl_hook, make_swarm
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import QbtPayload, sha256_tree
from tests.support.admin_server import serve_admin
from tests.support.services import ROOT, dump_engine_state, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(300)

API_TOKEN = "api-" + uuid.uuid4().hex
HOOK_TOKEN = "hook-" + uuid.uuid4().hex
PASSWORD = "pw-" + uuid.uuid4().hex
RECHECK_S = "600"  # the periodic re-check cannot be what wakes the download wait here
ARTIFACTS = ROOT / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class Admin:
    url: str
    hook_log: Path

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_TOKEN}"}, timeout=30)


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[Admin]:
    """`proj admin`'s app over real HTTP on loopback, with the API and hook tokens set."""
    settings = get_settings().model_copy(
        update={
            "admin_password": SecretStr(PASSWORD),
            "api_token": SecretStr(API_TOKEN),
            "hook_token": SecretStr(HOOK_TOKEN),
        }
    )
    with serve_admin(settings) as url:
        yield Admin(url, tmp_path / "hook.log")


@pytest.fixture
def hooked_swarm(
    qbt_factory: Callable[..., LocalQbittorrent],
    qbt_payload: QbtPayload,
    tmp_path_factory: pytest.TempPathFactory,
    admin: Admin,
) -> Swarm:
    """The managed qBittorrent calls the admin's HTTP hook with curl when a download finishes."""
    base = tmp_path_factory.mktemp("acq")
    return make_swarm(qbt_factory, qbt_payload, base, curl_hook(admin.url, HOOK_TOKEN, admin.hook_log))


def start_workers(procs, swarm: Swarm) -> None:
    env = swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S=RECHECK_S)
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)


def task_status(task_id: str) -> str:
    return scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,))


def assert_delivered(swarm: Swarm, task_id: str, webhook: Receiver, admin: Admin) -> None:
    """Library bytes, one torrent, one webhook, and the wake came through the HTTP hook."""
    root = swarm.library / task_id / swarm.payload.path.name
    assert sha256_tree(root) == swarm.payload.digests
    torrents = swarm.managed.client().torrents_info()
    assert [t.hash for t in torrents] == [swarm.payload.infohash]
    wait_for(webhook.keys, 15, what="the webhook")
    assert webhook.keys() == [f"notify:{task_id}"]
    assert webhook.calls[0]["body"]["download_task_id"] == task_id
    # The on-finish hook ran curl against the API, which stored the signal that woke the wait.
    topic = f"download:{swarm.payload.infohash}"
    payloads = sql("SELECT payload FROM engine.task_signal WHERE topic = %s", (topic,))
    assert {"source": "qbittorrent hook"} in [p for (p,) in payloads], payloads
    wait_for(admin.hook_log.exists, 10, what="curl's output")
    assert f'"topic":"{topic}"' in admin.hook_log.read_text()
    ops = sql("SELECT op_key FROM ledger.asset_operation WHERE op_key = %s", (f"qbt-add:{task_id}",))
    assert len(ops) == 1


def test_api_request_approve_download_library_webhook_woken_by_the_http_hook(
    procs, admin: Admin, hooked_swarm: Swarm, webhook: Receiver
) -> None:
    swarm = hooked_swarm
    start_workers(procs, swarm)
    with admin.api() as api:
        files = {"torrent": ("payload.torrent", swarm.payload.torrent, "application/x-bittorrent")}
        form = {"requester": "alice", "title": "Payload", "webhook_url": webhook.url}
        created = api.post("/api/requests", data=form, files=files, headers={"Idempotency-Key": "k1"})
        assert created.status_code == 201, created.text
        task_id = created.json()["id"]
        assert api.post(f"/api/requests/{task_id}/approve", json={"by": "olga"}).status_code == 200
        try:
            wait_for(lambda: task_status(task_id) == "notified", 180, what="the whole pipeline")
        except AssertionError:
            print(dump_engine_state(), procs.log("w1")[-6000:], sep="\n")
            raise
        detail = api.get(f"/api/requests/{task_id}").json()
    assert detail["status"] == "notified" and detail["progress"] == 100.0
    whats = [e["what"] for e in detail["timeline"]]
    assert whats[:2] == ["requested", "approved"] and whats[-1] == "requester notified"
    assert detail["timeline"][1]["detail"] == {"by": "olga"}
    assert all(f["library"] and f["library"]["sha256"] for f in detail["files"])
    assert_delivered(swarm, task_id, webhook, admin)


def test_browser_upload_approve_download_library_webhook(
    procs, admin: Admin, hooked_swarm: Swarm, webhook: Receiver, tmp_path: Path
) -> None:
    """An operator in Chromium: upload the .torrent, approve, watch it reach the library."""
    from playwright.sync_api import expect, sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is not installed: run `bash scripts/setup` (apt-get install chromium)")
    swarm = hooked_swarm
    start_workers(procs, swarm)
    torrent_file = tmp_path / "Payload.torrent"
    torrent_file.write_bytes(swarm.payload.torrent)
    ARTIFACTS.mkdir(exist_ok=True)

    def shot(page, name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"front-door-{name}.png"), full_page=True)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(
            http_credentials={"username": "admin", "password": PASSWORD},
            viewport={"width": 1280, "height": 900},
        )
        page = context.new_page()
        page.set_default_timeout(20_000)
        page.on("dialog", lambda d: d.accept())
        try:
            page.goto(admin.url + "/admin")
            shot(page, "1-empty")
            page.set_input_files('#upload input[name="torrent"]', str(torrent_file))
            page.fill('#upload input[name="requester"]', "bob")
            page.fill('#upload input[name="webhook_url"]', webhook.url)
            page.click('#upload button[type="submit"]')
            page.wait_for_url("**/admin/requests/*")
            task_id = page.url.rsplit("/", 1)[1]
            assert page.locator("#request-status").inner_text() == "requested"
            shot(page, "2-requested")
            page.click('button[data-action="approve"]')
            page.wait_for_selector("text=approved by admin")
            shot(page, "3-approved")
            try:
                # The page reloads itself while the request moves (admin.js; the CSP forbids eval,
                # so this waits on the element, not on a script of the test's).
                expect(page.locator("#request-status")).to_have_text("notified", timeout=180_000)
            except Exception:
                print(dump_engine_state(), procs.log("w1")[-6000:], sep="\n")
                raise
            shot(page, "4-notified")
            files = page.locator("#files tbody tr")
            assert files.count() == len(swarm.payload.digests)
            shown = page.locator("#files").inner_text()
            for digest in swarm.payload.digests.values():
                assert digest in shown
            timeline = page.locator("#timeline").inner_text()
            assert "approved by admin" in timeline and "requester notified" in timeline
            page.goto(admin.url + "/admin")
            assert page.locator(f'tr[data-request="{task_id}"] .badge').inner_text() == "notified"
            shot(page, "5-list")
        finally:
            context.close()
            browser.close()
    assert_delivered(swarm, task_id, webhook, admin)
