"""children and deadlines: a run's parent, and the deadline of a run

Revision ID: 0009_children_deadlines
Revises: 0008_metrics
Create Date: 2026-12-04

- `engine.task_run.parent_run_id`: the run whose child step enqueued this run (NULL for a run
  enqueued through the port). When a run with a parent finishes, the finishing transaction
  stores the signal `run-finished:<id>` and wakes the parent's parked child step.
- `engine.task_run.deadline_at`: past it no step of the run is claimed; the sweeper fails the
  run with `DeadlineExceeded` (and enqueues its compensation) once no step holds a live lease.
- `task_run_parent_idx`: a run's children (the cancel cascade, the admin tree).
- `task_run_live_child_idx`: the sweeper's backstop for the cascade (live children of an ended
  parent: `store.children.ORPHANED_CHILDREN`).
- `task_run_deadline_idx`: the sweeper's pass over live runs past their deadline.
"""

from alembic import op

revision = "0009_children_deadlines"
down_revision = "0008_metrics"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE engine.task_run ADD COLUMN parent_run_id UUID")
    op.execute("ALTER TABLE engine.task_run ADD COLUMN deadline_at TIMESTAMP WITH TIME ZONE")
    op.execute(
        "CREATE INDEX task_run_parent_idx ON engine.task_run (parent_run_id) WHERE parent_run_id IS NOT NULL"
    )
    op.execute(
        "CREATE INDEX task_run_live_child_idx ON engine.task_run (parent_run_id) "
        "WHERE parent_run_id IS NOT NULL AND status IN ('pending', 'running', 'waiting')"
    )
    op.execute(
        "CREATE INDEX task_run_deadline_idx ON engine.task_run (deadline_at) "
        "WHERE deadline_at IS NOT NULL AND status IN ('pending', 'running', 'waiting')"
    )


def downgrade() -> None:
    op.execute("DROP INDEX engine.task_run_deadline_idx")
    op.execute("DROP INDEX engine.task_run_live_child_idx")
    op.execute("DROP INDEX engine.task_run_parent_idx")
    op.execute("ALTER TABLE engine.task_run DROP COLUMN deadline_at")
    op.execute("ALTER TABLE engine.task_run DROP COLUMN parent_run_id")
