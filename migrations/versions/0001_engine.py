"""engine schema: runs, steps, attempts, signals

Revision ID: 0001_engine
Revises:
Create Date: 2026-12-02
"""

from alembic import op

revision = "0001_engine"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE SCHEMA IF NOT EXISTS engine")
    op.execute(
        """
CREATE TABLE engine.task_run (
	id UUID NOT NULL, 
	kind TEXT NOT NULL, 
	version INTEGER NOT NULL, 
	idempotency_key TEXT NOT NULL, 
	input JSONB NOT NULL, 
	input_hash TEXT NOT NULL, 
	status TEXT DEFAULT 'pending' NOT NULL CHECK (status IN ('pending','running','waiting','succeeded','failed','canceled')), 
	current_stage INTEGER DEFAULT '0' NOT NULL, 
	current_step TEXT, 
	result JSONB, 
	last_error JSONB, 
	priority INTEGER DEFAULT '0' NOT NULL, 
	concurrency_key TEXT, 
	cancel_requested_at TIMESTAMP WITH TIME ZONE, 
	cancel_reason TEXT, 
	trace JSONB, 
	available_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	started_at TIMESTAMP WITH TIME ZONE, 
	finished_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (id), 
	CONSTRAINT task_run_kind_key UNIQUE (kind, idempotency_key)
)
        """
    )
    op.execute(
        """
CREATE INDEX task_run_concurrency_idx ON engine.task_run (concurrency_key) WHERE concurrency_key IS NOT NULL AND status IN ('pending','running','waiting')
        """
    )
    op.execute(
        """
CREATE INDEX task_run_cancel_idx ON engine.task_run (cancel_requested_at) WHERE cancel_requested_at IS NOT NULL AND status IN ('pending','running','waiting')
        """
    )
    op.execute(
        """
CREATE INDEX task_run_status_idx ON engine.task_run (kind, version, status)
        """
    )
    op.execute(
        """
CREATE TABLE engine.task_signal (
	id BIGSERIAL NOT NULL, 
	topic TEXT NOT NULL, 
	payload JSONB, 
	created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	PRIMARY KEY (id)
)
        """
    )
    op.execute(
        """
CREATE INDEX task_signal_topic_idx ON engine.task_signal (topic, created_at)
        """
    )
    op.execute(
        """
CREATE TABLE engine.step (
	id BIGSERIAL NOT NULL, 
	run_id UUID NOT NULL, 
	stage INTEGER NOT NULL, 
	name TEXT NOT NULL, 
	item_index INTEGER DEFAULT '0' NOT NULL, 
	item JSONB, 
	status TEXT DEFAULT 'pending' NOT NULL CHECK (status IN ('pending','running','waiting','succeeded','failed','canceled')), 
	attempts INTEGER DEFAULT '0' NOT NULL, 
	max_attempts INTEGER NOT NULL, 
	next_attempt_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	published_at TIMESTAMP WITH TIME ZONE, 
	lease_token UUID, 
	lease_until TIMESTAMP WITH TIME ZONE, 
	lease_owner TEXT, 
	wait_topic TEXT, 
	wait_until TIMESTAMP WITH TIME ZONE, 
	wait_since TIMESTAMP WITH TIME ZONE, 
	wakeups INTEGER DEFAULT '0' NOT NULL, 
	result JSONB, 
	error JSONB, 
	progress JSONB, 
	created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	started_at TIMESTAMP WITH TIME ZONE, 
	finished_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (id), 
	CONSTRAINT step_run_stage_item UNIQUE (run_id, stage, item_index), 
	FOREIGN KEY(run_id) REFERENCES engine.task_run (id) ON DELETE CASCADE
)
        """
    )
    op.execute(
        """
CREATE INDEX step_wait_topic_idx ON engine.step (wait_topic) WHERE status = 'waiting'
        """
    )
    op.execute(
        """
CREATE INDEX step_due_idx ON engine.step (next_attempt_at) WHERE status = 'pending'
        """
    )
    op.execute(
        """
CREATE INDEX step_wait_until_idx ON engine.step (wait_until) WHERE status = 'waiting'
        """
    )
    op.execute(
        """
CREATE INDEX step_lease_idx ON engine.step (lease_until) WHERE status = 'running'
        """
    )
    op.execute(
        """
CREATE TABLE engine.step_attempt (
	id BIGSERIAL NOT NULL, 
	step_id BIGINT NOT NULL, 
	attempt INTEGER NOT NULL, 
	lease_token UUID NOT NULL, 
	worker TEXT, 
	outcome TEXT, 
	error JSONB, 
	started_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	ended_at TIMESTAMP WITH TIME ZONE, 
	PRIMARY KEY (id), 
	FOREIGN KEY(step_id) REFERENCES engine.step (id) ON DELETE CASCADE
)
        """
    )
    op.execute(
        """
CREATE INDEX step_attempt_step_idx ON engine.step_attempt (step_id)
        """
    )


def downgrade() -> None:
    op.execute("DROP SCHEMA engine CASCADE")
