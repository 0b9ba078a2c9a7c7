"""What one attempt of a step carries through the engine: its claim, and the leave to claim the
run's next step inline (`Carry`). Shared by the execute ladder (`protocol`), the commits and the
chain, which is why it is a module of its own."""

from __future__ import annotations

import json
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic_core import to_jsonable_python

from proj.engine.liveness import LIVENESS


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


@dataclass
class Carry:
    """Leave to claim the run's next step inside the committing transaction and run it here.

    A linear chain continues in the same process: the next step row is inserted already
    `running` under a fresh lease token (with its attempt record), so it needs no message and no
    second claim. Fencing is unchanged: the lease is taken in the transaction that commits the
    previous step, and a crash leaves a running step whose lease expires for the sweeper.
    """

    parent: Claim
    token: uuid.UUID = field(default_factory=uuid.uuid4)
    claim: Claim | None = None


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
