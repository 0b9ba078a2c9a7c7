"""Slots of limited kinds (`global_limit`, `concurrency_limit` per key), counted in Postgres
across all workers, and the line of steps waiting for one.

A claim of a limited kind takes the gate's advisory lock (`LOCK_GATE`, held to the commit, always
global before key, so claims never deadlock), counts the holders, and either claims or is refused
(`DENY`: the step stays `pending` with its reason). Slots are counted in runs: fan-out items of a
run that holds one share it. Waiters are pending, due steps of live runs refused recently
(`blocked_at` is renewed at each refusal); `:prio`, `:created`, `:run` NULL means the whole line,
set means only those ordered before that run. Proof: `tests/integration/test_limits.py`.

| statement | from | to |
|---|---|---|
| `DENY` | step pending | pending, with `blocked_reason`/`blocked_on`/`blocked_at`, re-published later |
| `NUDGE_WAITERS` | waiters pending, not locked | published now (their message goes out) |
"""

from __future__ import annotations

from sqlalchemy import text

SLOT_OF = text(
    """
    SELECT r.id AS run_id, r.kind, r.version, r.concurrency_key, r.priority, r.created_at
      FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id
     WHERE s.id = :id AND (s.status = 'pending' AND s.next_attempt_at <= now()) IS TRUE  -- by pkey
       AND r.status IN ('pending', 'running', 'waiting') AND r.cancel_requested_at IS NULL
    """
)

LOCK_GATE = text("SELECT pg_advisory_xact_lock(hashtext(:lock))")

HOLDERS_GLOBAL = text(
    """
    SELECT count(DISTINCT h.run_id) AS runs,
           coalesce(bool_or(h.run_id = CAST(:run AS uuid)), false) AS mine
      FROM engine.step h JOIN engine.task_run hr ON hr.id = h.run_id
     WHERE h.status = 'running' AND h.lease_until > now() AND hr.kind = :kind
    """
)

HOLDERS_KEY = text(
    """
    SELECT count(DISTINCT h.run_id) AS runs,
           coalesce(bool_or(h.run_id = CAST(:run AS uuid)), false) AS mine
      FROM engine.step h JOIN engine.task_run hr ON hr.id = h.run_id
     WHERE h.status = 'running' AND h.lease_until > now() AND hr.kind = :kind
       AND hr.concurrency_key = :key
    """
)

# For the global gate only steps refused by the global limit count: one refused by its own key
# could not use a global slot anyway.
WAITERS_GLOBAL = text(
    """
    SELECT w.id, w.name, wr.kind, wr.version, wr.priority
      FROM engine.step w JOIN engine.task_run wr ON wr.id = w.run_id
     WHERE w.status = 'pending' AND w.blocked_at IS NOT NULL AND w.next_attempt_at <= now()
       AND w.blocked_at > now() - make_interval(secs => :fresh)
       AND wr.kind = :kind AND w.blocked_on = 'global'
       AND wr.status IN ('pending', 'running', 'waiting') AND wr.cancel_requested_at IS NULL
       AND (CAST(:prio AS int) IS NULL
            OR (-wr.priority, wr.created_at, wr.id)
               < (-CAST(:prio AS int), CAST(:created AS timestamptz), CAST(:run AS uuid)))
     ORDER BY wr.priority DESC, wr.created_at, wr.id, w.id
     LIMIT :n
    """
)

WAITERS_KEY = text(
    """
    SELECT w.id, w.name, wr.kind, wr.version, wr.priority
      FROM engine.step w JOIN engine.task_run wr ON wr.id = w.run_id
     WHERE w.status = 'pending' AND w.blocked_at IS NOT NULL AND w.next_attempt_at <= now()
       AND w.blocked_at > now() - make_interval(secs => :fresh)
       AND wr.kind = :kind AND wr.concurrency_key = :key
       AND wr.status IN ('pending', 'running', 'waiting') AND wr.cancel_requested_at IS NULL
       AND (CAST(:prio AS int) IS NULL
            OR (-wr.priority, wr.created_at, wr.id)
               < (-CAST(:prio AS int), CAST(:created AS timestamptz), CAST(:run AS uuid)))
     ORDER BY wr.priority DESC, wr.created_at, wr.id, w.id
     LIMIT :n
    """
)

DENY = text(
    """
    UPDATE engine.step
       SET blocked_reason = :reason, blocked_on = :scope, blocked_at = now(), published_at = now()
     WHERE id = :id AND (status = 'pending') IS TRUE
    """
)

# A locked row is being claimed already: skip it, never wait.
NUDGE_WAITERS = text(
    """
    UPDATE engine.step SET published_at = now()
     WHERE id IN (SELECT id FROM engine.step
                   WHERE id = ANY(:ids) AND (status = 'pending') IS TRUE FOR UPDATE SKIP LOCKED)
    RETURNING id
    """
)
