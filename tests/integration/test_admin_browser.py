"""`/admin` in a real browser: headless Debian Chromium driven by Playwright (no browser download).

An operator opens the dead letters, clicks "retry" after fixing the cause, and watches the run
continue (live progress, then `succeeded`) on the run page. Screenshots go to `artifacts/`.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from proj.settings import get_settings
from tests.conftest import new_key
from tests.kinds_admin import ADMIN_DDL
from tests.support.admin_server import serve_admin
from tests.support.services import ROOT, scalar, sql, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = ROOT / "artifacts"
PASSWORD = "pw-" + uuid.uuid4().hex


@pytest.fixture(autouse=True)
def chromium_installed() -> None:
    """A browser test that cannot run fails with the reason; it is never skipped silently."""
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        pytest.fail("Debian chromium is not installed: run `bash scripts/setup` (apt-get install chromium)")


@pytest.fixture
def admin_url() -> Iterator[str]:
    """The admin app served by uvicorn in a thread, against the test database."""
    sql(ADMIN_DDL)
    settings = get_settings().model_copy(update={"admin_password": SecretStr(PASSWORD)})
    with serve_admin(settings) as url:
        yield url


@pytest.fixture
def browser_page(admin_url: str):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(
            http_credentials={"username": "admin", "password": PASSWORD},
            viewport={"width": 1280, "height": 900},
        )
        page = context.new_page()
        page.set_default_timeout(20_000)
        try:
            yield page
        finally:
            context.close()
            browser.close()


def shot(page, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def wait_for_progress(page, timeout: float = 20.0) -> float:
    """Wait until the page shows a copy between 0 and 100 %; the page reloads itself meanwhile."""
    from playwright.sync_api import Error

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = page.locator("#progress .pct").first.text_content(timeout=1000) or ""
            pct = float(text.strip().rstrip("%"))
            if 0 < pct < 100:
                return pct
        except (Error, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError("the run page never showed live progress")


def _status(run_id: uuid.UUID) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def test_resolve_a_dead_letter_by_clicking(inproc, admin_url: str, browser_page) -> None:
    page = browser_page
    key = f"film-{new_key()[:8]}"
    run_id = inproc.enqueue(
        "mendable", {"key": key, "chunks": 40, "chunk_s": 0.1}, idempotency_key=f"req-{key}"
    ).task_run_id
    other = inproc.enqueue("mendable", {"key": "other-" + key}, idempotency_key=new_key()).task_run_id
    parked = inproc.enqueue("gated", {"key": key, "timeout_s": 300}, idempotency_key=new_key()).task_run_id
    done = inproc.enqueue("probe", {}, idempotency_key=new_key()).task_run_id
    wait_for(lambda: _status(run_id) == "failed" and _status(other) == "failed", 20, what="dead letters")
    wait_for(lambda: _status(parked) == "waiting" and _status(done) == "succeeded", 20, what="others")

    # The runs list, filtered by clicking through the form.
    page.goto(admin_url + "/admin/runs")
    assert page.locator(f'a[href="/admin/runs/{run_id}"]').count() == 1
    page.select_option('select[name="status"]', "failed")
    page.click('form.filters button[type="submit"]')
    page.wait_for_url("**/admin/runs?*status=failed*")
    assert page.locator(f'a[href="/admin/runs/{done}"]').count() == 0
    assert page.locator(f'a[href="/admin/runs/{run_id}"]').count() == 1
    page.fill('input[name="q"]', f"req-{key}")
    page.click('form.filters button[type="submit"]')
    assert page.locator("#runs tbody tr").count() == 1
    shot(page, "admin-runs")

    # The dead letters, with their business context; the operator fixes the cause, then retries.
    page.goto(admin_url + "/admin/dead")
    card = page.locator(f'.dead-letter[data-run="{run_id}"]')
    assert "unreachable" in card.inner_text() and "failed after 2/2 attempts" in card.inner_text()
    card.locator("summary").click()
    assert key in card.inner_text()
    shot(page, "admin-dead-letters")
    sql("INSERT INTO testkit_admin.fix (key, fixed) VALUES (%s, true)", (key,))
    card.locator('button[data-action="retry"]').click()
    page.wait_for_url(f"**/admin/runs/{run_id}")
    assert "retrying 1 failed step" in page.locator(".flash").inner_text()

    # Live progress while the copy runs (the page polls progress.json), then the run succeeds.
    wait_for_progress(page)
    assert "chunk" in page.locator("#progress").inner_text()
    shot(page, "admin-run-progress")
    page.wait_for_selector('#run-status[data-status="succeeded"]', timeout=30_000)
    timeline = page.locator("ol.timeline").inner_text()
    assert "source repaired by operator" in timeline and "succeeded" in timeline
    shot(page, "admin-run-succeeded")
    assert _status(run_id) == "succeeded"

    # Abandon the other dead letter (confirm dialog accepted): compensation, run ends canceled.
    page.goto(admin_url + "/admin/dead")
    page.once("dialog", lambda dialog: dialog.accept())
    other_card = page.locator(f'.dead-letter[data-run="{other}"]')
    other_card.locator('input[name="reason"]').fill("source gone")
    other_card.locator('button[data-action="abandon"]').click()
    page.wait_for_url(f"**/admin/runs/{other}")
    wait_for(lambda: _status(other) == "canceled", 20, what="abandoned run to end")
    page.reload()
    assert page.locator("#run-status").get_attribute("data-status") == "canceled"
    assert "abandoned: source gone" in page.locator("ol.timeline").inner_text()

    # A POST without the session's CSRF token is refused, even with valid credentials.
    status = page.evaluate(
        "async (url) => (await fetch(url, {method: 'POST', body: new URLSearchParams({x: '1'})})).status",
        f"{admin_url}/admin/runs/{run_id}/retry",
    )
    assert status == 403

    sql(  # an old version still draining, as during a rollout
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "VALUES (gen_random_uuid(), 'upgr', 1, %s, '{}', 'h', 'running')",
        (new_key(),),
    )
    for name in ("parked", "versions", "outbox"):
        page.goto(f"{admin_url}/admin/{name}")
        assert page.locator("h1").count() == 1
        shot(page, f"admin-{name}")
    page.goto(admin_url + "/admin/versions")
    assert page.locator("#versions tr.draining").inner_text().startswith("upgr@1")
    page.goto(admin_url + "/admin/parked")
    assert f"approval:{key}" in page.locator("#topics").inner_text()


def test_wrong_credentials_get_no_page(admin_url: str) -> None:
    from playwright.sync_api import Error, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(http_credentials={"username": "admin", "password": "wrong"})
            page = context.new_page()
            try:  # Chromium either shows the 401 or aborts the navigation, depending on version
                response = page.goto(admin_url + "/admin")
                assert response is not None and response.status == 401
            except Error as exc:
                assert "AUTH" in str(exc)
            assert "Dead letters" not in page.content()
            assert context.request.get(admin_url + "/admin/dead").status == 401
        finally:
            browser.close()
