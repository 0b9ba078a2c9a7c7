"""Statuses as domains: the hot tables' CHECK constraints become domain constraints

Revision ID: 0012_status_domains
Revises: 0011_attempt_on_step
Create Date: 2026-12-05

Why: PostgreSQL (15) re-reads a table's CHECK constraints from their stored text (`stringToNode`)
and compiles them again in every statement that inserts or updates a row of the table, whatever
columns the statement changes. `engine.step` and `engine.task_run` are written by every claim
and every commit, so their three checks cost about 0.04 ms of Postgres CPU per message step, a
tenth of the engine's Postgres CPU per step (`bench.step_cost`; issue #17). A domain's
constraint is cached, parsed once per backend, and checked only where a statement assigns the
column. The values allowed are the same (`tests/integration/test_engine_schema.py`: the domains
hold exactly the status enums and refuse any other value).

- `engine.run_status` (`task_run.status`), `engine.step_status` (`step.status`) and
  `engine.blocked_on` (`step.blocked_on`), each a domain over `text`;
- the view `engine.attempt` reads `step.status`, so it is dropped and created again around the
  change of type (its definition as in 0011);
- no table is rewritten: each column changes to its domain while the domain has no constraint
  yet (a relabel), then the domain's constraint is added, which scans the rows to check them.
"""

from alembic import op

revision = "0012_status_domains"
down_revision = "0011_attempt_on_step"
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
    op.execute("DROP VIEW engine.attempt")
    # The domains get their constraints after the columns take them: a column changed to a
    # domain that has constraints is rewritten, and one that has none only relabelled; the
    # constraint added then is checked against the rows by a scan.
    op.execute("CREATE DOMAIN engine.run_status AS TEXT")
    op.execute("CREATE DOMAIN engine.step_status AS TEXT")
    op.execute("CREATE DOMAIN engine.blocked_on AS TEXT")
    op.execute(
        """
        ALTER TABLE engine.task_run DROP CONSTRAINT task_run_status_check,
            ALTER COLUMN status TYPE engine.run_status
        """
    )
    op.execute(
        """
        ALTER TABLE engine.step DROP CONSTRAINT step_status_check,
            DROP CONSTRAINT step_blocked_on_check,
            ALTER COLUMN status TYPE engine.step_status,
            ALTER COLUMN blocked_on TYPE engine.blocked_on
        """
    )
    op.execute(
        """
        ALTER DOMAIN engine.run_status ADD CONSTRAINT run_status_check
            CHECK (VALUE IN ('pending','running','waiting','succeeded','failed','canceled'))
        """
    )
    op.execute(
        """
        ALTER DOMAIN engine.step_status ADD CONSTRAINT step_status_check
            CHECK (VALUE IN ('pending','running','waiting','succeeded','failed','canceled'))
        """
    )
    op.execute(
        "ALTER DOMAIN engine.blocked_on ADD CONSTRAINT blocked_on_check CHECK (VALUE IN ('global','key'))"
    )
    op.execute(ATTEMPT_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW engine.attempt")
    op.execute(
        """
        ALTER TABLE engine.task_run ALTER COLUMN status TYPE TEXT,
            ADD CONSTRAINT task_run_status_check CHECK (status IN ('pending','running','waiting','succeeded','failed','canceled'))
        """
    )
    op.execute(
        """
        ALTER TABLE engine.step ALTER COLUMN status TYPE TEXT,
            ALTER COLUMN blocked_on TYPE TEXT,
            ADD CONSTRAINT step_status_check CHECK (status IN ('pending','running','waiting','succeeded','failed','canceled')),
            ADD CONSTRAINT step_blocked_on_check CHECK (blocked_on IN ('global','key'))
        """
    )
    op.execute("DROP DOMAIN engine.run_status")
    op.execute("DROP DOMAIN engine.step_status")
    op.execute("DROP DOMAIN engine.blocked_on")
    op.execute(ATTEMPT_VIEW)
