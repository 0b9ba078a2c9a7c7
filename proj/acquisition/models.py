"""Business tables (schema `acq`): the truth the waits check and the timelines read."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, DateTime, ForeignKey, Index, LargeBinary, MetaData, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA = "acq"


class Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class DownloadTask(Base):
    """One requested title: its torrent, where it stands, and whether it was canceled."""

    __tablename__ = "download_task"
    __table_args__ = (
        Index("download_task_infohash_idx", "infohash"),
        Index(
            "download_task_client_key_uniq",
            "client_key",
            unique=True,
            postgresql_where=text("client_key IS NOT NULL"),
        ),
        Index("download_task_status_created_idx", "status", "created_at"),
        Index("download_task_created_idx", "created_at"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    requester: Mapped[str] = mapped_column(Text)
    title: Mapped[str] = mapped_column(Text)
    infohash: Mapped[str] = mapped_column(Text)
    torrent: Mapped[bytes] = mapped_column(LargeBinary)
    files: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    total_size: Mapped[int] = mapped_column(BigInteger)
    webhook_url: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text, server_default="requested")
    progress: Mapped[float | None] = mapped_column()
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    # `Idempotency-Key` of the API call that created it, and a digest of that call's body.
    client_key: Mapped[str | None] = mapped_column(Text)
    client_digest: Mapped[str | None] = mapped_column(Text)


class Approval(Base):
    """An operator's approval of a request; the `acquire` wait checks this row."""

    __tablename__ = "approval"

    download_task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("acq.download_task.id", ondelete="CASCADE"), primary_key=True
    )
    approved_by: Mapped[str] = mapped_column(Text)
    approved_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class LibraryItem(Base):
    """A file in the library, with the hash it was copied with."""

    __tablename__ = "library_item"
    __table_args__ = (Index("library_item_task_path", "download_task_id", "rel_path", unique=True),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    download_task_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("acq.download_task.id", ondelete="CASCADE")
    )
    rel_path: Mapped[str] = mapped_column(Text)
    root: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text, server_default="ok")
    verified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class TaskEvent(Base):
    """The business timeline of a download task (what /admin shows), written by the steps."""

    __tablename__ = "task_event"
    __table_args__ = (Index("task_event_task_idx", "download_task_id", "id"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    download_task_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    what: Mapped[str] = mapped_column(Text)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Flag(Base):
    """Something an operator should look at: an unknown torrent, a corrupt library file."""

    __tablename__ = "flag"
    __table_args__ = (Index("flag_subject_uniq", "kind", "subject", unique=True),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(Text)
    subject: Mapped[str] = mapped_column(Text)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
