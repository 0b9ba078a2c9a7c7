"""An attempt that met a service outage is not counted against the step's attempts

Revision ID: 0014_outages
Revises: 0013_canceled_by_parent
Create Date: 2026-12-07

- `engine.step.outages`: how many of the step's attempts ended in `Unavailable` (a service the
  step needs was down) inside its policy's outage window. The attempts a step has spent are
  `attempts - outages`. Why: qBittorrent restarting for an upgrade, a webhook receiver down for
  a night, spent a policy's ten attempts in minutes and left a dead letter the operator had to
  retry by hand (`tests/integration/test_outages.py`).
- `engine.step.outage_since`: when the outage the step is waiting out began (NULL: none). An
  outage longer than the policy's `outage_s` counts its attempts again.

- `step_outage_idx`, partial on `outage_since IS NOT NULL`: `/metrics` reads the steps waiting
  out an outage at every scrape (`proj_steps_in_outage`); the index holds only those.

Both columns are constant defaults: nothing is rewritten on PostgreSQL 11 and later.
"""

from alembic import op

revision = "0014_outages"
down_revision = "0013_canceled_by_parent"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE engine.step ADD COLUMN outages INTEGER NOT NULL DEFAULT 0, "
        "ADD COLUMN outage_since TIMESTAMP WITH TIME ZONE"
    )
    op.execute("CREATE INDEX step_outage_idx ON engine.step (outage_since) WHERE outage_since IS NOT NULL")


def downgrade() -> None:
    op.execute("DROP INDEX engine.step_outage_idx")
    op.execute("ALTER TABLE engine.step DROP COLUMN outages, DROP COLUMN outage_since")
