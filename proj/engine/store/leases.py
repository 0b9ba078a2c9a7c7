"""Leases while an attempt runs (invariant 3) and what the running body reads and writes.

The heartbeat renews every lease this process holds in one statement (`RENEW`); a lease that did
not renew is lost, and the body learns it at its next checkpoint. Business writes from a step are
fenced by `FENCE` in their own transaction: no row back, the writes roll back. The liveness
statements are psycopg SQL (`%(name)s`), run on each worker process' own session: that session
ends when the process dies, so a dead owner's leases are ended at once
(`tests/faults/test_recovery_fast.py`).

| statement | from | to |
|---|---|---|
| `RENEW` | steps running under these tokens | lease extended; says whether a cancel was asked |
| `FENCE` | step running under this token | lease extended (the business transaction may commit) |
| `PROGRESS` | step under this token | its progress shown |
| `END_LEASES_OF_DEAD_OWNERS` | running, owner's session gone (same postmaster) | lease ended now |
"""

from __future__ import annotations

from sqlalchemy import text

RENEW = text(
    """
    UPDATE engine.step s
       SET lease_until = now() + make_interval(secs => :ttl)
      FROM unnest(CAST(:ids AS bigint[]), CAST(:toks AS uuid[])) AS l(id, tok)
     WHERE s.id = l.id AND s.lease_token = l.tok AND s.status = 'running'
 RETURNING s.id,
           (SELECT r.cancel_requested_at IS NOT NULL FROM engine.task_run r WHERE r.id = s.run_id)
    """
)

FENCE = text(
    """
    UPDATE engine.step SET lease_until = now() + make_interval(secs => :ttl)
     WHERE id = :id AND lease_token = :tok AND status = 'running'
 RETURNING id
    """
)

# What a checkpoint asks: was a cancel requested, has the run's deadline passed (database clock).
STOP_REASONS = text(
    """
    SELECT cancel_requested_at IS NOT NULL AS cancel, coalesce(deadline_at <= now(), false) AS late
      FROM engine.task_run WHERE id = :id
    """
)

PROGRESS = text("UPDATE engine.step SET progress = CAST(:p AS jsonb) WHERE id = :id AND lease_token = :tok")

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
END_LEASES_OF_DEAD_OWNERS = """
    WITH held AS (
        SELECT (l.classid::bigint << 32) | l.objid::bigint AS key
          FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    ), incarnation AS (
        SELECT ((extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint)::text AS start
    )
    UPDATE engine.step s
       SET lease_until = now() - interval '1 millisecond'
     WHERE s.status = 'running' AND s.lease_until >= now()
       AND s.lease_owner ~ '#[0-9]+@[0-9]+$'
       AND split_part(s.lease_owner, '@', 2) = (SELECT start FROM incarnation)
       AND split_part(split_part(s.lease_owner, '#', 2), '@', 1)::bigint NOT IN (SELECT key FROM held)
 RETURNING s.id, s.lease_owner
"""
