"""The running or successful attempt lives on its step row; `step_attempt` logs the others

Revision ID: 0011_attempt_on_step
Revises: 0010_result_awaited
Create Date: 2026-12-05

Why: every step wrote its `step_attempt` row twice, an insert at the claim and an update at the
commit: two of its six row writes, about 7 % of throughput in both modes (`bench/README.md`,
session 8). Now:
- the claim stamps `engine.step.claimed_at`, and the step row (its `attempts`, `lease_token`,
  `lease_owner`, `claimed_at`, `finished_at`) stands for the attempt that runs, or that
  succeeded;
- `engine.step_attempt` gets a row only when an attempt ends any other way (retry, failed,
  canceled, parked) or is taken from its holder (an orphan: a killed worker, a lost lease, a
  canceled run);
- `engine.attempt`, a view, is the whole history as `step_attempt` used to hold it.

Upgrade: a running step's open attempt row moves onto the step row (its `claimed_at`), so that
the view shows it once. Steps claimed before the upgrade and finished by an older worker keep
their closed rows and no `claimed_at`, so the view shows those once too.
"""

from alembic import op

revision = "0011_attempt_on_step"
down_revision = "0010_result_awaited"
branch_labels = None
depends_on = None

ATTEMPT_VIEW = """
CREATE VIEW engine.attempt AS
SELECT a.id, a.step_id, a.attempt, a.lease_token, a.worker, a.outcome, a.error, a.started_at, a.ended_at
  FROM engine.step_attempt a
UNION ALL
SELECT NULL::bigint, s.id, s.attempts, s.lease_token, s.lease_owner,
       CASE WHEN s.status = 'succeeded' THEN 'succeeded' END, NULL::jsonb, s.claimed_at,
       CASE WHEN s.status = 'succeeded' THEN s.finished_at END
  FROM engine.step s
 WHERE s.claimed_at IS NOT NULL AND s.status IN ('running', 'succeeded')
"""


def upgrade() -> None:
    op.execute("ALTER TABLE engine.step ADD COLUMN claimed_at TIMESTAMP WITH TIME ZONE")
    op.execute(
        """
        WITH open AS (
            DELETE FROM engine.step_attempt a USING engine.step s
             WHERE s.status = 'running' AND a.step_id = s.id AND a.lease_token = s.lease_token
               AND a.outcome IS NULL
            RETURNING a.step_id, a.started_at
        )
        UPDATE engine.step s SET claimed_at = open.started_at FROM open WHERE s.id = open.step_id
        """
    )
    op.execute(ATTEMPT_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW engine.attempt")
    op.execute(
        """
        INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker, outcome, started_at, ended_at)
        SELECT id, attempts, lease_token, lease_owner,
               CASE WHEN status = 'succeeded' THEN 'succeeded' END, claimed_at,
               CASE WHEN status = 'succeeded' THEN finished_at END
          FROM engine.step WHERE claimed_at IS NOT NULL AND status IN ('running', 'succeeded')
        """
    )
    op.execute("ALTER TABLE engine.step DROP COLUMN claimed_at")
