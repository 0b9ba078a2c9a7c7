"""Redis at `maxmemory` (resource exhaustion, the broker's side).

- `noeviction` (Redis' default policy): every write is refused with "OOM command not allowed
  when used memory > 'maxmemory'", and so is every command queued in a MULTI. A publish
  (enqueue, the next step after a commit, the sweeper's re-send, the outbox) is refused; BRPOP
  still hands a worker what was queued before. Nothing may be lost and no worker may exit:
  once memory is freed every run finishes, each step once.
- `allkeys-lru` (an operator's misconfiguration, e.g. a Redis shared with a cache): queued
  messages, whole queues, are evicted. Postgres still says which steps wait for a message, and
  the sweeper re-sends them after `REPUBLISH_AFTER_S`.

Redis here is a private `redis-server` on its own port; the memory is taken by "another tenant"
(filler keys), as on a shared instance.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
import redis

import outbox
from proj import db
from proj.engine import runs, sweeper
from proj.engine.celery_engine import CeleryTaskEngine
from tests.conftest import new_key
from tests.support.private import PrivateRedis, private_redis, use_broker
from tests.support.services import ProcessGroup, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(180)

# Every step its own message, re-sent quickly: each commit publishes, and a lost message is
# noticed within the test's patience.
ENV = {"INLINE_STEPS": "0", "REPUBLISH_AFTER_S": "2"}


@pytest.fixture
def rds(tmp_path: Path) -> Iterator[PrivateRedis]:
    with private_redis(tmp_path) as server, use_broker(server.url):
        yield server


def client(server: PrivateRedis) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=5)


def fill_until_refused(r: redis.Redis, headroom: int = 1 << 20) -> None:
    """`noeviction`, a cap `headroom` bytes above what Redis uses now, and another tenant's keys
    until Redis refuses one: the broker is full. Then the cap goes `headroom` below what it holds
    (the tenant grew on): at the edge, a freed query buffer or a drained message would let the
    odd write in, and this test wants every write refused until memory is freed."""
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", r.info("memory")["used_memory"] + headroom)
    for i in range(10_000):
        try:
            r.set(f"tenant:{i}", b"x" * 65536)
        except redis.exceptions.OutOfMemoryError:
            r.config_set("maxmemory", r.info("memory")["used_memory"] - headroom)
            return
    raise AssertionError("Redis never refused a write at its maxmemory")


def flood_with_lru(r: redis.Redis, headroom: int = 2 << 20) -> int:
    """`allkeys-lru` with a small cap, then ten times the cap of another tenant's keys: Redis
    evicts whatever was idle longest, queued messages too. Returns the keys evicted."""
    r.config_set("maxmemory-policy", "allkeys-lru")
    r.config_set("maxmemory", r.info("memory")["used_memory"] + headroom)
    value = b"x" * 1024
    for start in range(0, 10 * headroom // len(value), 1000):
        with r.pipeline(transaction=False) as pipe:
            for i in range(start, start + 1000):
                pipe.set(f"cache:{i}", value)
            pipe.execute()
    return int(r.info("stats")["evicted_keys"])


def db_now() -> datetime:
    return scalar("SELECT now()")


def succeeded(ids: list) -> int:
    return scalar("SELECT count(*) FROM engine.task_run WHERE id = ANY(%s) AND status = 'succeeded'", (ids,))


def unpublished(ids: list) -> int:
    """Pending steps of these runs the engine knows it could not send (the next sweep sends them)."""
    return scalar(
        "SELECT count(*) FROM engine.step WHERE run_id = ANY(%s) AND status = 'pending'"
        " AND published_at IS NULL",
        (ids,),
    )


def assert_each_step_once(ids: list, steps: int = 5) -> None:
    """Every run succeeded with each step committed once, and no completed body ran again (a
    re-run would add a second finished execution row)."""
    assert succeeded(ids) == len(ids)
    per_step = sql(
        "SELECT s.name, count(*) FROM engine.step s WHERE s.run_id = ANY(%s) AND s.status = 'succeeded'"
        " GROUP BY 1 ORDER BY 1",
        (ids,),
    )
    assert per_step == [(f"s{i}", len(ids)) for i in range(1, steps + 1)]
    rerun = sql(
        "SELECT run_id, step FROM testkit.execution WHERE ended_at IS NOT NULL"
        " GROUP BY 1, 2 HAVING count(*) > 1"
    )
    assert rerun == []
    assert scalar("SELECT count(*) FROM engine.task_run WHERE status <> 'succeeded'") == 0


def enqueue_through_the_outbox() -> object:
    """A business transaction's outbox event, dispatched here (beat's messages are refused too)."""
    key = new_key()
    with db.sessions().begin() as s:
        outbox.add(s, "probe", key, {"n": 99})
    report = outbox.dispatch(db.sessions(), CeleryTaskEngine())
    assert report.dispatched == 1, report
    return scalar("SELECT id FROM engine.task_run WHERE idempotency_key = %s", (key,))


def test_redis_at_maxmemory_noeviction_loses_no_step(procs: ProcessGroup, rds: PrivateRedis) -> None:
    """Before: the first message a worker took from a full Redis ended it ("Unrecoverable
    error: OutOfMemoryError": kombu's restore record for the message, ZADD + HSET, was refused),
    and a worker (re)started meanwhile ended as it declared its queues (LLEN inside MULTI).
    With no consumer left, nothing finished after the memory was freed. Now the worker runs
    what it takes, every refused publish is left to the sweeper (`published_at` NULL), a
    worker starts on a full Redis, and all runs finish, each step once."""
    env = {"BROKER_URL": rds.url, **ENV}
    procs.worker("w", concurrency=2, env=env)
    procs.beat(env=env)
    r = client(rds)
    # A backlog: two slow first steps hold both slots, the others' messages wait in Redis.
    slow = {"slow_step": "s1", "slow_s": 2.0}
    refs = [
        runs.enqueue("probe", {"n": i, **(slow if i < 2 else {})}, idempotency_key=new_key())
        for i in range(6)
    ]
    wait_for(lambda: scalar("SELECT count(*) FROM testkit.execution") >= 2, 30, what="two slow steps running")

    fill_until_refused(r)
    full_since = db_now()
    ids = [ref.task_run_id for ref in refs]
    late = [runs.enqueue("probe", {"n": 10 + i}, idempotency_key=new_key()).task_run_id for i in range(3)]
    assert unpublished(late) == 3  # enqueue committed the runs; their messages were refused
    late.append(enqueue_through_the_outbox())
    assert unpublished(late) == 4
    report = sweeper.sweep()  # the sweeper's own re-send is refused too, and remembered
    assert report.published >= 4 and unpublished(late) == 4, report
    procs.worker("w2", concurrency=1, env=env)  # a worker (re)started on a full Redis comes up
    wait_for(
        lambda: scalar("SELECT count(*) FROM testkit.execution WHERE started_at > %s", (full_since,)) >= 2,
        30,
        what="the worker to run steps it took from the full Redis",
    )
    time.sleep(2.0)  # commits meanwhile: their next steps' messages are refused
    assert r.info("errorstats").get("errorstat_OOM", {}).get("count", 0) > 0
    assert procs.procs["w"].poll() is None, f"the worker exited:\n{procs.log('w')[-3000:]}"
    assert unpublished(ids) > 0  # next steps the workers could not send

    r.config_set("maxmemory", 0)  # the operator gives Redis memory
    everything = ids + late
    wait_for(
        lambda: succeeded(everything) == len(everything),
        60,
        what="every run to finish once Redis takes writes",
    )
    assert_each_step_once(everything)
    assert scalar("SELECT count(*) FROM outbox.outbox_event WHERE status <> 'dispatched'") == 0
    assert all(p.poll() is None for p in procs.procs.values()), "a worker or beat exited"


def test_redis_allkeys_lru_evicting_queued_messages_is_recovered_by_the_sweeper(
    procs: ProcessGroup, rds: PrivateRedis
) -> None:
    """Queued messages evicted, whole queues and kombu's bindings with them: Postgres still
    lists the steps as pending and published, and the sweeper sends each again after
    `REPUBLISH_AFTER_S`; every run finishes, each step once, the worker alive."""
    # The re-send comes 6 s after a publish, not 2: one landing between the flood and the look at
    # the queue put the five messages back before they were counted gone (a CI run: 19,423 keys
    # evicted, the queue holding 5). The worker stays busy past it.
    env = {"BROKER_URL": rds.url, **ENV, "REPUBLISH_AFTER_S": "6"}
    procs.worker("w", concurrency=1, env=env)
    procs.beat(env=env)
    r = client(rds)
    slow = {"slow_step": "s1", "slow_s": 8.0}
    refs = [
        runs.enqueue("probe", {"n": i, **(slow if i == 0 else {})}, idempotency_key=new_key())
        for i in range(6)
    ]
    ids = [ref.task_run_id for ref in refs]
    wait_for(lambda: scalar("SELECT count(*) FROM testkit.execution") >= 1, 30, what="the slow step running")
    waiting = sql(
        "SELECT id FROM engine.step WHERE run_id = ANY(%s) AND status = 'pending'"
        " AND published_at IS NOT NULL",
        (ids,),
    )
    assert len(waiting) == 5 and r.llen("probe.v1") == 5  # their messages queued behind the slow step

    flood_from = db_now()
    evicted = flood_with_lru(r)
    left = r.llen("probe.v1")
    evicted_at = db_now()
    resent_early = scalar(
        "SELECT count(*) FROM engine.step WHERE id = ANY(%s) AND published_at >= %s",
        ([w[0] for w in waiting], flood_from),
    )
    assert resent_early == 0, "re-sent before the queue was looked at: the test proves nothing"
    assert evicted > 0 and left == 0, "the queued messages were not evicted"
    wait_for(lambda: succeeded(ids) == len(ids), 60, what="every run to finish after the eviction")
    # Sent again after the eviction: the sweeper's re-send, not a message that survived.
    resent = scalar(
        "SELECT count(*) FROM engine.step WHERE id = ANY(%s) AND published_at > %s",
        ([w[0] for w in waiting], evicted_at),
    )
    assert resent == len(waiting)
    assert_each_step_once(ids)
    assert procs.procs["w"].poll() is None and procs.procs["beat"].poll() is None


def test_a_binding_redis_refused_is_written_when_the_same_connection_declares_it_again(
    tmp_path: Path,
) -> None:
    """A new binding Redis refuses is reported as a lost connection (`GuardedChannel._queue_bind`),
    but kombu's `queue_bind` records it in the connection's state first. A caller that kept the
    connection (a producer whose publish retries ran out keeps its pooled connection) then
    declared the queue again once Redis took writes: the state said bound, the SADD was skipped,
    and a message published to the exchange reached no queue. Now a refused binding is taken
    back out of the state, so the next declaration writes it."""
    import kombu

    from proj.transport import GuardedTransport

    with private_redis(tmp_path) as server:
        r = client(server)
        with kombu.Connection(server.url, transport=GuardedTransport) as conn:
            channel = conn.channel()
            exchange = kombu.Exchange("fresh.v9", type="direct")
            queue = kombu.Queue("fresh.v9", exchange, routing_key="fresh.v9")
            fill_until_refused(r)
            with pytest.raises(redis.exceptions.ConnectionError):
                queue(channel).declare()
            r.config_set("maxmemory", 0)  # the operator gives Redis memory

            queue(channel).declare()
            member = channel.sep.join(["fresh.v9", "", "fresh.v9"])  # a direct binding has no pattern
            assert r.sismember("_kombu.binding.fresh.v9", member)
            kombu.Producer(channel).publish({"n": 1}, exchange=exchange, routing_key="fresh.v9")
            assert r.llen("fresh.v9") == 1
            channel.close()


def test_a_channel_holding_an_unacknowledged_message_closes_while_redis_refuses_writes(
    tmp_path: Path,
) -> None:
    """Closing a channel puts its unacknowledged messages back (`QoS.restore_unacked`), a MULTI
    Redis refuses at maxmemory. Before: the OutOfMemoryError escaped `Connection.close()` (it is
    no connection error, so `GuardedTransport.close_connection` stopped there, leaving the other
    channels open). Now the refused restore is logged and the message's restore record kept, so
    kombu's visibility scan re-delivers it once Redis takes writes (and Postgres re-sends its
    step anyway)."""
    import kombu

    from proj.transport import GuardedTransport

    with private_redis(tmp_path) as server:
        r = client(server)
        conn = kombu.Connection(server.url, transport=GuardedTransport)
        channel = conn.channel()
        queue = kombu.Queue("held", kombu.Exchange("held", type="direct"), routing_key="held")
        queue(channel).declare()
        kombu.Producer(channel).publish({"n": 1}, exchange="held", routing_key="held")
        assert queue(channel).get(no_ack=False) is not None
        assert r.hlen("unacked") == 1
        fill_until_refused(r)

        conn.close()
        r.config_set("maxmemory", 0)
        assert r.hlen("unacked") == 1 and r.zcard("unacked_index") == 1  # left for the scan


def test_a_worker_with_a_global_keyprefix_re_binds_its_queues_while_redis_refuses_writes(
    tmp_path: Path,
) -> None:
    """A restarted worker re-binds its queues; at maxmemory the write is refused and
    `GuardedChannel._bound` asks whether the binding is there already. kombu's prefixing client
    prefixes SADD and SMEMBERS but not SISMEMBER, so with a `global_keyprefix` the question was
    asked of the unprefixed key: never bound, every restart failed as a lost connection until
    Redis took writes again."""
    import kombu

    from proj.transport import GuardedTransport

    options = {"global_keyprefix": "tenant-a:"}
    queue = kombu.Queue("again", kombu.Exchange("again", type="direct"), routing_key="again")
    with private_redis(tmp_path) as server:
        r = client(server)
        with kombu.Connection(server.url, transport=GuardedTransport, transport_options=options) as first:
            queue(first.channel()).declare()
        assert r.exists("tenant-a:_kombu.binding.again")
        fill_until_refused(r)
        with kombu.Connection(server.url, transport=GuardedTransport, transport_options=options) as restarted:
            queue(restarted.channel()).declare()  # bound already: carries on
        r.config_set("maxmemory", 0)
