"""Redis restarts must not kill workers (issue #18, item 5).

kombu 5.7's Redis transport can crash a Celery worker when the broker goes away while the
worker holds prefetched, unacknowledged messages and waits on a BRPOP: closing the collected
connection rebuilds a pool from a transport whose client was already cleared
(`AttributeError: 'NoneType' object has no attribute 'hostname'`, "Unrecoverable error").
`proj.transport.GuardedTransport` is our workaround; docs/upstream/kombu-restore-unacked.md the
report. Every Redis here is a private `redis-server` on its own port: the shared one on 6379
is never touched.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import kombu
import pytest
import redis

from proj.engine import runs
from tests.conftest import new_key
from tests.support.private import PrivateRedis, private_redis, use_broker
from tests.support.services import ProcessGroup, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(600)

RESTARTS = int(os.environ.get("FAULT_REDIS_RESTARTS", "6"))
STOCK = "kombu.transport.redis:Transport"
CRASH = "no attribute 'hostname'"


@pytest.fixture
def rds(tmp_path: Path) -> Iterator[PrivateRedis]:
    with private_redis(tmp_path) as server, use_broker(server.url):
        yield server


# ------------------------------------------------------------------------------ kombu alone


def _collect_and_close_after_broker_loss(server: PrivateRedis, transport: str) -> kombu.Connection:
    """What Celery's consumer does when the broker goes away under it, without Celery.

    The task channel (the connection's default channel) holds one delivered, unacknowledged
    message and has a BRPOP outstanding, as the worker's event loop leaves it; a second channel
    consumes an auto-delete fanout queue, as Celery's remote control (pidbox) does. Then Redis
    stops and `collect()` + `close()` run (`Consumer.on_connection_error_after_connected`).
    """
    url = server.url
    with kombu.Connection(url, transport=transport) as conn:
        kombu.Producer(conn).publish({"n": 1}, routing_key="q", declare=[kombu.Queue("q")])
    conn = kombu.Connection(url, transport=transport)
    conn.ensure_connection()
    delivered: list[kombu.Message] = []
    tasks = kombu.Consumer(conn, [kombu.Queue("q")], callbacks=[lambda _b, m: delivered.append(m)])
    tasks.consume()
    bcast = kombu.Queue("bcast.me", kombu.Exchange("bcast", type="fanout"), auto_delete=True)
    kombu.Consumer(conn.channel(), [bcast], no_ack=True).consume()
    while not delivered:
        conn.drain_events(timeout=5)
    conn.default_channel._brpop_start()  # the event loop's outstanding BRPOP
    server.stop()
    conn.collect(socket_timeout=1.0)
    conn.close()
    return conn


def test_stock_kombu_crashes_closing_a_collected_connection(rds: PrivateRedis) -> None:
    """The upstream bug, still present in the installed kombu. When this test fails, kombu
    fixed it: drop `proj.transport` (and BROKER_TRANSPORT) and this test."""
    with pytest.raises(AttributeError, match="hostname"):
        _collect_and_close_after_broker_loss(rds, STOCK)


def test_guarded_transport_closes_a_collected_connection(rds: PrivateRedis) -> None:
    """Ours closes every channel and reports the closed transport as a lost connection."""
    from proj.transport import GUARDED

    conn = _collect_and_close_after_broker_loss(rds, GUARDED)
    assert conn._default_channel is None or conn._default_channel.closed
    rds.start()  # the broker is back: a new connection works with the same transport
    with kombu.Connection(rds.url, transport=GUARDED) as again:
        again.ensure_connection(max_retries=3)
        assert again.default_channel.client.ping()


def test_the_app_uses_the_guarded_transport_for_redis_only() -> None:
    from proj.transport import GUARDED, transport_for

    assert transport_for("redis://127.0.0.1:6379/0") == GUARDED
    assert transport_for("amqp://guest@127.0.0.1//") is None
    assert transport_for("rediss://h:6380/0") is None  # kombu derives TLS from its name
    assert transport_for("redis://h/0", explicit="redis") == "redis"


# ------------------------------------------------------------------------------ real worker


def _worker_env(server: PrivateRedis, **extra: str) -> dict[str, str]:
    # Celery's prefetch on: the crash needs a message delivered to a busy worker and not yet
    # acknowledged, which a worker that fetches only for a free process never holds.
    return {"BROKER_URL": server.url, "REPUBLISH_AFTER_S": "3", "DISABLE_PREFETCH": "0", **extra}


def _in_flight(procs: ProcessGroup, name: str, received_before: int) -> list[str]:
    """Three long steps sent to a 2-slot worker: two run (acknowledged), the third waits in the
    worker, delivered and not acknowledged, while the worker's BRPOP asks for more."""
    base = scalar("SELECT count(*) FROM testkit.execution")
    keys = [new_key() for _ in range(3)]
    for i, key in enumerate(keys):
        runs.enqueue("probe", {"n": i, "slow_step": "s1", "slow_s": 4.0}, idempotency_key=key)
    dead = procs.procs[name].poll
    wait_for(
        lambda: scalar("SELECT count(*) FROM testkit.execution") >= base + 2 or dead() is not None,
        60,
        what="2 running",
    )
    wait_for(
        lambda: procs.log(name).count(" received") >= received_before + 3 or dead() is not None,
        60,
        what="the third message delivered to the busy worker",
    )
    time.sleep(0.3)
    return keys


def _restart_while_noticed(procs: ProcessGroup, name: str, server: PrivateRedis) -> None:
    """Stop Redis and keep it down until the worker noticed (or died), then start it again."""
    lost = procs.log(name).count("Connection to broker lost")
    server.stop()
    wait_for(
        lambda: (
            procs.log(name).count("Connection to broker lost") > lost or procs.procs[name].poll() is not None
        ),
        30,
        what="the worker to notice the lost broker",
    )
    time.sleep(0.5)
    server.start()
    server.restarts += 1


def _restart_under_load(procs: ProcessGroup, name: str, server: PrivateRedis, times: int) -> list[str]:
    keys: list[str] = []
    for _ in range(times):
        if procs.procs[name].poll() is not None:
            break
        keys += _in_flight(procs, name, procs.log(name).count(" received"))
        _restart_while_noticed(procs, name, server)
        time.sleep(1.0)
        if procs.procs[name].poll() is not None:
            break
    return keys


def _all_succeeded(keys: list[str]) -> bool:
    done = scalar(
        "SELECT count(*) FROM engine.task_run WHERE idempotency_key = ANY(%s) AND status = 'succeeded'",
        (keys,),
    )
    return done == len(keys)


def test_a_worker_survives_redis_restarts_with_unacked_messages(
    procs: ProcessGroup, rds: PrivateRedis
) -> None:
    procs.worker("w", concurrency=2, env=_worker_env(rds))
    procs.beat(env=_worker_env(rds))
    keys = _restart_under_load(procs, "w", rds, RESTARTS)
    log = procs.log("w")
    assert procs.procs["w"].poll() is None, f"the worker exited:\n{log[-4000:]}"
    assert "Unrecoverable error" not in log and CRASH not in log
    assert rds.restarts == RESTARTS and log.count("Connection to broker lost") >= RESTARTS
    wait_for(lambda: _all_succeeded(keys), 120, what="every run to finish after the restarts")
    # Durable runs finish once: each of the 5 steps committed once per run, and no completed
    # step ran again (a re-run would add an execution row that ended).
    steps = sql(
        "SELECT s.name, count(*) FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
        "WHERE r.idempotency_key = ANY(%s) AND s.status = 'succeeded' GROUP BY 1 ORDER BY 1",
        (keys,),
    )
    assert steps == [(f"s{i}", len(keys)) for i in range(1, 6)]
    rerun = sql(
        "SELECT run_id, step FROM testkit.execution WHERE ended_at IS NOT NULL "
        "GROUP BY 1, 2 HAVING count(*) > 1"
    )
    assert rerun == []
    print(f"redis restarts: {rds.restarts}, worker exits: 0, runs: {len(keys)}")


def test_kombus_own_transport_lets_the_worker_die(procs: ProcessGroup, rds: PrivateRedis) -> None:
    """The control: the same restarts with `BROKER_TRANSPORT=redis` (kombu's transport) end the
    worker with the crash, so the test above proves the guard, not luck."""
    procs.worker("w", concurrency=2, env=_worker_env(rds, BROKER_TRANSPORT="redis"))
    procs.beat(env=_worker_env(rds))
    _restart_under_load(procs, "w", rds, max(RESTARTS, 12))
    wait_for(lambda: procs.procs["w"].poll() is not None, 30, what="the unguarded worker to exit")
    log = procs.log("w")
    assert "Unrecoverable error" in log and CRASH in log, log[-4000:]
    assert rds.restarts >= 1
    print(f"kombu's own transport: the worker died after {rds.restarts} Redis restart(s)")
    with redis.Redis(port=rds.port) as r:
        assert r.ping()
