"""A child canceled by its parent's end is told apart from one an operator canceled

Revision ID: 0013_canceled_by_parent
Revises: 0012_status_domains
Create Date: 2026-12-06

- `engine.task_run.canceled_by_parent`: set when the cancel request that stopped a run came from
  its parent's end (the cascade of a failure, cancel or deadline, or the sweeper's orphan
  backstop), not from an operator. Why: a parent dead letter that an operator retries must start
  a fresh child in place of each one its own failure canceled (a canceled run never runs again),
  while a child the operator canceled still fails the parent's step
  (`tests/integration/test_children_retry.py`). Adding a NOT NULL column with a constant default
  rewrites nothing on PostgreSQL 11 and later.
"""

from alembic import op

revision = "0013_canceled_by_parent"
down_revision = "0012_status_domains"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE engine.task_run ADD COLUMN canceled_by_parent BOOLEAN NOT NULL DEFAULT false")


def downgrade() -> None:
    op.execute("ALTER TABLE engine.task_run DROP COLUMN canceled_by_parent")
