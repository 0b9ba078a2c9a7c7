"""Run and step statuses, defined once (the database's status domains, migration 0012, hold the
same values: `tests/integration/test_engine_schema.py`)."""

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


class Outcome(StrEnum):
    """How one attempt ended: what the execute ladder (`proj.engine.protocol`) returns and logs,
    the span's `engine.outcome`, and (but for `noop`) the attempt record's `outcome`."""

    NOOP = "noop"  # nothing was claimed: a duplicate or stale message
    SUCCEEDED = "succeeded"
    RETRY = "retry"  # failed; another attempt is scheduled after a backoff
    UNAVAILABLE = "unavailable"  # a service it needs was down: retried, the attempt not counted
    FAILED = "failed"  # failed for the last time: the run is a dead letter
    CANCELED = "canceled"  # the body stopped on a cancel request
    WAITING = "waiting"  # parked until a signal or its timer
    RECHECKING = "rechecking"  # a signal raced the park: the wait checks again
    LEASE_LOST = "lease_lost"  # another attempt owns the step: nothing was written
    PARKED = "parked"  # the attempt record of a park (the step itself is `waiting`)
