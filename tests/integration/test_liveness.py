"""The liveness session across a reconnect (`proj.engine.liveness`): the process takes the same
advisory key again, so the leases it holds keep naming a lock that is held, and no reaper ends
them while the process is alive."""

from __future__ import annotations

import time
import uuid

from proj.engine.liveness import Liveness
from proj.settings import get_settings
from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for


def held(key: int) -> int:
    """Sessions holding the advisory lock `key` (a bigint key: high half in classid)."""
    return scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
        "AND ((classid::bigint << 32) | objid::bigint) = %s",
        (key,),
    )


def test_a_lost_liveness_session_is_replaced_under_the_same_key() -> None:
    lv = Liveness()
    try:
        owner = lv.owner()
        assert "#" in owner, f"no liveness session: {owner}"
        assert lv._conn is not None
        key, old_pid = lv._key, lv._conn.info.backend_pid
        assert held(key) == 1
        sql("SELECT pg_terminate_backend(%s)", (old_pid,))  # an admin, a proxy, an idle timeout

        def replaced() -> bool:
            conn = lv._conn
            return conn is not None and not conn.closed and conn.info.backend_pid != old_pid

        wait_for(replaced, 10, what="the reaper loop to open a new session")
        assert lv.owner() == owner, "the owner written on earlier claims no longer names this process"
        assert held(key) == 1
    finally:
        lv.stop()
    wait_for(lambda: held(key) == 0, 5, what="the lock to go with the stopped session")


def running_step(owner: str) -> int:
    """A step running under `owner`'s lease, a minute of it left."""
    run = uuid.uuid4()
    sql(
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "VALUES (%s, 'probe', 1, %s, '{}', 'h', 'running')",
        (run, new_key()),
    )
    return scalar(
        "INSERT INTO engine.step (run_id, stage, name, max_attempts, status, attempts, lease_token, "
        "lease_owner, lease_until, claimed_at) VALUES (%s, 0, 's1', 5, 'running', 1, gen_random_uuid(), "
        "%s, now() + interval '1 minute', now()) RETURNING id",
        (run, owner),
    )


def leased(step: int) -> bool:
    return scalar("SELECT coalesce(lease_until > now(), false) FROM engine.step WHERE id = %s", (step,))


def by_hand(lv: Liveness) -> Liveness:
    """`lv` with its session, its reaper loop stopped: the test ticks it."""
    assert "#" in lv.owner(), "no liveness session"
    lv._stop.set()
    assert lv._thread is not None
    lv._thread.join(5)
    return lv


def session_killed(lv: Liveness) -> int:
    """Kill `lv`'s session (an admin, a connection reset) and wait for its lock to go; its key."""
    assert lv._conn is not None
    sql("SELECT pg_terminate_backend(%s)", (lv._conn.info.backend_pid,))
    wait_for(lambda: held(lv._key) == 0, 5, what="the killed session's lock to go")
    return lv._key


def test_a_live_process_that_lost_its_session_keeps_its_steps() -> None:
    """Between the loss of its session and its next reap tick, a live process' key is free. A
    reaper that ended its leases then would start a second copy of a body that still runs."""
    owner, reaper = by_hand(Liveness()), by_hand(Liveness())
    try:
        step = running_step(owner.owner())
        key = session_killed(owner)
        reaper.tick()
        assert leased(step), "taken over while its process lives and is about to take its key again"
        owner.tick()  # its next tick: the broken session is replaced, under the same key
        assert held(key) == 1
        time.sleep(get_settings().reap_grace_s + 0.1)
        reaper.tick()
        assert leased(step)
    finally:
        owner.stop()
        reaper.stop()


def test_a_dead_process_steps_are_taken_over_once_its_key_stayed_free_for_the_grace() -> None:
    owner, reaper = by_hand(Liveness()), by_hand(Liveness())
    try:
        step = running_step(owner.owner())
        session_killed(owner)  # and no tick of its own again: it died
        reaper.tick()
        assert leased(step)
        time.sleep(get_settings().reap_grace_s + 0.05)
        reaper.tick()
        assert not leased(step), "a dead process' step kept its lease past the grace"
    finally:
        owner.stop()
        reaper.stop()
