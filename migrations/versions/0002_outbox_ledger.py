"""outbox and ledger schemas: outbox_event, asset_operation

Revision ID: 0002_outbox_ledger
Revises: 0001_engine
Create Date: 2026-12-02
"""

from alembic import op

revision = "0002_outbox_ledger"
down_revision = "0001_engine"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE SCHEMA IF NOT EXISTS outbox")
    op.execute(
        """
CREATE TABLE outbox.outbox_event (
	id BIGSERIAL NOT NULL, 
	kind TEXT NOT NULL, 
	idempotency_key TEXT NOT NULL, 
	payload JSONB NOT NULL, 
	status TEXT DEFAULT 'pending' NOT NULL, 
	attempts INTEGER DEFAULT '0' NOT NULL, 
	next_attempt_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	last_error JSONB, 
	run_ref TEXT, 
	created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	dispatched_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (id), 
	CONSTRAINT outbox_event_kind_key UNIQUE (kind, idempotency_key), 
	CONSTRAINT outbox_event_status_check CHECK (status IN ('pending','dispatched','dead'))
)
        """
    )
    op.execute(
        """
CREATE INDEX outbox_event_due_idx ON outbox.outbox_event (next_attempt_at) WHERE status = 'pending'
        """
    )
    op.execute(
        """
CREATE INDEX outbox_event_dead_idx ON outbox.outbox_event (created_at) WHERE status = 'dead'
        """
    )
    op.execute("CREATE SCHEMA IF NOT EXISTS ledger")
    op.execute(
        """
CREATE TABLE ledger.asset_operation (
	op_key TEXT NOT NULL, 
	run_id UUID, 
	step TEXT, 
	effect_kind TEXT NOT NULL, 
	plan JSONB NOT NULL, 
	status TEXT DEFAULT 'attempting' NOT NULL, 
	attempts INTEGER DEFAULT '0' NOT NULL, 
	attempt_token UUID, 
	attempt_started_at TIMESTAMP WITH TIME ZONE, 
	result JSONB, 
	resolution TEXT, 
	last_error JSONB, 
	created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	finished_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (op_key), 
	CONSTRAINT asset_operation_status_check CHECK (status IN ('attempting','done')), 
	CONSTRAINT asset_operation_resolution_check CHECK (resolution IS NULL OR resolution IN ('effect','reconciled'))
)
        """
    )
    op.execute(
        """
CREATE INDEX asset_operation_run_idx ON ledger.asset_operation (run_id)
        """
    )
    op.execute(
        """
CREATE INDEX asset_operation_open_idx ON ledger.asset_operation (attempt_started_at) WHERE status = 'attempting'
        """
    )


def downgrade() -> None:
    op.execute("DROP SCHEMA ledger CASCADE")
    op.execute("DROP SCHEMA outbox CASCADE")
