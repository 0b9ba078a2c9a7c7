"""The liveness session across a reconnect (`proj.engine.liveness`): the process takes the same
advisory key again, so the leases it holds keep naming a lock that is held, and no reaper ends
them while the process is alive."""

from __future__ import annotations

from proj.engine.liveness import Liveness
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
