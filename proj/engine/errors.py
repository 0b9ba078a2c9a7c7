"""Typed errors of the engine's entry points (DESIGN.md §5: bad input gets a clear, typed error)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class BadInput(EngineError, ValueError):
    """Input rejected before anything was written."""


class UnknownKind(BadInput):
    """No kind of that name (or version) is declared."""


class InvalidInput(BadInput):
    """The input does not validate against the kind's model."""


class PayloadTooLarge(BadInput):
    """The serialised input is larger than `MAX_INPUT_BYTES`."""


class BadTopic(BadInput):
    """A signal topic that is empty, too long or has characters outside the allowed set."""


class BadIdempotencyKey(BadInput):
    """An empty or oversized idempotency key."""


class IdempotencyConflict(EngineError):
    """The key is taken by a run with a different input; the stored run is untouched."""

    def __init__(self, kind: str, key: str, existing_run_id: object) -> None:
        super().__init__(
            f"idempotency key {key!r} of kind {kind!r} is already used by run "
            f"{existing_run_id} with a different input"
        )
        self.kind = kind
        self.key = key
        self.existing_run_id = existing_run_id


class LeaseLost(EngineError):
    """This attempt no longer holds the step's lease: its commit is refused."""


class CancelRequested(EngineError):
    """Raised by `StepContext.checkpoint()` when the run was asked to stop."""


class NonRetryable(EngineError):
    """Raise from a step body to fail the run at once, without further attempts."""


class SchemaBehind(EngineError):
    """The database schema is older than the code; run `proj migrate`."""


class ConnectionBudgetExceeded(EngineError):
    """The configured pools could exhaust Postgres' `max_connections`."""


class EngineNotWired(EngineError):
    """No Celery app could be had to publish through (`proj.engine.broker`)."""


class PoolerUnsafe(EngineError):
    """DATABASE_URL goes through a connection pooler in a mode the configuration does not allow for."""
