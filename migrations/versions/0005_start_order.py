"""start order: pending runs of a kind, best first (priority, then age)

Revision ID: 0005_start_order
Revises: 0003_limits
Create Date: 2026-12-02

A start message may claim the pending run that should start first (`store.claims.CLAIM_START`);
this partial index makes that a probe of the few not-yet-started runs of one kind version.
"""

from alembic import op

revision = "0005_start_order"
down_revision = "0003_limits"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX task_run_start_idx ON engine.task_run (kind, version, priority DESC, created_at, id) "
        "WHERE status = 'pending'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX engine.task_run_start_idx")
