"""Runs and their stages: creating a run with its first stage, advancing to the next stage
under the run row lock (the fan-in is counted there), and finishing a run.

| statement | from | to |
|---|---|---|
| `INSERT_RUN` | no run of `(kind, key)` | run and its first stage's steps pending (no row: key taken) |
| `LOCK_RUN` | | run row locked for the advance |
| `OPEN_IN_STAGE` | | how many steps of the stage have not succeeded (0: advance) |
| `CREATE_STAGE` | run at stage n-1 | stage n's steps pending, the run pointed at n |
| `CLAIM_NEXT` | run at stage n-1 | stage n's single step inserted running for this process |
| `FINISH_RUN` | run live | succeeded, with its result (the one place a run succeeds in a transaction) |

`INSERT_RUN` also records the run's parent (a child step's run) and its deadline: the earliest of
`deadline_at`, the parent's deadline (a child inherits it) and `now() + deadline_s` of its kind,
in the database's clock (`least` ignores the ones not given). `LOCK_RUN` says whether the
deadline has passed: then no next stage is created and the run ends (`chain.expire_run`).
Every run that finishes notifies `engine_run_finished` (`store.children`).

Existing step rows are left alone (`ON CONFLICT DO NOTHING`): a stage is created once however
often its predecessor's commit is retried. Proofs: `tests/integration/test_engine_basics.py`,
`tests/integration/test_inline.py`.
"""

from __future__ import annotations

from sqlalchemy import text

# The run and its first stage in one statement (the step arrays come from `chain.stage_rows`;
# an empty first stage inserts the run alone). No row back: the key names an existing run.
INSERT_RUN = text(
    """
    WITH run AS (
        INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash,
                                     priority, concurrency_key, available_at, trace,
                                     current_stage, current_step, parent_run_id, deadline_at)
        VALUES (:run, :kind, :version, :key, CAST(:input AS jsonb), :hash, :priority, :ckey,
                coalesce(:at, now()), CAST(:trace AS jsonb), :stage, :label, :parent,
                least(CAST(:deadline AS timestamptz), CAST(:inherited AS timestamptz),
                      now() + make_interval(secs => CAST(:deadline_s AS double precision))))
        ON CONFLICT (kind, idempotency_key) DO NOTHING
        RETURNING id
    ), ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, item, max_attempts,
                                 next_attempt_at, published_at)
        SELECT run.id, :stage, n.name, n.idx, CAST(n.item AS jsonb), n.max,
               coalesce(:at, now()), CASE WHEN :due THEN now() END
          FROM run, unnest(CAST(:names AS text[]), CAST(:idxs AS int[]), CAST(:items AS text[]),
                           CAST(:maxs AS int[])) AS n(name, idx, item, max)
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, name, item_index
    )
    SELECT run.id AS run_id, ins.id, ins.name FROM run LEFT JOIN ins ON true ORDER BY ins.item_index
    """
)

EXISTING_RUN = text(
    "SELECT id, input_hash FROM engine.task_run WHERE kind = :kind AND idempotency_key = :key"
)

LOCK_RUN = text(
    """
    SELECT id, kind, version, input, status, current_stage, cancel_requested_at, priority, trace,
           created_at, coalesce(deadline_at <= now(), false) AS past_deadline
      FROM engine.task_run WHERE id = :id
       FOR UPDATE
    """
)

# A statement of its own, after the run lock: its snapshot sees every committed sibling.
OPEN_IN_STAGE = text(
    "SELECT count(*) FROM engine.step WHERE run_id = :id AND stage = :stage AND status <> 'succeeded'"
)

# A stage's step rows and the run pointer in one statement (a data-modifying CTE always runs, so
# an empty fan-out still moves the pointer).
CREATE_STAGE = text(
    """
    WITH ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, item, max_attempts,
                                 next_attempt_at, published_at)
        SELECT :run, :stage, n.name, n.idx, CAST(n.item AS jsonb), n.max,
               coalesce(:at, now()), CASE WHEN :due THEN now() END
          FROM unnest(CAST(:names AS text[]), CAST(:idxs AS int[]), CAST(:items AS text[]),
                      CAST(:maxs AS int[])) AS n(name, idx, item, max)
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, name, item_index
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :stage, current_step = :label, updated_at = now()
         WHERE id = :run
    )
    SELECT id, name FROM ins ORDER BY item_index
    """
)

# The next stage's one step, inserted claimed for the committing process (`attempts.Carry`): the
# step row, the run pointer and the attempt record, in a transaction that locked the run already.
CLAIM_NEXT = text(
    """
    WITH ins AS (
        INSERT INTO engine.step (run_id, stage, name, item_index, max_attempts, next_attempt_at,
                                 published_at, status, lease_token, lease_owner, lease_until,
                                 attempts, started_at)
        SELECT :run, :next_stage, :next_name, 0, :next_max, now(), now(), 'running', :next_tok,
               :owner, now() + make_interval(secs => :ttl), 1, now()
        ON CONFLICT (run_id, stage, item_index) DO NOTHING
        RETURNING id, now() AS claimed_at
    ), pointed AS (
        UPDATE engine.task_run SET current_stage = :next_stage, current_step = :next_label,
               updated_at = now()
         WHERE id = :run
    ), attempt AS (
        INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker)
        SELECT id, 1, :next_tok, :owner FROM ins
    )
    SELECT id, claimed_at FROM ins
    """
)

FINISH_RUN = text(
    """
    UPDATE engine.task_run
       SET status = 'succeeded', result = CAST(:result AS jsonb), current_stage = :end_stage,
           current_step = NULL, finished_at = now(), updated_at = now()
     WHERE id = :id AND status IN ('pending', 'running', 'waiting')
    RETURNING id, kind, version, trace, created_at, finished_at, parent_run_id,
              pg_notify('engine_run_finished', id::text)::text AS notified
    """
)
