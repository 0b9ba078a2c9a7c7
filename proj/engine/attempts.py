"""What one attempt of a step carries through the engine: its claim, the leave to claim the
run's next step inline (`Carry`), and what its commit hands back (`Committed`, `AttemptEnd`).
Shared by the execute ladder (`protocol`), the commits and the chain, which is why it is a
module of its own.

Control comes back through return values only: a commit returns the messages to publish and
the next step it claimed, and nothing is left on a shared object for the ladder to read back."""

from __future__ import annotations

import json
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from pydantic_core import to_jsonable_python

from proj.engine.dispatch import Dispatch
from proj.engine.liveness import LIVENESS
from proj.engine.status import Outcome


@dataclass(frozen=True)
class Claim:
    """A claimed attempt: everything the body needs, read in the claiming statement."""

    step_id: int
    run_id: uuid.UUID
    stage: int
    name: str
    item_index: int
    item: Any
    attempt: int
    max_attempts: int
    kind: str
    version: int
    input: dict[str, Any]
    claimed_at: datetime
    token: uuid.UUID
    priority: int = 0
    concurrency_key: str | None = None
    trace: dict[str, Any] | None = None
    parent_run_id: uuid.UUID | None = None
    deadline_at: datetime | None = None
    outages: int = 0  # of `attempt`, those that met an outage and were not spent


@dataclass(frozen=True)
class Carry:
    """Leave to claim the run's next step inside the committing transaction and run it here.

    A linear chain continues in the same process: the next step row is inserted already
    `running` under a fresh lease token (with its attempt record), so it needs no message and no
    second claim. Fencing is unchanged: the lease is taken in the transaction that commits the
    previous step, and a crash leaves a running step whose lease expires for the sweeper.
    Pure input: the claim taken under it comes back in the commit's `Committed.next`.
    """

    parent: Claim
    token: uuid.UUID = field(default_factory=uuid.uuid4)


class Committed(NamedTuple):
    """What a committed success hands back: the messages to publish after commit and, under a
    `Carry`, the run's next step claimed in the same commit for this process to run."""

    publish: list[Dispatch]
    next: Claim | None = None


class AttemptEnd(NamedTuple):
    """How an attempt ended (`Outcome`), what to publish, and the next step to run inline (only
    after a committed success under a `Carry`)."""

    outcome: str
    publish: list[Dispatch]
    next: Claim | None = None

    @classmethod
    def succeeded(cls, committed: Committed) -> AttemptEnd:
        return cls(Outcome.SUCCEEDED, committed.publish, committed.next)


def worker_id() -> str:
    """Who holds a lease: host and pid, and the liveness lock that says whether this process is
    still alive (`proj.engine.liveness`: a dead owner's steps are recovered without the lease)."""
    return LIVENESS.owner()


def to_json(value: Any) -> str:
    """Serialise a step result (pydantic models, UUIDs, datetimes included)."""
    return json.dumps(to_jsonable_python(value))


def error_payload(exc: BaseException) -> dict[str, Any]:
    """A stored error: type, message and a short traceback for the dead-letter view."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": tb[-4000:]}
    details = getattr(exc, "details", None)  # e.g. a failed child's run id and error
    if isinstance(details, dict):
        out.update({k: v for k, v in details.items() if k not in out})
    return out
