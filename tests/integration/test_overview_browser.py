"""`/admin/overview` in headless Chromium after real runs: the SVG charts hold the numbers of the
database, the page runs under the CSP without complaint, and a screenshot goes to `artifacts/`."""

from __future__ import annotations

import re
import uuid

from tests.conftest import new_key
from tests.integration.test_admin_browser import admin_url, browser_page, chromium_installed, shot  # noqa: F401
from tests.support.services import scalar, sql, wait_for


def _status(run_id: uuid.UUID) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def bars(page, chart: str, **attrs: str) -> list[float]:
    """The `data-value` of the bars of one chart matching `attrs` (`series`, `label`)."""
    selector = f"#{chart} svg rect.datum" + "".join(f'[data-{k}="{v}"]' for k, v in attrs.items())
    return [float(v) for v in page.locator(selector).evaluate_all("els => els.map(e => e.dataset.value)")]


def test_overview_charts_show_the_engine_state(inproc, admin_url: str, browser_page) -> None:  # noqa: F811
    page = browser_page
    refusals: list[str] = []
    page.on("console", lambda msg: refusals.append(msg.text) if "Refused" in msg.text else None)
    probes = [
        inproc.enqueue(
            "probe", {"n": i, "slow_step": "s2", "slow_s": 0.3}, idempotency_key=new_key()
        ).task_run_id
        for i in range(3)
    ]
    failed = inproc.enqueue("flaky", {}, idempotency_key=new_key()).task_run_id
    parked = inproc.enqueue(
        "gated", {"key": new_key(), "timeout_s": 300}, idempotency_key=new_key()
    ).task_run_id
    sql(
        "INSERT INTO outbox.outbox_event (kind, idempotency_key, payload, status, created_at) VALUES "
        "('notify', 'p-1', '{}', 'pending', now() - interval '90 seconds'), "
        "('notify', 'p-2', '{}', 'pending', now()), ('notify', 'd-1', '{}', 'dead', now())"
    )
    wait_for(lambda: all(_status(r) == "succeeded" for r in probes), 30, what="probes")
    wait_for(lambda: _status(failed) == "failed" and _status(parked) == "waiting", 30, what="others")

    page.goto(admin_url + "/admin")
    page.click('header nav a[href="/admin/overview"]')
    page.wait_for_url("**/admin/overview")
    assert page.locator("header nav a.on").inner_text() == "Overview"
    assert page.locator("svg.chart").count() == 5

    # Runs finished in the last hour, stacked by status: the 3 probes and the dead letter.
    assert sum(bars(page, "chart-finished", series="succeeded")) == 3
    assert sum(bars(page, "chart-finished", series="failed")) == 1
    assert "succeeded 3" in page.locator("#chart-finished .legend").all_text_contents()
    # p50 <= p95 per kind; probe's slow s2 (0.3 s) puts its p95 well above 0.
    p50, p95 = (
        bars(page, "chart-durations", label="probe", series="p50"),
        bars(page, "chart-durations", label="probe", series="p95"),
    )
    assert len(p50) == len(p95) == 1 and 0 < p50[0] <= p95[0]
    assert p95[0] >= 0.25, "probe's slow step must show in its p95"
    assert bars(page, "chart-outbox", label="pending") == [2] and bars(
        page, "chart-outbox", label="dead"
    ) == [1]
    oldest = re.search(r"oldest pending: (\d+) s", page.locator("#chart-outbox").inner_text())
    assert oldest and 90 <= int(oldest.group(1)) < 600
    assert bars(page, "chart-parked", label="gated") == [1]
    assert bars(page, "chart-dead", label="flaky") == [1]
    assert page.locator("#chart-dead text", has_text="flaky").count() == 1  # the label is drawn
    assert page.locator("#workers-alive").inner_text() == "1"
    assert page.locator("script:not([src])").count() == 0  # no inline script
    shot(page, "admin-overview")
    assert not refusals, f"the CSP refused something: {refusals}"
