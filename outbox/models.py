"""The outbox table, `outbox.outbox_event` (own `MetaData`, schema `outbox`).

A row is written in the business transaction; the dispatcher turns it into an engine run.
`(kind, idempotency_key)` is unique, and the key is the engine's idempotency key, so a row that
is dispatched twice (crash between enqueue and the mark, two dispatchers) still names one run.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Index,
    Integer,
    MetaData,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA = "outbox"


class EventStatus(StrEnum):
    """`pending` until handed to the engine, then `dispatched`; `dead` past the retry limit."""

    PENDING = "pending"
    DISPATCHED = "dispatched"
    DEAD = "dead"


STATUSES = tuple(EventStatus)


class Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class OutboxEvent(Base):
    """One event to hand to the task engine: `pending` → `dispatched`, or `dead` with its error."""

    __tablename__ = "outbox_event"
    __table_args__ = (
        UniqueConstraint("kind", "idempotency_key", name="outbox_event_kind_key"),
        CheckConstraint("status IN ('pending','dispatched','dead')", name="outbox_event_status_check"),
        Index("outbox_event_due_idx", "next_attempt_at", postgresql_where=text("status = 'pending'")),
        Index("outbox_event_dead_idx", "created_at", postgresql_where=text("status = 'dead'")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(Text)
    idempotency_key: Mapped[str] = mapped_column(Text)
    payload: Mapped[Any] = mapped_column(JSONB)
    status: Mapped[str] = mapped_column(Text, server_default=EventStatus.PENDING.value)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_error: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    run_ref: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    trace: Mapped[dict[str, str] | None] = mapped_column(JSONB)  # W3C carrier of the adding transaction
