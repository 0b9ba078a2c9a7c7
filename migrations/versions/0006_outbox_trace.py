"""outbox trace: the W3C trace context of the transaction that added an event

Revision ID: 0006_outbox_trace
Revises: 0005_start_order
Create Date: 2026-12-03

`outbox.add` stores the caller's trace context with the event, so the dispatch (and the run it
enqueues) joins the business request's trace instead of starting one of its own.
"""

from alembic import op

revision = "0006_outbox_trace"
down_revision = "0005_start_order"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE outbox.outbox_event ADD COLUMN trace jsonb")


def downgrade() -> None:
    op.execute("ALTER TABLE outbox.outbox_event DROP COLUMN trace")
