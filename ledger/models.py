"""The ledger's one table, `ledger.asset_operation` (own `MetaData`, schema `ledger`).

One row per external side effect, keyed by a caller-chosen operation key that names the effect in
the outside world (an infohash, a target path, a webhook delivery id), so a retry, a duplicate
message or another worker finds the same row.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import CheckConstraint, DateTime, Index, Integer, MetaData, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA = "ledger"


class OperationStatus(StrEnum):
    """`attempting` from the first attempt until a result commits, then `done` for good."""

    ATTEMPTING = "attempting"
    DONE = "done"


class Resolution(StrEnum):
    """How a `done` operation got its result: the effect ran, or reconcile found it done."""

    EFFECT = "effect"
    RECONCILED = "reconciled"


STATUSES = tuple(OperationStatus)
RESOLUTIONS = tuple(Resolution)


class Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class AssetOperation(Base):
    """`plan → attempt(token, started_at) → result` for one effect.

    `status` is `attempting` from the first attempt until a result commits, then `done` for good.
    `attempt_token` is overwritten by every new attempt; only the attempt holding it may commit.
    """

    __tablename__ = "asset_operation"
    __table_args__ = (
        CheckConstraint("status IN ('attempting','done')", name="asset_operation_status_check"),
        CheckConstraint(
            "resolution IS NULL OR resolution IN ('effect','reconciled')",
            name="asset_operation_resolution_check",
        ),
        Index("asset_operation_run_idx", "run_id"),
        Index(
            "asset_operation_open_idx",
            "attempt_started_at",
            postgresql_where=text("status = 'attempting'"),
        ),
    )

    op_key: Mapped[str] = mapped_column(Text, primary_key=True)
    run_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    step: Mapped[str | None] = mapped_column(Text)
    effect_kind: Mapped[str] = mapped_column(Text)
    plan: Mapped[Any] = mapped_column(JSONB)
    status: Mapped[str] = mapped_column(Text, server_default=OperationStatus.ATTEMPTING.value)
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    attempt_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    attempt_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    result: Mapped[Any | None] = mapped_column(JSONB)
    resolution: Mapped[str | None] = mapped_column(Text)
    last_error: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
