"""The `TaskEngine` port: the only thing business code knows about running work (DESIGN.md §2)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol
from uuid import UUID

from proj.engine.status import RunStatus

__all__ = ("RunStatus", "TaskEngine", "TaskRunRef", "TaskRunView")


@dataclass(frozen=True)
class TaskRunRef:
    """What `enqueue` returns. `created` is False when the key already named a run."""

    task_run_id: UUID
    created: bool = True


@dataclass(frozen=True)
class TaskRunView:
    """Read-only projection of a run for callers and operators."""

    id: UUID
    kind: str
    version: int
    status: RunStatus
    current_step: str | None
    attempts: int
    last_error: Mapping[str, Any] | None
    result: Any
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested: bool
    wait_topic: str | None = None
    wait_until: datetime | None = None
    pending_reason: str | None = None
    parent_run_id: UUID | None = None
    deadline_at: datetime | None = None


class TaskEngine(Protocol):
    """Durable execution of declared kinds. Implementations: `proj.engine.celery_engine`."""

    def enqueue(
        self,
        kind: str,
        input: Mapping[str, Any],
        *,
        idempotency_key: str,
        available_at: datetime | None = None,
        priority: int = 0,
        deadline_at: datetime | None = None,
    ) -> TaskRunRef: ...

    def enqueue_many(
        self,
        kind: str,
        items: Iterable[tuple[str, Mapping[str, Any]]],
        *,
        available_at: datetime | None = None,
        priority: int = 0,
        deadline_at: datetime | None = None,
    ) -> list[TaskRunRef]:
        """`enqueue` for each `(idempotency_key, input)` of `items`, in one transaction (all or
        none): one ref per item, in order."""
        ...

    def result(self, task_run_id: UUID, timeout_s: float) -> Any:
        """Block until the run finishes (woken at its commit, not by polling) or `timeout_s`
        passes: its result, or raise `RunFailed`/`RunCanceled` (with `last_error`) or
        `TimeoutError`."""
        ...

    def signal(self, topic: str, payload: Any = None) -> int: ...

    def cancel(self, task_run_id: UUID, reason: str) -> None: ...

    def get(self, task_run_id: UUID) -> TaskRunView | None: ...

    def find(self, kind: str, idempotency_key: str) -> TaskRunView | None:
        """The run `(kind, idempotency_key)` names, if any: business code keeps its keys, not ids."""
        ...

    def start(self, *, roles: Sequence[str] = ("worker",), concurrency: int = 2) -> None: ...

    def stop(self) -> None: ...
