"""Run and step statuses, defined once (the migrations' CHECK constraints hold the same values:
`tests/integration/test_engine_schema.py`)."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


class StepStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"


TERMINAL: frozenset[str] = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELED})
"""A run or step in one of these never changes again (but for an operator's retry of a failure)."""

ACTIVE: frozenset[str] = frozenset({RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING})
