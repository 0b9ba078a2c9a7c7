"""limits: blocked steps (per-key and per-kind concurrency limits) and their indexes

Revision ID: 0003_limits
Revises: 0004_acquisition
Create Date: 2026-12-02

A claim that finds no free slot leaves the step `pending` with `blocked_reason` (shown by
`runs.get`), `blocked_on` (which limit: 'global' or 'key') and `blocked_at` (the last denial:
fresh waiters keep their place in line).

It revises 0004_acquisition, which was already the head when this was written (the chain is
0002 → 0004 → 0003); `alembic heads` must stay single.
"""

from alembic import op

revision = "0003_limits"
down_revision = "0004_acquisition"  # the head when written: 0002 → 0004 → 0003
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE engine.step ADD COLUMN blocked_reason TEXT")
    op.execute("ALTER TABLE engine.step ADD COLUMN blocked_at TIMESTAMP WITH TIME ZONE")
    op.execute("ALTER TABLE engine.step ADD COLUMN blocked_on TEXT CHECK (blocked_on IN ('global','key'))")
    # Waiters in line for a slot (few rows: only blocked, pending steps).
    op.execute(
        "CREATE INDEX step_blocked_idx ON engine.step (run_id) WHERE status = 'pending' AND blocked_at IS NOT NULL"
    )
    # Holders and waiters are counted per kind and key among active runs.
    op.execute(
        "CREATE INDEX task_run_kind_key_idx ON engine.task_run (kind, concurrency_key) "
        "WHERE status IN ('pending','running','waiting')"
    )
    op.execute("CREATE INDEX step_running_run_idx ON engine.step (run_id) WHERE status = 'running'")


def downgrade() -> None:
    op.execute("DROP INDEX engine.step_running_run_idx")
    op.execute("DROP INDEX engine.task_run_kind_key_idx")
    op.execute("DROP INDEX engine.step_blocked_idx")
    op.execute("ALTER TABLE engine.step DROP COLUMN blocked_on")
    op.execute("ALTER TABLE engine.step DROP COLUMN blocked_at")
    op.execute("ALTER TABLE engine.step DROP COLUMN blocked_reason")
