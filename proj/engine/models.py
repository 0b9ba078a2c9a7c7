"""Engine tables (schema `engine`): the durable truth of runs, steps, attempts and signals.

Celery messages only point at a `step` row; everything that matters lives here.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import DOMAIN, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from proj.engine.status import RunStatus, StepStatus

SCHEMA = "engine"

RUN_STATUSES = tuple(RunStatus)
STEP_STATUSES = tuple(StepStatus)


def _one_of(values: tuple[str, ...]) -> str:
    return "VALUE IN (" + ", ".join(f"'{v}'" for v in values) + ")"


# Statuses are domains, not table CHECK constraints: Postgres parses a table's checks again in
# every statement that writes the table, a domain's once per backend (migration 0012).
RUN_STATUS = DOMAIN("run_status", Text, check=_one_of(RUN_STATUSES), schema=SCHEMA, create_type=False)
STEP_STATUS = DOMAIN("step_status", Text, check=_one_of(STEP_STATUSES), schema=SCHEMA, create_type=False)
BLOCKED_ON = DOMAIN("blocked_on", Text, check=_one_of(("global", "key")), schema=SCHEMA, create_type=False)


class Base(DeclarativeBase):
    metadata = MetaData(schema=SCHEMA)


class TaskRun(Base):
    """One run of a kind at a fixed version; `(kind, idempotency_key)` is unique forever."""

    __tablename__ = "task_run"
    __table_args__ = (
        UniqueConstraint("kind", "idempotency_key", name="task_run_kind_key"),
        Index("task_run_status_idx", "kind", "version", "status"),
        Index(
            "task_run_cancel_idx",
            "cancel_requested_at",
            postgresql_where=text(
                "cancel_requested_at IS NOT NULL AND status IN ('pending','running','waiting')"
            ),
        ),
        Index(
            "task_run_start_idx",
            "kind",
            "version",
            text("priority DESC"),
            "created_at",
            "id",
            postgresql_where=text("status = 'pending'"),
        ),
        Index(
            "task_run_kind_key_idx",
            "kind",
            "concurrency_key",
            postgresql_where=text("status IN ('pending','running','waiting')"),
        ),
        Index(
            "task_run_concurrency_idx",
            "concurrency_key",
            postgresql_where=text(
                "concurrency_key IS NOT NULL AND status IN ('pending','running','waiting')"
            ),
        ),
        Index(
            "task_run_finished_idx",
            "finished_at",
            "status",
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
        Index(
            "task_run_live_idx",
            "kind",
            "version",
            "status",
            postgresql_where=text("status IN ('pending', 'running', 'waiting', 'failed')"),
        ),
        Index("task_run_parent_idx", "parent_run_id", postgresql_where=text("parent_run_id IS NOT NULL")),
        Index(
            "task_run_live_child_idx",
            "parent_run_id",
            postgresql_where=text(
                "parent_run_id IS NOT NULL AND status IN ('pending', 'running', 'waiting')"
            ),
        ),
        Index(
            "task_run_deadline_idx",
            "deadline_at",
            postgresql_where=text("deadline_at IS NOT NULL AND status IN ('pending', 'running', 'waiting')"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    kind: Mapped[str] = mapped_column(Text)
    version: Mapped[int] = mapped_column(Integer)
    idempotency_key: Mapped[str] = mapped_column(Text)
    input: Mapped[dict[str, Any]] = mapped_column(JSONB)
    input_hash: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(RUN_STATUS, server_default="pending")
    current_stage: Mapped[int] = mapped_column(Integer, server_default="0")
    current_step: Mapped[str | None] = mapped_column(Text)
    result: Mapped[Any | None] = mapped_column(JSONB)
    last_error: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    priority: Mapped[int] = mapped_column(Integer, server_default="0")
    concurrency_key: Mapped[str | None] = mapped_column(Text)
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancel_reason: Mapped[str | None] = mapped_column(Text)
    trace: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    available_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # children and deadlines (0009)
    parent_run_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # result() waiters (0010): only a run somebody awaits notifies when it finishes
    result_awaited: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    # a child stopped by its parent's end, not by an operator (0013): a retried parent replaces it
    canceled_by_parent: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))


class Step(Base):
    """One step (or one fan-out item) of a run: its lease, attempts, result and timers."""

    __tablename__ = "step"
    __table_args__ = (
        UniqueConstraint("run_id", "stage", "item_index", name="step_run_stage_item"),
        Index("step_due_idx", "next_attempt_at", postgresql_where=text("status = 'pending'")),
        Index("step_lease_idx", "lease_until", postgresql_where=text("status = 'running'")),
        Index("step_wait_until_idx", "wait_until", postgresql_where=text("status = 'waiting'")),
        Index("step_wait_topic_idx", "wait_topic", postgresql_where=text("status = 'waiting'")),
        Index(
            "step_blocked_idx",
            "run_id",
            postgresql_where=text("status = 'pending' AND blocked_at IS NOT NULL"),
        ),
        Index("step_running_run_idx", "run_id", postgresql_where=text("status = 'running'")),
        Index("step_signalled_idx", "signalled_at", postgresql_where=text("signalled_at IS NOT NULL")),
        Index("step_outage_idx", "outage_since", postgresql_where=text("outage_since IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("engine.task_run.id", ondelete="CASCADE")
    )
    stage: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(Text)
    item_index: Mapped[int] = mapped_column(Integer, server_default="0")
    item: Mapped[Any | None] = mapped_column(JSONB)
    status: Mapped[str] = mapped_column(STEP_STATUS, server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    max_attempts: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    lease_token: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    lease_owner: Mapped[str | None] = mapped_column(Text)
    wait_topic: Mapped[str | None] = mapped_column(Text)
    wait_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    wait_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    wakeups: Mapped[int] = mapped_column(Integer, server_default="0")
    signalled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    result: Mapped[Any | None] = mapped_column(JSONB)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # the attempt that runs or succeeded (0011): when it was claimed; `engine.attempt` reads it
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # concurrency limits (0003): why a claim found no free slot, which limit, and when
    blocked_reason: Mapped[str | None] = mapped_column(Text)
    blocked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    blocked_on: Mapped[str | None] = mapped_column(BLOCKED_ON)
    # outages (0014): attempts that met `Unavailable` in the window, not counted; and since when
    outages: Mapped[int] = mapped_column(Integer, server_default="0")
    outage_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class StepAttempt(Base):
    """Audit log of the attempts that did not succeed: each ended other than in success (retry,
    failed, canceled, parked), or was taken from its holder (an orphan, `outcome` NULL: a killed
    worker, a lost lease, a canceled run). The attempt that runs or succeeded lives on its step
    row (`claimed_at`, `lease_token`, `lease_owner`), so the happy path writes no row here
    (migration 0011). The view `engine.attempt` is the whole history. Never a timeline."""

    __tablename__ = "step_attempt"
    __table_args__ = (Index("step_attempt_step_idx", "step_id"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    step_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("engine.step.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    lease_token: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    worker: Mapped[str | None] = mapped_column(Text)
    outcome: Mapped[str | None] = mapped_column(Text)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TaskSignal(Base):
    """Stored signals: one sent before anyone waits is still seen by the wait."""

    __tablename__ = "task_signal"
    __table_args__ = (Index("task_signal_topic_idx", "topic", "created_at"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(Text)
    payload: Mapped[Any | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Counter(Base):
    """Monotonic engine counters (`lease_recoveries`, bumped by the sweeper): what `purge` must
    not reset, unlike counts of rows (`proj_lease_recoveries_total`)."""

    __tablename__ = "counter"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, server_default="0")
