"""Runs of a version no process here knows (a rollout, a retired version) must not stop the
sweeper from ending the runs it does know, nor be stranded half-ended.

Each sweeper statement that picks runs to end (cancels to finish, orphaned children, runs past
their deadline, steps whose attempts ran out) used to take any version and skip the unknown
ones only after its LIMIT: with more such runs than a batch, nothing else was ever ended.
"""

from __future__ import annotations

import uuid

import pytest

from proj.engine import runs, sweeper
from tests.conftest import new_key
from tests.support.services import scalar, sql

ALIEN_VERSION = 99  # no process in these tests declares `probe@99`


def _run(version: int = 1, deadline: str | None = None, parent: uuid.UUID | None = None) -> uuid.UUID:
    run_id = runs.enqueue("probe", {}, idempotency_key=new_key()).task_run_id
    sql(
        "UPDATE engine.task_run SET version = %s, deadline_at = %s, parent_run_id = %s WHERE id = %s",
        (version, deadline, parent, run_id),
    )
    return run_id


def _status(run_id: uuid.UUID) -> str:
    return str(scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)))


@pytest.fixture
def small_batch(monkeypatch: pytest.MonkeyPatch, published: list[object]) -> int:
    monkeypatch.setattr(sweeper, "BATCH", 3)
    return 3


def test_cancels_of_unknown_versions_do_not_starve_a_known_one(small_batch: int) -> None:
    aliens = [_run(ALIEN_VERSION) for _ in range(small_batch + 2)]
    sql(
        "UPDATE engine.task_run SET cancel_requested_at = now() - interval '1 minute', "
        "cancel_reason = 'x' WHERE id = ANY(%s)",
        (aliens,),
    )
    known = _run()
    sql("UPDATE engine.task_run SET cancel_requested_at = now(), cancel_reason = 'y' WHERE id = %s", (known,))

    sweeper.sweep()

    assert _status(known) == "canceled"
    assert {_status(a) for a in aliens} == {"pending"}, "left to a process that knows probe@99"


def test_deadlines_of_unknown_versions_do_not_starve_a_known_one(small_batch: int) -> None:
    for _ in range(small_batch + 2):  # earlier deadlines: first in `ORDER BY deadline_at`
        _run(ALIEN_VERSION, deadline="2020-01-01T00:00:00Z")
    known = _run(deadline="2021-01-01T00:00:00Z")

    report = sweeper.sweep()

    assert _status(known) == "failed"
    assert report.expired_runs == 1


def test_orphans_of_unknown_versions_do_not_starve_a_known_one(small_batch: int) -> None:
    parent = _run()
    aliens = [_run(ALIEN_VERSION, parent=parent) for _ in range(small_batch + 2)]
    orphan = _run(parent=parent)
    sql("UPDATE engine.task_run SET status = 'canceled', finished_at = now() WHERE id = %s", (parent,))

    sweeper.sweep()
    sweeper.sweep()  # the orphan is asked to cancel, then finalised

    assert _status(orphan) == "canceled"
    assert {_status(a) for a in aliens} == {"pending"}


def _spent_and_expired(run_id: uuid.UUID) -> None:
    sql(
        "UPDATE engine.step SET status = 'running', attempts = max_attempts, "
        "lease_token = gen_random_uuid(), lease_owner = 'gone', "
        "lease_until = now() - interval '1 second' WHERE run_id = %s AND stage = 0",
        (run_id,),
    )


def test_a_spent_step_of_an_unknown_version_waits_for_a_sweep_that_knows_it(published: list[object]) -> None:
    """Failed here, its run needed the kind to be failed too, which this process could not
    load: the step was `failed` and its run stayed `running` with nothing left to end it. Now
    the expired lease is left for a process that knows the version, which fails both."""
    alien = _run(ALIEN_VERSION)
    _spent_and_expired(alien)

    report = sweeper.sweep()

    assert report.failed == 0
    assert scalar("SELECT status FROM engine.step WHERE run_id = %s AND stage = 0", (alien,)) == "running"
    assert _status(alien) == "pending"

    sql("UPDATE engine.task_run SET version = 1 WHERE id = %s", (alien,))  # a process that knows it
    report = sweeper.sweep()

    assert report.failed == 1
    assert scalar("SELECT status FROM engine.step WHERE run_id = %s AND stage = 0", (alien,)) == "failed"
    assert _status(alien) == "failed"


def test_a_step_of_an_unknown_version_with_attempts_left_is_taken_back(published: list[object]) -> None:
    """Going back to `pending` needs no kind: that path is not held back."""
    alien = _run(ALIEN_VERSION)
    sql(
        "UPDATE engine.step SET status = 'running', attempts = 1, lease_token = gen_random_uuid(), "
        "lease_owner = 'gone', lease_until = now() - interval '1 second' WHERE run_id = %s",
        (alien,),
    )

    assert sweeper.sweep().expired == 1
    assert scalar("SELECT status FROM engine.step WHERE run_id = %s", (alien,)) == "pending"


# Re-sends: a message to a queue nobody consumes is not lost, it waits there; re-sending it every
# `REPUBLISH_AFTER_S` (30 s) only grew that queue, by one message per step per interval. Such a
# queue is re-sent to after `REPUBLISH_UNCONSUMED_S` (600 s) only.


def _published_long_ago(version: int, ago: str = "5 minutes") -> int:
    run_id = _run(version)
    sql(
        "UPDATE engine.step SET published_at = now() - CAST(%s AS interval) WHERE run_id = %s",
        (ago, run_id),
    )
    return int(scalar("SELECT id FROM engine.step WHERE run_id = %s", (run_id,)))


def _resent(published: list[object]) -> set[int]:
    return {d.step_id for d in published}  # type: ignore[attr-defined]


@pytest.fixture
def consumer_of_probe_v1():
    """A live process that consumes `probe.v1` (as a worker's child says it at start)."""
    from proj.engine.liveness import Liveness

    live = Liveness()
    live.serve([("probe", 1)])
    yield live
    live.stop()


def test_a_lost_message_is_resent_only_to_a_queue_someone_consumes(
    published: list[object], consumer_of_probe_v1: object
) -> None:
    served = _published_long_ago(1)
    unserved = _published_long_ago(ALIEN_VERSION)
    never_sent = int(scalar("SELECT id FROM engine.step WHERE run_id = %s", (_run(ALIEN_VERSION),)))
    sql("UPDATE engine.step SET published_at = NULL WHERE id = %s", (never_sent,))
    published.clear()  # what `enqueue` sent

    sweeper.sweep()
    sweeper.sweep()

    assert _resent(published) == {served, never_sent}, "probe.v99 has no consumer: sent once, not again"
    assert scalar(
        "SELECT published_at < now() - interval '1 minute' FROM engine.step WHERE id = %s", (unserved,)
    )


def test_a_queue_nobody_says_it_consumes_is_still_resent_to_seldom(
    published: list[object], consumer_of_probe_v1: object
) -> None:
    """A worker of an older release says nothing of what it consumes, and a Redis restart does
    lose messages: past `REPUBLISH_UNCONSUMED_S` the step is sent again, so none is lost."""
    stale = _published_long_ago(ALIEN_VERSION, "11 minutes")
    published.clear()  # what `enqueue` sent
    sweeper.sweep()
    assert _resent(published) == {stale}


def test_a_consumer_that_arrives_gets_the_steps_resent(published: list[object]) -> None:
    from proj.engine.liveness import Liveness

    other = Liveness()
    other.serve([("probe", 1)])
    try:
        unserved = _published_long_ago(ALIEN_VERSION)
        published.clear()  # what `enqueue` sent
        sweeper.sweep()
        assert unserved not in _resent(published)

        late = Liveness()
        late.serve([("probe", ALIEN_VERSION)])  # a worker of probe@99 starts
        try:
            sweeper.sweep()
        finally:
            late.stop()
        assert unserved in _resent(published)
    finally:
        other.stop()


def test_with_no_consumer_registered_at_all_every_queue_is_resent(published: list[object]) -> None:
    """`REAP_INTERVAL_S=0` (or no liveness session anywhere): nothing says who consumes what,
    so every lost message is re-sent, as before."""
    unserved = _published_long_ago(ALIEN_VERSION)
    published.clear()  # what `enqueue` sent
    sweeper.sweep()
    assert _resent(published) == {unserved}


def test_a_worker_says_which_queues_its_children_consume(procs) -> None:
    procs.worker("w1", concurrency=2, env={"ENGINE_SERVE": "probe@1"})
    from proj.engine.store.leases import CONSUMER_LOCK_NS

    holders = scalar(
        "SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.classid = %s AND l.objsubid = 2 AND l.objid = hashtext('probe.v1')::oid "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (CONSUMER_LOCK_NS,),
    )
    assert holders == 2, "one per prefork child, on its liveness session"
    procs.kill("w1")
