"""front door: idempotent API requests and a listing index on download tasks

Revision ID: 0007_front_door
Revises: 0006_outbox_trace
Create Date: 2026-12-03

`POST /api/requests` honours an `Idempotency-Key`: the key is stored on the request it created,
with a digest of the body, so a replay returns that request and another body under the same key
is refused (409). The Requests page lists by status, newest first.
"""

from alembic import op

revision = "0007_front_door"
down_revision = "0006_outbox_trace"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE acq.download_task ADD COLUMN client_key TEXT, ADD COLUMN client_digest TEXT")
    op.execute(
        "CREATE UNIQUE INDEX download_task_client_key_uniq ON acq.download_task (client_key) "
        "WHERE client_key IS NOT NULL"
    )
    op.execute("CREATE INDEX download_task_status_created_idx ON acq.download_task (status, created_at)")
    op.execute("CREATE INDEX download_task_created_idx ON acq.download_task (created_at)")


def downgrade() -> None:
    op.execute("DROP INDEX acq.download_task_created_idx")
    op.execute("DROP INDEX acq.download_task_status_created_idx")
    op.execute("DROP INDEX acq.download_task_client_key_uniq")
    op.execute("ALTER TABLE acq.download_task DROP COLUMN client_key, DROP COLUMN client_digest")
