"""result() waiters: only a run somebody awaits notifies when it finishes

Revision ID: 0010_result_awaited
Revises: 0009_children_deadlines
Create Date: 2026-12-04

- `engine.task_run.result_awaited`: set by `TaskEngine.result()` after it LISTENs; the statements
  that finish a run issue `pg_notify('engine_run_finished', …)` only when it is set. A
  notification serialises committing transactions on Postgres' notify queue, which every run
  paid before (`proj/engine/store/children.py`). Adding a NOT NULL column with a constant
  default rewrites nothing on PostgreSQL 11 and later.
"""

from alembic import op

revision = "0010_result_awaited"
down_revision = "0009_children_deadlines"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE engine.task_run ADD COLUMN result_awaited BOOLEAN NOT NULL DEFAULT false")


def downgrade() -> None:
    op.execute("ALTER TABLE engine.task_run DROP COLUMN result_awaited")
