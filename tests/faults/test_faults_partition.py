"""Network partitions (issue #18, item 4): between a worker and Postgres, and between a worker
and Redis.

The worker reaches Postgres through a loopback proxy port; iptables then drops every packet to
and from that port (a blackhole: nothing is closed, nothing answers) for longer than the lease.
- Its session stays open on the server, so the liveness fast path does not fire: the step is
  taken over only when its lease runs out, by a worker with a working connection.
- libpq's keepalives / `tcp_user_timeout` (`proj.db.tcp_params`) make the cut worker's
  statements fail within about a lease instead of hanging.
- After the partition heals, the cut attempt's commit is refused; the POST it made before the
  cut is reconciled, not repeated: the effect happened once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proj.engine import runs
from tests.conftest import new_key
from tests.integration.test_ledger import _effects_input, _run_status, op_row
from tests.kinds_effects import Receiver, lines_for, read_journal
from tests.support.private import private_redis, use_broker
from tests.support.proxy import Blackhole, CutProxy
from tests.support.services import pg_url, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def pg_proxy() -> Iterator[CutProxy]:
    proxy = CutProxy(upstream=("127.0.0.1", 5432), match=b"\\0never\\0", cuts=0)  # forwards only
    yield proxy
    proxy.close()


def test_a_partitioned_worker_is_taken_over_at_its_lease_and_fenced(
    procs, tmp_path: Path, receiver: Receiver, pg_proxy: CutProxy
) -> None:
    cut_url = pg_url().replace("127.0.0.1:5432", f"127.0.0.1:{pg_proxy.port}")
    assert cut_url != pg_url()
    procs.worker("cut", concurrency=1, env={"DATABASE_URL": cut_url, "LEASE_TTL_S": "6"})
    inp = _effects_input(tmp_path, receiver, hold_in="http", hold_when="after", hold_s=12.0)
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    wait_for(lambda: [e for e in read_journal(inp["journal"]) if e["event"] == "hold"], 30, what="the hold")
    assert receiver.count(inp["op"]) == 1  # posted; not yet committed
    hole = Blackhole(pg_proxy.port)
    try:
        hole.cut()
        cut_at = time.monotonic()
        # The lease as the cut worker last renewed it: nothing it sends arrives any more.
        lease_until = scalar(
            "SELECT lease_until FROM engine.step WHERE run_id = %s AND status = 'running'", (ref.task_run_id,)
        )
        procs.worker("rescuer", concurrency=1)  # its own, working connection
        procs.beat()
        wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 60, what="the rescuer to finish")
        # Not before the lease: the cut worker's sessions are still open on the server, so its
        # liveness lock is held and no fast path ends the lease early. (A check 1.5 s after the
        # rescuer was ready raced the lease itself when the rescuer took long to start.)
        second = scalar(
            "SELECT a.started_at FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
            "WHERE s.run_id = %s AND a.attempt = 2",
            (ref.task_run_id,),
        )
        assert lease_until is not None and second is not None and second >= lease_until, (lease_until, second)
        taken = time.monotonic() - cut_at
        # The cut worker's statements fail instead of hanging (heartbeat every lease/3).
        wait_for(lambda: "lease heartbeat failed" in procs.log("cut"), 30, what="the cut worker to notice")
        noticed = time.monotonic() - cut_at
        print(f"partition: taken over after {taken:.1f}s; the cut worker noticed after {noticed:.1f}s")
    finally:
        hole.heal()
    stored = op_row(f"http:{inp['op']}")
    assert stored["status"] == "done" and stored["resolution"] == "reconciled"
    # Healed: the cut attempt ends its hold and tries to go on; it is refused or fails, never commits.
    wait_for(
        lambda: (
            [e for e in read_journal(inp["journal"]) if e["event"] == "refused"]
            or "lease lost" in procs.log("cut")
            or "refused" in procs.log("cut")
        ),
        60,
        what="the cut attempt to be refused",
    )
    assert op_row(f"http:{inp['op']}") == stored, "the refused attempt changed the stored row"
    assert receiver.count(inp["op"]) == 1
    assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
    outcomes = sql(
        "SELECT a.attempt, a.outcome FROM engine.attempt a JOIN engine.step s ON s.id = a.step_id "
        "WHERE s.run_id = %s ORDER BY a.attempt",
        (ref.task_run_id,),
    )
    assert outcomes[-1][1] == "succeeded" and all(o != "succeeded" for _, o in outcomes[:-1]), outcomes


def _succeeded(ids: list) -> int:
    return scalar("SELECT count(*) FROM engine.task_run WHERE id = ANY(%s) AND status = 'succeeded'", (ids,))


def test_a_worker_cut_from_redis_is_recovered_through_the_sweeper(procs, tmp_path: Path) -> None:
    """The worker reaches its (private) Redis through a proxy port that is then blackholed for
    longer than the lease: what it had reserved, and the steps it tries to hand on, never
    arrive. Postgres still knows every step: the sweeper re-publishes the pending ones to a
    worker with a working broker connection, each step runs once, and the cut worker lives."""
    per_message = {"INLINE_STEPS": "0", "REPUBLISH_AFTER_S": "3"}
    with private_redis(tmp_path) as rds, use_broker(rds.url):
        proxy = CutProxy(upstream=("127.0.0.1", rds.port), match=b"\\0never\\0", cuts=0)
        try:
            cut_url = f"redis://127.0.0.1:{proxy.port}/0"
            procs.worker("cut", concurrency=1, env={"BROKER_URL": cut_url, **per_message})
            refs = [runs.enqueue("probe", {"n": i}, idempotency_key=new_key()) for i in range(6)]
            wait_for(
                lambda: scalar("SELECT count(*) FROM testkit.execution") >= 3,
                60,
                what="steps on the cut worker",
            )
            hole = Blackhole(proxy.port)
            try:
                hole.cut()
                env = {"BROKER_URL": rds.url, **per_message}
                procs.worker("healthy", concurrency=2, env=env)
                procs.beat(env=env)
                ids = [r.task_run_id for r in refs]
                wait_for(
                    lambda: _succeeded(ids) == len(ids), 120, what="every run to finish past the partition"
                )
                assert procs.procs["cut"].poll() is None, "the cut worker exited"
                print(f"redis partition: {len(ids)} runs finished past it, the cut worker alive")
            finally:
                hole.heal()
        finally:
            proxy.close()
    steps = sql("SELECT name, count(*) FROM engine.step WHERE status = 'succeeded' GROUP BY 1 ORDER BY 1")
    assert steps == [(f"s{i}", 6) for i in range(1, 6)]
    rerun = sql(
        "SELECT run_id, step FROM testkit.execution WHERE ended_at IS NOT NULL "
        "GROUP BY 1, 2 HAVING count(*) > 1"
    )
    assert rerun == []
    assert "probe.v1." in procs.log("healthy"), "the healthy worker ran none of the steps"
