"""Typed errors of the engine's entry points (DESIGN.md §5: bad input gets a clear, typed error)."""

from __future__ import annotations

from proj.engine.status import RunStatus


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


class Unavailable(EngineError):
    """Raise from a step body when a service it needs is down (refused, unreachable, a 503):
    the attempt is retried after the policy's backoff without being counted, for as long as
    the policy's `outage_s` allows; past it, attempts count again. Under a policy with no outage
    window it is an ordinary failure. Why: an outage is not the step's fault, and a restart of
    qBittorrent or a webhook receiver down for a night spent every attempt of a policy sized
    for errors (`tests/integration/test_outages.py`)."""


class SchemaBehind(EngineError):
    """The database schema is older than the code; run `proj migrate`."""


class ConnectionBudgetExceeded(EngineError):
    """The configured pools could exhaust Postgres' `max_connections`."""


class EngineNotWired(EngineError):
    """No Celery app could be had to publish through (`proj.engine.broker`)."""


class PoolerUnsafe(EngineError):
    """DATABASE_URL goes through a connection pooler in a mode the configuration does not allow for."""


class DeadlineExceeded(NonRetryable):
    """The run passed its `deadline_at`: no further step starts and the run ends `failed`.

    Raised by `StepContext.checkpoint()` in a running step; the sweeper ends a run that is
    parked or between steps with the same error."""


class ChildRejected(NonRetryable):
    """A child step could not enqueue its child: an unknown kind or an input its model rejects.
    Nothing was written (the child step's transaction rolled back); retrying cannot help."""


class ChildFailed(EngineError):
    """The child run a child step waited for ended `failed` or `canceled`: the step fails with
    the child's error, under the parent's retry policy."""

    def __init__(self, child_run_id: object, kind: str, status: str, error: object) -> None:
        err = error if isinstance(error, dict) else {}
        what = f"{err.get('type', 'error')}: {err.get('message', '')}" if err else "no error recorded"
        verb = "was canceled" if status == RunStatus.CANCELED else "failed"
        super().__init__(f"child run {child_run_id} ({kind}) {verb}: {what}")
        self.child_run_id = child_run_id
        self.details = {"child_run_id": str(child_run_id), "child_status": status, "child_error": error}


class RunFailed(EngineError):
    """`TaskEngine.result()`: the run ended `failed`; `last_error` is its stored error."""

    def __init__(self, run_id: object, last_error: object) -> None:
        err = last_error if isinstance(last_error, dict) else {}
        super().__init__(f"run {run_id} failed: {err.get('type', '?')}: {err.get('message', '')}")
        self.run_id = run_id
        self.last_error = last_error


class RunCanceled(EngineError):
    """`TaskEngine.result()`: the run ended `canceled` (`reason` as given to `cancel`)."""

    def __init__(self, run_id: object, reason: object, last_error: object = None) -> None:
        super().__init__(f"run {run_id} was canceled: {reason}")
        self.run_id = run_id
        self.reason = reason
        self.last_error = last_error
