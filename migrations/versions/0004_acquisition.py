"""acquisition business schema: download_task, approval, library_item, task_event, flag

Revision ID: 0004_acquisition
Revises: 0002_outbox_ledger
Create Date: 2026-12-02
"""

from alembic import op

revision = "0004_acquisition"
down_revision = "0002_outbox_ledger"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE SCHEMA IF NOT EXISTS acq")
    op.execute(
        """
CREATE TABLE acq.download_task (
	id UUID NOT NULL, 
	requester TEXT NOT NULL, 
	title TEXT NOT NULL, 
	infohash TEXT NOT NULL, 
	torrent BYTEA NOT NULL, 
	files JSONB NOT NULL, 
	total_size BIGINT NOT NULL, 
	webhook_url TEXT, 
	status TEXT DEFAULT 'requested' NOT NULL, 
	progress DOUBLE PRECISION, 
	cancel_requested_at TIMESTAMP WITH TIME ZONE, 
	created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	updated_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	PRIMARY KEY (id)
)
        """
    )
    op.execute(
        """
CREATE INDEX download_task_infohash_idx ON acq.download_task (infohash)
        """
    )
    op.execute(
        """
CREATE TABLE acq.flag (
	id BIGSERIAL NOT NULL, 
	kind TEXT NOT NULL, 
	subject TEXT NOT NULL, 
	detail JSONB, 
	at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	PRIMARY KEY (id)
)
        """
    )
    op.execute(
        """
CREATE UNIQUE INDEX flag_subject_uniq ON acq.flag (kind, subject)
        """
    )
    op.execute(
        """
CREATE TABLE acq.task_event (
	id BIGSERIAL NOT NULL, 
	download_task_id UUID NOT NULL, 
	what TEXT NOT NULL, 
	detail JSONB, 
	at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	PRIMARY KEY (id)
)
        """
    )
    op.execute(
        """
CREATE INDEX task_event_task_idx ON acq.task_event (download_task_id, id)
        """
    )
    op.execute(
        """
CREATE TABLE acq.approval (
	download_task_id UUID NOT NULL, 
	approved_by TEXT NOT NULL, 
	approved_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	PRIMARY KEY (download_task_id), 
	FOREIGN KEY(download_task_id) REFERENCES acq.download_task (id) ON DELETE CASCADE
)
        """
    )
    op.execute(
        """
CREATE TABLE acq.library_item (
	id BIGSERIAL NOT NULL, 
	download_task_id UUID NOT NULL, 
	rel_path TEXT NOT NULL, 
	root TEXT NOT NULL, 
	size BIGINT NOT NULL, 
	sha256 TEXT NOT NULL, 
	status TEXT DEFAULT 'ok' NOT NULL, 
	verified_at TIMESTAMP WITH TIME ZONE, 
	created_at TIMESTAMP WITH TIME ZONE DEFAULT now() NOT NULL, 
	PRIMARY KEY (id), 
	FOREIGN KEY(download_task_id) REFERENCES acq.download_task (id) ON DELETE CASCADE
)
        """
    )
    op.execute(
        """
CREATE UNIQUE INDEX library_item_task_path ON acq.library_item (download_task_id, rel_path)
        """
    )


def downgrade() -> None:
    op.execute("DROP SCHEMA acq CASCADE")
