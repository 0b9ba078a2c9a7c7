"""A transaction that holds engine locks may not sit idle past two thirds of the lease.

Why: the sweeper takes leases back `FOR UPDATE SKIP LOCKED`, and signals, parks and sweeps queue
behind advisory locks held to the commit. A process frozen (SIGSTOP, a paused VM) between two
statements of such a transaction kept its locks for as long as it stayed frozen: its step was
never taken back, or every sweep everywhere waited behind it. Each statement that takes such a
lock also sets `idle_in_transaction_session_timeout` for the rest of its transaction, so
Postgres ends a frozen holder's session, and with it the locks, before the lease runs out.
`tests/faults/test_recovery_fast.py` freezes real workers and a real sweep; these tests pin each
statement.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import NullPool, create_engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from proj import db
from proj.acquisition import qbt
from proj.engine import runs, sweeper
from proj.engine.store import admission, claims, commits, leases, recovery, waits
from proj.engine.store.leases import idle_bound_ms
from proj.kinds.common import torrent_decision
from proj.settings import get_settings
from tests.conftest import new_key
from tests.support.services import wait_for
from tests.support.steps import first_step

BOUND_MS = idle_bound_ms(get_settings().lease_ttl_s)
SESSION_MS = str(db.idle_in_transaction_ms(get_settings()))  # `DB_IDLE_IN_TRANSACTION_S`, 60 s
IDLE_SETTING = text("SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'")


def _claimed(ttl: float = 30.0) -> tuple[int, uuid.UUID]:
    """A probe run's first step, claimed by this test (the lease holder the statements fence)."""
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    step_id, token = first_step(ref.task_run_id), uuid.uuid4()
    with db.autocommit() as conn:
        assert claims.claim(conn, step_id=step_id, token=token, owner="test-worker", ttl=ttl) is not None
    return step_id, token


def _err() -> dict[str, Any]:
    return {"type": "RuntimeError", "message": "boom"}


# Each takes a session and a claimed step, runs one statement that takes an engine lock, and
# returns whether it landed (a statement that found nothing to lock bounds nothing).
LOCKERS: dict[str, Callable[[Session, int, uuid.UUID], object]] = {
    "lock_sweep": lambda s, i, t: recovery.lock_sweep(s, idle_ms=BOUND_MS) or True,
    "try_lock_sweep": lambda s, i, t: recovery.try_lock_sweep(s, idle_ms=BOUND_MS),
    "lock_gate": lambda s, i, t: admission.lock_gate(s, f"idle-{i}", idle_ms=BOUND_MS) or True,
    "lock_topic": lambda s, i, t: waits.lock_topic(s, f"idle-{i}", idle_ms=BOUND_MS) or True,
    "succeed_and_lock_run": lambda s, i, t: commits.succeed_and_lock_run(
        s, step_id=i, token=t, result="1", idle_ms=BOUND_MS
    ),
    "fail_or_retry": lambda s, i, t: commits.fail_or_retry(
        s, step_id=i, token=t, final=False, budget=5, delay=1.0, err=_err(), idle_ms=BOUND_MS
    ),
    "retry_outage": lambda s, i, t: commits.retry_outage(
        s, step_id=i, token=t, delay=1.0, window=60.0, err=_err(), idle_ms=BOUND_MS
    ),
    "cancel_step": lambda s, i, t: commits.cancel_step(s, step_id=i, token=t, idle_ms=BOUND_MS),
    "fence": lambda s, i, t: leases.fence(s, step_id=i, token=t, ttl=get_settings().lease_ttl_s),
    "renew": lambda s, i, t: leases.renew(s, ttl=get_settings().lease_ttl_s, leases=[(i, t)]),
}


@pytest.mark.parametrize("name", sorted(LOCKERS))
def test_engine_locks_bound_their_transaction(name: str) -> None:
    step_id, token = _claimed()
    s = db.sessions()()
    try:
        assert s.scalar(IDLE_SETTING) == SESSION_MS, "the session's own bound, the backstop"
        assert LOCKERS[name](s, step_id, token), f"{name} did not land"
        assert s.scalar(IDLE_SETTING) == str(BOUND_MS)
        s.rollback()
        assert s.scalar(IDLE_SETTING) == SESSION_MS, "the bound is the transaction's, not the session's"
    finally:
        s.close()


@pytest.fixture
def frozen_holder() -> Iterator[Session]:
    """A session on a connection of its own, left idle inside its transaction as a frozen
    process leaves it (its connection is not returned to the shared pool: Postgres ends it)."""
    engine = create_engine(get_settings().require_database_url(), poolclass=NullPool)
    s = Session(engine)
    yield s
    with contextlib.suppress(DBAPIError):  # Postgres ended its session
        s.close()
    engine.dispose()


def _expired_now(step_id: int) -> bool:
    """Whether a sweep's expiry (which skips locked rows) takes this step back now."""
    with db.transaction() as s:
        return step_id in {e.id for e in recovery.expire_leases(s, 1000, sweeper.known_versions())}


def test_a_step_row_held_by_a_frozen_commit_is_taken_back_after_the_bound(frozen_holder: Session) -> None:
    """The failure path locks the step row (`FAIL_OR_RETRY`), then logs the attempt and the run's
    error: a holder frozen in between kept the row locked, and the sweeper, which skips locked
    rows, never expired its lease. Now Postgres ends the holder's session at the bound, and the
    next sweep takes the step back. The bound here is 4 s, not the tests' 2 s (two thirds of
    `LEASE_TTL_S=3`), so that a slow machine still looks at the row well inside it."""
    bound_s = 4.0
    step_id, token = _claimed(ttl=0.5)
    failed = commits.fail_or_retry(
        frozen_holder,
        step_id=step_id,
        token=token,
        final=False,
        budget=5,
        delay=1.0,
        err=_err(),
        idle_ms=int(bound_s * 1000),
    )
    assert failed is not None  # the row is locked, its change uncommitted: the holder "freezes"
    frozen_at = time.monotonic()
    time.sleep(0.8)  # the lease (0.5 s) has run out
    assert not _expired_now(step_id), "the row is locked: the sweep must skip it"
    assert time.monotonic() - frozen_at < bound_s * 0.75, "the machine was too slow to tell"
    wait_for(lambda: _expired_now(step_id), bound_s + 5, what="the sweep to take the step back")
    taken = time.monotonic() - frozen_at
    assert taken >= bound_s * 0.9, f"taken back after {taken:.1f}s, before the bound"
    with pytest.raises(DBAPIError) as caught:
        frozen_holder.execute(text("SELECT 1"))
    assert isinstance(caught.value.orig, psycopg.errors.IdleInTransactionSessionTimeout)


def test_qbittorrent_locks_bound_their_transaction() -> None:
    """The locks held around qBittorrent calls are bounded too, above the calls' own timeouts
    (`qbt.QBT_LOCK_IDLE_MS`): a frozen holder gives an infohash, or the login turn, back."""
    assert 1000 * (3 * sum(qbt.REQUEST_TIMEOUT) + 15) < qbt.QBT_LOCK_IDLE_MS, "below what the calls may take"
    with torrent_decision("0" * 40) as s:
        assert s.scalar(IDLE_SETTING) == str(qbt.QBT_LOCK_IDLE_MS)
    with db.transaction() as s:
        s.execute(qbt.LOCK_LOGIN, {"url": "http://127.0.0.1:1", "idle_ms": qbt.QBT_LOCK_IDLE_MS})
        assert s.scalar(IDLE_SETTING) == str(qbt.QBT_LOCK_IDLE_MS)


def test_every_session_of_ours_is_bounded_and_a_frozen_one_ends() -> None:
    """The backstop (`DB_IDLE_IN_TRANSACTION_S`): a business transaction holding a request's row,
    in a process that froze (an API request in a paused container), is ended by Postgres, and
    the row is free again; before, a writer of that row (a step's fenced commit) waited for as
    long as the holder stayed frozen."""
    if get_settings().db_pooler == "transaction":
        pytest.skip("behind a transaction pooler PgBouncer's idle_transaction_timeout bounds this")
    assert SESSION_MS == "60000", "the default"
    with db.transaction() as s:
        assert s.scalar(IDLE_SETTING) == SESSION_MS
    engine = create_engine(get_settings().require_database_url(), poolclass=NullPool)
    db.bound_idle_transactions(engine, 1000)  # as `db.get_engine` does, with 1 s
    ref = runs.enqueue("probe", {}, idempotency_key=new_key())
    lock_run = text("SELECT id FROM engine.task_run WHERE id = :id FOR UPDATE")
    try:
        holder = engine.connect()
        assert holder.execute(lock_run, {"id": ref.task_run_id}).first() is not None  # held, then frozen
        time.sleep(1.5)
        with db.transaction() as s:  # within 5 s only if the frozen holder's session has ended
            s.execute(text("SET LOCAL lock_timeout = '5s'"))
            assert s.execute(lock_run, {"id": ref.task_run_id}).first() is not None
        with pytest.raises(DBAPIError) as caught:
            holder.execute(text("SELECT 1"))
        assert isinstance(caught.value.orig, psycopg.errors.IdleInTransactionSessionTimeout)
    finally:
        engine.dispose()
