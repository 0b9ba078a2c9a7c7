"""A hybrid v1/v2 torrent's request is known by the id qBittorrent lists the torrent under

Revision ID: 0015_hybrid_torrent_ids
Revises: 0014_outages
Create Date: 2026-12-07

`acq.download_task.infohash` of a hybrid v1/v2 torrent (BEP 52: `meta version` 2 and a v1
piece table) becomes its v2 infohash cut to 40 hex digits, the id qBittorrent (libtorrent 2)
lists it under and every API call takes. Before, such a request was stored under its v1
infohash, found nothing in qBittorrent after adding the torrent ("qBittorrent did not list …")
and never got past `add_torrent`; after this, a retry of it finds the torrent it added
(`proj.acquisition.torrents.torrent_id`, `tests/integration/test_hybrid_ids_migration.py`).
v1 torrents keep their id. The downgrade gives hybrid rows their v1 infohash back.

The rows are read in batches and only those whose torrent holds `meta version` are parsed.
"""

import io
import uuid

import sqlalchemy as sa
import torf
from alembic import op

from proj.acquisition.torrents import is_hybrid, torrent_id

revision = "0015_hybrid_torrent_ids"
down_revision = "0014_outages"
branch_labels = None
depends_on = None

BATCH = 500
CANDIDATES = sa.text(
    """
    SELECT id, torrent FROM acq.download_task
     WHERE position(CAST('12:meta version' AS bytea) IN torrent) > 0 AND id > :after
     ORDER BY id
     LIMIT :batch
    """
)
SET_ID = sa.text("UPDATE acq.download_task SET infohash = :infohash, updated_at = now() WHERE id = :id")


def _is_hybrid(data: bytes) -> bool:
    try:
        info = torf.Torrent.read_stream(io.BytesIO(data), validate=False).metainfo["info"]
    except Exception:  # unreadable now: it keeps the id it has
        return False
    return is_hybrid(info)


def _rename(hybrid_ids: bool) -> None:
    conn = op.get_bind()
    after = uuid.UUID(int=0)
    while batch := conn.execute(CANDIDATES, {"after": after, "batch": BATCH}).all():
        for task_id, torrent in batch:
            data = bytes(torrent)
            if _is_hybrid(data):
                conn.execute(SET_ID, {"id": task_id, "infohash": torrent_id(data, hybrid=hybrid_ids)})
        after = batch[-1][0]


def upgrade() -> None:
    _rename(hybrid_ids=True)


def downgrade() -> None:
    _rename(hybrid_ids=False)
