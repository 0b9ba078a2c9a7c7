"""`/metrics` against real Postgres and Redis: the numbers, the token, a database that is down or
locked (200 with `proj_database_up 0`, the reason's class and only what needs no database; never a
hang)."""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from proj.admin.app import create_app
from proj.admin.metrics import exported_series
from proj.settings import Settings, get_settings
from tests.conftest import PG_ADMIN_URL, new_key
from tests.support.services import pg_url, scalar, sql, wait_for

PASSWORD = "pw-" + uuid.uuid4().hex
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def settings_for(tmp: Path, **update: object) -> Settings:
    base = {"admin_password": SecretStr(PASSWORD), "library_root": str(tmp), "metrics_timeout_s": 1.0}
    return get_settings().model_copy(update={**base, **update})


@pytest.fixture
def scrape(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(tmp_path))) as c:
        yield c


def families(body: str) -> set[str]:
    """The metric families a scrape declares (with or without samples)."""
    return {fam.name for fam in text_string_to_metric_families(body)}


def samples(body: str) -> Samples:
    """Every sample of a scrape by (name, sorted labels)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(got: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in got, f"{name}{labels} not in the scrape: {sorted(k for k in got if k[0] == name)}"
    return got[key]


def _status(run_id: uuid.UUID) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def crashed_probe_run() -> uuid.UUID:
    """A probe run whose first step was claimed by a worker that died: running, lease expired,
    its attempt never closed. The sweeper takes it back (a lease recovery) and a worker runs it."""
    run_id = uuid.uuid4()
    token = uuid.uuid4()
    sql(
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status, "
        "started_at) VALUES (%s, 'probe', 1, %s, '{}', 'h', 'running', now())",
        (run_id, new_key()),
    )
    # The running attempt lives on its step row (`claimed_at`; migration 0011).
    sql(
        "INSERT INTO engine.step (run_id, stage, name, max_attempts, status, attempts, lease_token, "
        "lease_owner, lease_until, started_at, claimed_at, published_at) VALUES (%s, 0, 's1', 5, "
        "'running', 1, %s, 'gone:1', now() - interval '1 second', now(), now(), now())",
        (run_id, token),
    )
    return run_id


def outbox_rows() -> None:
    sql(
        "INSERT INTO outbox.outbox_event (kind, idempotency_key, payload, status, created_at) VALUES "
        "('notify', 'p-old', '{}', 'pending', now() - interval '120 seconds'), "
        "('notify', 'p-new', '{}', 'pending', now()), "
        "('notify', 'd-1', '{}', 'dead', now()), "
        "('notify', 'x-1', '{}', 'dispatched', now())"
    )


def test_scrape_reports_the_engine_state(inproc, scrape: TestClient, tmp_path: Path) -> None:
    probes = [inproc.enqueue("probe", {"n": i}, idempotency_key=new_key()).task_run_id for i in range(2)]
    failed = inproc.enqueue("flaky", {}, idempotency_key=new_key()).task_run_id
    parked = inproc.enqueue("gated", {"key": new_key(), "timeout_s": 300}, idempotency_key=new_key())
    topic = f"go:{new_key()[:12]}"
    woken = inproc.enqueue("signalled", {"topic": topic, "timeout_s": 300}, idempotency_key=new_key())
    crashed = crashed_probe_run()
    outbox_rows()
    wait_for(lambda: _status(woken.task_run_id) == "waiting", 20, what="signalled run to park")
    assert inproc.signal(topic, {"ok": True}) == 1
    everything = [*probes, failed, crashed, woken.task_run_id]
    wait_for(lambda: all(_status(r) in ("succeeded", "failed") for r in everything), 30, what="runs to end")
    wait_for(lambda: _status(parked.task_run_id) == "waiting", 20, what="gated run to park")
    assert _status(failed) == "failed" and _status(crashed) == "succeeded"

    r = scrape.get("/metrics")  # no Basic credentials: /metrics is not behind the admin's auth
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = samples(r.text)
    assert value(got, "proj_runs", kind="probe", version="1", status="succeeded") == 3
    assert value(got, "proj_runs", kind="flaky", version="1", status="failed") == 1
    assert value(got, "proj_runs", kind="gated", version="1", status="waiting") == 1
    assert value(got, "proj_dead_letters", kind="flaky") == 1
    assert ("proj_dead_letters", (("kind", "probe"),)) not in got
    assert value(got, "proj_steps", status="waiting") == 1
    assert value(got, "proj_steps", status="running") == 0
    assert value(got, "proj_outbox_events", status="pending") == 2
    assert value(got, "proj_outbox_events", status="dead") == 1
    assert value(got, "proj_outbox_events", status="dispatched") == 1
    assert 119 <= value(got, "proj_outbox_oldest_pending_seconds") < 600
    assert value(got, "proj_lease_recoveries_total") == 1
    assert value(got, "proj_workers_alive") == 1  # this process' liveness session (inproc worker)
    assert value(got, "proj_library_free_bytes") == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.05)
    assert value(got, "proj_database_up") == 1
    assert not [k for k in got if k[0] == "proj_database_error"]  # only while the database is down

    # Step durations per kind and step: every succeeded probe s1 (the recovered one too).
    assert value(got, "proj_step_duration_seconds_count", kind="probe", step="s1") == 3
    assert value(got, "proj_step_duration_seconds_sum", kind="probe", step="s1") > 0
    probe_s1 = {("kind", "probe"), ("step", "s1")}
    buckets = sorted(
        (float(dict(k[1])["le"]), v)
        for k, v in got.items()
        if k[0] == "proj_step_duration_seconds_bucket" and probe_s1 <= set(k[1])
    )
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (float("inf"), 3)
    parked_wait = ("proj_step_duration_seconds_count", (("kind", "gated"), ("step", "approval")))
    assert parked_wait not in got  # a parked wait is not a step's work
    # One signal woke one parked step, which was claimed again.
    assert value(got, "proj_signal_wake_seconds_count") == 1
    assert 0 < value(got, "proj_signal_wake_seconds_sum") < 30
    assert value(got, "proj_queue_messages", queue="engine") >= 0
    assert ("proj_queue_messages", (("queue", "probe.v1"),)) in got

    # Every series the collector declares is in a real scrape (what the dashboard relies on);
    # `proj_database_error` in one whose database is down (test_database_down_…), the outage
    # series while a step waits out an outage (`tests/integration/test_outages.py`).
    only_sometimes = {"proj_database_error", "proj_steps_in_outage", "proj_outage_oldest_seconds"}
    assert exported_series() - only_sometimes <= {name for name, _ in got}

    # Derived from the tables: another admin process (a restart) reports the same numbers.
    with TestClient(create_app(settings_for(tmp_path))) as again:
        regot = samples(again.get("/metrics").text)
    derived = {
        "proj_lease_recoveries_total",
        "proj_step_duration_seconds_count",
        "proj_signal_wake_seconds_count",
    }

    def pick(scraped: Samples) -> Samples:
        return {k: v for k, v in scraped.items() if k[0] in derived}

    assert pick(regot) == pick(got) and len(pick(got)) >= 3


def test_history_is_served_from_the_background_read(inproc, tmp_path: Path) -> None:
    """Finished counts and histograms come from the last background read (`METRICS_SLOW_S`);
    what alerts need (dead letters, live steps) is read at every scrape."""
    with TestClient(create_app(settings_for(tmp_path, metrics_slow_s=3600.0))) as c:
        assert value(samples(c.get("/metrics").text), "proj_signal_wake_seconds_count") == 0  # read once
        run_id = inproc.enqueue("probe", {}, idempotency_key=new_key()).task_run_id
        wait_for(lambda: _status(run_id) == "succeeded", 20, what="probe")
        sql(
            "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
            "VALUES (gen_random_uuid(), 'flaky', 1, %s, '{}', 'h', 'failed')",
            (new_key(),),
        )
        got = samples(c.get("/metrics").text)
        assert value(got, "proj_dead_letters", kind="flaky") == 1  # fast: now
        assert (
            "proj_runs",
            (("kind", "probe"), ("status", "succeeded"), ("version", "1")),
        ) not in got  # slow
    with TestClient(create_app(settings_for(tmp_path, metrics_slow_s=3600.0))) as fresh:
        assert (
            value(
                samples(fresh.get("/metrics").text),
                "proj_runs",
                kind="probe",
                version="1",
                status="succeeded",
            )
            == 1
        )


def test_queue_depth_is_read_from_the_broker(scrape: TestClient) -> None:
    from proj.celery import app

    for _ in range(3):  # no worker runs in this test: the messages stay in Redis
        app.send_task("probe.v1.s1", args=[0], queue="probe.v1")
    got = samples(scrape.get("/metrics").text)
    assert value(got, "proj_queue_messages", queue="probe.v1") == 3
    assert value(got, "proj_queue_messages", queue="flaky.v1") == 0


def test_broker_down_leaves_the_queue_metric_out(tmp_path: Path) -> None:
    settings = settings_for(tmp_path, broker_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(settings)) as c:
        r = c.get("/metrics")
    assert r.status_code == 200
    got = samples(r.text)
    assert not [k for k in got if k[0] == "proj_queue_messages"]
    assert value(got, "proj_steps", status="pending") == 0


def test_metrics_token(tmp_path: Path) -> None:
    token = "mt-" + uuid.uuid4().hex
    with TestClient(create_app(settings_for(tmp_path, metrics_token=SecretStr(token)))) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            r = c.get("/metrics", headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"] == "Unauthorized" and token not in r.text
            assert r.headers["www-authenticate"].startswith("Bearer")
        assert c.get("/metrics", auth=("admin", PASSWORD)).status_code == 401  # Basic is not the token
        r = c.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and "proj_runs" in r.text


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word: a hung Postgres (the kernel
    completes the handshake, nobody reads the startup packet)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        yield int(srv.getsockname()[1])


# What a scrape whose database did not answer holds: nothing read from Postgres.
WITHOUT_DATABASE = {
    "proj_database_up",
    "proj_database_error",
    "proj_queue_messages",
    "proj_library_free_bytes",
}


def test_database_down_answers_quickly_with_database_up_0(
    tmp_path: Path, silent_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The exporter convention (postgres_exporter's `pg_up`): 200, `proj_database_up 0`, the
    reason's short class, the broker's queue depth (it needs no database) and no family read from
    Postgres. Was a 503 JSON answer, so Prometheus saw the admin itself as down."""
    cases = {
        "refused": ("postgresql://postgres@127.0.0.1:1/proj", "connect_failed"),  # nothing listens
        # only the timeout ends it
        "silent": (f"postgresql://postgres@127.0.0.1:{silent_port}/proj", "connect_timeout"),
        "unmigrated": (PG_ADMIN_URL, "query_failed"),  # it connects; engine.task_run is not there
    }
    for case, (url, reason) in cases.items():
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="proj.admin.metrics"),
            TestClient(create_app(settings_for(tmp_path, database_url=url))) as c,
        ):
            began = time.monotonic()
            r = c.get("/metrics")
            took = time.monotonic() - began
        assert r.status_code == 200, (case, r.text)
        assert r.headers["content-type"].startswith("text/plain"), case
        got = samples(r.text)
        assert value(got, "proj_database_up") == 0, case
        assert [k for k in got if k[0] == "proj_database_error"] == [
            ("proj_database_error", (("reason", reason),))
        ], (case, r.text)
        assert value(got, "proj_database_error", reason=reason) == 1
        assert value(got, "proj_queue_messages", queue="engine") >= 0  # the broker still answers
        assert value(got, "proj_library_free_bytes") > 0
        assert families(r.text) == WITHOUT_DATABASE, (case, r.text)  # no stale or empty engine family
        # The full reason is logged, not put in a label.
        logged = [rec.getMessage() for rec in caplog.records if rec.name == "proj.admin.metrics"]
        assert any(m.startswith("metrics: database unavailable: ") for m in logged), (case, logged)
        if case == "silent":
            assert any("timeout" in m for m in logged), logged
        assert took < 15, f"{case}: a scrape of a dead database took {took:.1f}s"
        with TestClient(create_app(settings_for(tmp_path, database_url=url))) as c:
            page = c.get("/admin/overview", auth=("admin", PASSWORD))
        assert page.status_code == 503 and "database unavailable" in page.text  # a page for people


def test_locked_table_answers_database_up_0_within_the_statement_timeout(scrape: TestClient) -> None:
    """A locked table is a statement timeout: `proj_database_up 0` within the bound, and no
    history served from the cache of the scrape before (a stale number would look live)."""
    sql(
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "VALUES (gen_random_uuid(), 'probe', 1, %s, '{}', 'h', 'succeeded')",
        (new_key(),),
    )
    before = samples(scrape.get("/metrics").text)  # the history is read and cached
    assert value(before, "proj_database_up") == 1
    assert value(before, "proj_runs", kind="probe", version="1", status="succeeded") == 1
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with psycopg.connect(pg_url()) as conn:
            conn.execute("LOCK TABLE engine.task_run IN ACCESS EXCLUSIVE MODE")
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold_lock, daemon=True)
    holder.start()
    assert locked.wait(10)
    try:
        began = time.monotonic()
        r = scrape.get("/metrics")
        took = time.monotonic() - began
    finally:
        release.set()
        holder.join(10)
    assert r.status_code == 200, r.text
    got = samples(r.text)
    assert value(got, "proj_database_up") == 0
    assert value(got, "proj_database_error", reason="statement_timeout") == 1
    assert families(r.text) == WITHOUT_DATABASE, r.text
    assert took < 15, f"a scrape of a locked table took {took:.1f}s"
    again = scrape.get("/metrics")  # lock gone: answers again
    assert again.status_code == 200 and value(samples(again.text), "proj_database_up") == 1
    assert "proj_runs" in families(again.text) and "proj_database_error" not in {
        n for n, _ in samples(again.text)
    }


def test_queue_depth_from_rabbitmq_by_passive_declare() -> None:
    """AMQP brokers are read by a passive `queue_declare` (a queue of our own: the shared
    RabbitMQ's engine queues belong to whoever runs the suite on it)."""
    import kombu

    from proj.admin.metrics import amqp_depths

    url = "amqp://guest:guest@127.0.0.1:5672//"
    name, missing = f"metrics-test-{new_key()[:12]}", f"metrics-none-{new_key()[:12]}"
    with kombu.Connection(url, connect_timeout=5) as conn:
        queue = kombu.Queue(name, exchange=kombu.Exchange(name, type="direct"), routing_key=name)
        producer = conn.Producer()
        for i in range(2):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key=name, declare=[queue])
        try:
            # Publishes are not confirmed: the broker may count them a moment later.
            expected = {name: 2, missing: 0}
            wait_for(lambda: amqp_depths(url, [name, missing], 2.0) == expected, 10, what="2 messages")
        finally:
            queue(conn.channel()).delete()
            queue.exchange(conn.channel()).delete()


def test_a_non_ascii_metrics_token_matches(tmp_path: Path) -> None:
    """The header reaches the app decoded as latin-1; its UTF-8 bytes were compared as if
    re-encoded to UTF-8, so a non-ASCII `METRICS_TOKEN` could never match."""
    token = "mét-" + uuid.uuid4().hex
    with TestClient(create_app(settings_for(tmp_path, metrics_token=SecretStr(token)))) as c:
        r = c.get("/metrics", headers={"Authorization": b"Bearer " + token.encode()})
        assert r.status_code == 200 and "proj_runs" in r.text, r.text
        wrong = c.get("/metrics", headers={"Authorization": b"Bearer " + token.replace("é", "e").encode()})
        assert wrong.status_code == 401
