"""Leases while an attempt runs (invariant 3) and what the running body reads and writes.

The heartbeat renews every lease this process holds in one statement (`RENEW`); a lease that did
not renew is lost, and the body learns it at its next checkpoint. Business writes from a step are
fenced by `FENCE` in their own transaction: no row back, the writes roll back. The liveness
statements are psycopg SQL (`%(name)s`), run on each worker process' own session: that session
ends when the process dies, so a dead owner's leases are ended at once
(`tests/faults/test_recovery_fast.py`).

Each function runs the statement named like it in capitals (`claim`: `CLAIM`) unless
the table names others.

| function | from | to |
|---|---|---|
| `renew` | steps running under these tokens | lease extended; says whether a cancel was asked |
| `fence` | step running under this token | lease extended (the business transaction may commit) |
| `stop_reasons` | | whether a cancel was asked, whether the deadline passed |
| `report_progress` (`PROGRESS`) | step under this token | its progress shown |
| `results` | | the run's committed step results |
| `lock_and_identify` | | this session's liveness lock, the postmaster start |
| `serve_versions` | | shared locks naming the version queues this session's process consumes |
| `free_owner_keys` | | the owners' keys of running steps whose session is gone (same postmaster) |
| `end_leases_of_dead_owners` | running, owner's key among these and still free | lease ended now |
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg
from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.store.rows import changed

# RENEW and FENCE lock step rows inside a transaction of several statements. A holder frozen
# between them (SIGSTOP, a paused VM) would keep the rows locked for as long as it stays frozen,
# and the sweeper, which skips locked rows, would never expire its lease. So each also bounds how
# long its transaction may sit idle (`bounded`: `idle_in_transaction_session_timeout`, local to
# the transaction), to less than the lease it grants: Postgres ends a frozen holder's session,
# and with it the locks, before the lease runs out (`tests/faults/test_recovery_fast.py::
# test_a_worker_frozen_inside_a_fenced_transaction_is_taken_over_at_its_lease`).
RENEW = text(
    """
    WITH bounded AS MATERIALIZED (
        SELECT set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)
    )
    UPDATE engine.step s
       SET lease_until = now() + make_interval(secs => :ttl)
      FROM unnest(CAST(:ids AS bigint[]), CAST(:toks AS uuid[])) AS l(id, tok), bounded
     WHERE s.id = l.id AND s.lease_token = l.tok AND s.status = 'running'
 RETURNING s.id,
           (SELECT r.cancel_requested_at IS NOT NULL FROM engine.task_run r WHERE r.id = s.run_id)
    """
)

FENCE = text(
    """
    WITH bounded AS MATERIALIZED (
        SELECT set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)
    )
    UPDATE engine.step SET lease_until = now() + make_interval(secs => :ttl)
      FROM bounded
     WHERE id = :id AND lease_token = :tok AND status = 'running'
 RETURNING id
    """
)


def idle_bound_ms(ttl: float) -> int:
    """How long a transaction that renewed or fenced a lease of `ttl` seconds may sit idle: two
    thirds of the lease, so a frozen holder's session ends before the lease does."""
    return max(1, int(ttl * 1000 * 2 / 3))


# What a checkpoint asks: was a cancel requested, has the run's deadline passed (database clock).
STOP_REASONS = text(
    """
    SELECT cancel_requested_at IS NOT NULL AS cancel, coalesce(deadline_at <= now(), false) AS late
      FROM engine.task_run WHERE id = :id
    """
)

PROGRESS = text(
    "UPDATE engine.step SET progress = CAST(:p AS jsonb)"
    " WHERE id = :id AND lease_token = :tok AND status = 'running'"
)

RESULTS = text(
    "SELECT stage, name, result FROM engine.step WHERE run_id = :id AND status = 'succeeded' "
    "ORDER BY stage, item_index"
)

# The key of a bigint advisory lock is split over pg_locks' classid (high 32 bits) and objid
# (low 32 bits), with objsubid = 1. The owner suffix is `#<key>@<postmaster start, µs>`.
LOCK_AND_IDENTIFY = """
    SELECT pg_try_advisory_lock(%(key)s),
           (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint
"""
# A consumer of a version queue holds a shared advisory lock (CONSUMER_LOCK_NS, hashtext of the
# queue name) on its liveness session, for as long as that session lives. The sweeper re-sends a
# step whose message seems lost only to a queue such a lock names (`recovery.PUBLISH_DUE`): a
# version nobody serves gets one message per step, not one more every `REPUBLISH_AFTER_S`.
CONSUMER_LOCK_NS = 0x5EE9_0002
SERVE_VERSIONS = """
    SELECT count(*) FILTER (WHERE pg_try_advisory_lock_shared(%(ns)s, hashtext(k || '.v' || v::text)))
      FROM unnest(%(kinds)s::text[], %(versions)s::int[]) AS kv(k, v)
"""
# A running step's lease owner whose liveness lock nobody holds, on this postmaster: the process
# died, or its session dropped while it lives (it takes the same key again within a reap
# interval). The reaper ends such leases only for keys it saw free a grace period ago
# (`proj.engine.liveness.Suspects`), and the ending statement checks the lock again.
_FREE_OWNERS = """
    WITH held AS (
        SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
          FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    ), incarnation AS (
        SELECT ((extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint)::text AS start
    ), owned AS (
        SELECT s.id, s.lease_owner, split_part(split_part(s.lease_owner, '#', 2), '@', 1)::bigint AS key
          FROM engine.step s
         WHERE s.status = 'running' AND s.lease_until >= now()
           AND s.lease_owner ~ '#[0-9]+@[0-9]+$'
           AND split_part(s.lease_owner, '@', 2) = (SELECT start FROM incarnation)
    )
"""
FREE_OWNER_KEYS = (
    _FREE_OWNERS
    + """
    SELECT DISTINCT o.key FROM owned o WHERE o.key NOT IN (SELECT key FROM held)
"""
)
END_LEASES_OF_DEAD_OWNERS = (
    _FREE_OWNERS
    + """
    UPDATE engine.step s
       SET lease_until = now() - interval '1 millisecond'
      FROM owned o
     WHERE s.id = o.id AND s.status = 'running' AND s.lease_until >= now()
       AND o.key = ANY(%(keys)s::bigint[]) AND o.key NOT IN (SELECT key FROM held)
 RETURNING s.id, s.lease_owner
"""
)


class Renewed(NamedTuple):
    """A lease the heartbeat renewed, and whether its run was asked to cancel."""

    step_id: int
    cancel: bool


class StopReasons(NamedTuple):
    cancel: bool  # a cancel was requested
    late: bool  # the run's deadline has passed (the database's clock)


class StepResult(NamedTuple):
    stage: int
    name: str
    result: Any


class DeadOwnerLease(NamedTuple):
    step_id: int
    owner: str


def renew(s: Session, *, ttl: float, leases: Sequence[tuple[int, uuid.UUID]]) -> list[Renewed]:
    """Extend every `(step id, token)` lease still held; a lease missing from the answer is lost."""
    params = {
        "ttl": ttl,
        "idle_ms": idle_bound_ms(ttl),
        "ids": [i for i, _ in leases],
        "toks": [t for _, t in leases],
    }
    return [Renewed(int(r[0]), bool(r[1])) for r in s.execute(RENEW, params)]


def fence(s: Session, *, step_id: int, token: uuid.UUID, ttl: float) -> bool:
    """Lock the step row while `token` holds its lease (and extend it); False: the lease is gone
    and the caller's transaction must not commit."""
    params = {"ttl": ttl, "idle_ms": idle_bound_ms(ttl), "id": step_id, "tok": token}
    return s.execute(FENCE, params).first() is not None


def stop_reasons(s: Session, run_id: uuid.UUID) -> StopReasons | None:
    """Whether the run was asked to cancel and whether its deadline passed (None: no such run)."""
    row = s.execute(STOP_REASONS, {"id": run_id}).first()
    return None if row is None else StopReasons(bool(row.cancel), bool(row.late))


def report_progress(s: Session, *, step_id: int, token: uuid.UUID, progress: str) -> bool:
    """Show `progress` (JSON) on the step while `token` holds it; False: it does not."""
    return changed(s.execute(PROGRESS, {"p": progress, "id": step_id, "tok": token})) > 0


def results(s: Session, run_id: uuid.UUID) -> list[StepResult]:
    """The run's committed step results, by stage and item."""
    return [StepResult(*r) for r in s.execute(RESULTS, {"id": run_id})]


def lock_and_identify(conn: psycopg.Connection[Any], key: int) -> tuple[bool, int]:
    """On the liveness session: take its advisory lock `key`; whether it was taken, and the
    postmaster start (µs) the lock lives under."""
    row = conn.execute(LOCK_AND_IDENTIFY, {"key": key}).fetchone()
    assert row is not None
    return bool(row[0]), int(row[1])


def serve_versions(conn: psycopg.Connection[Any], versions: Sequence[tuple[str, int]]) -> int:
    """On the liveness session: say it consumes these (kind, version) queues until it ends;
    how many of the locks were taken (a shared lock is refused only to an exclusive holder)."""
    params = {"ns": CONSUMER_LOCK_NS, "kinds": [k for k, _ in versions], "versions": [v for _, v in versions]}
    row = conn.execute(SERVE_VERSIONS, params).fetchone()
    return int(row[0]) if row else 0


def free_owner_keys(conn: psycopg.Connection[Any]) -> set[int]:
    """The liveness keys named by running steps' owners (this postmaster) that nobody holds: each
    a dead process, or a live one between its session's loss and its retake of the key."""
    return {int(r[0]) for r in conn.execute(FREE_OWNER_KEYS).fetchall()}


def end_leases_of_dead_owners(conn: psycopg.Connection[Any], keys: Sequence[int]) -> list[DeadOwnerLease]:
    """End the leases owned under `keys` whose lock is still free (the reaper, on its own
    session, for keys it saw free a grace period ago)."""
    rows = conn.execute(END_LEASES_OF_DEAD_OWNERS, {"keys": list(keys)}).fetchall()
    return [DeadOwnerLease(int(r[0]), str(r[1])) for r in rows]
