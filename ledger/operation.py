"""`run_operation`: the one entry point for a side effect (DESIGN.md invariant 4).

    plan ──► attempt(token, started_at) ──► result
              ▲ a new attempt overwrites the token, so an older attempt's commit matches 0 rows

On entry, under the row lock:

- a result exists            → return it (the effect is not called);
- no attempt yet              → write attempt 1, call `effect`, commit the result;
- an attempt without result   → write a new attempt (fencing out the old one), call `reconcile`:
  `Done(result)` commits that result, `NotDone()` re-checks the fence and calls `effect` again.

Every write that starts or finishes an attempt runs the caller's `fence` in the same transaction
(from a task engine step: "do I still hold my lease?"), so a stale worker can neither take the
operation over nor commit. The result commit is
`UPDATE … WHERE op_key = ? AND attempt_token = ? AND status = 'attempting'`; zero rows raises
`CommitRefused` and leaves whatever is stored untouched.

What the ledger cannot do is make an external call atomic with a database commit: an attempt
frozen *between* its last check and the effect may still perform it after being superseded.
`Attempt.check()` narrows that window (call it right before the irreversible call and per chunk);
effects that carry the op key to the outside world (an idempotency header, a managed tag, a fixed
target path) close it.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import json
import logging
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from pathlib import PurePath
from typing import Any, Generic, TypeVar

from sqlalchemy import cast, func, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ledger.errors import AttemptInProgress, BadOperation, CommitRefused, PlanConflict
from ledger.models import AssetOperation, OperationStatus, Resolution

R = TypeVar("R")
log = logging.getLogger(__name__)

SessionFactory = Callable[[], Session]
"""Returns a new `Session` (a `sessionmaker` works); the ledger opens short transactions with it."""

Fence = Callable[[Session], object]
"""Runs inside the ledger's write transaction; raises (or returns False) when the caller's own
lease is gone, which refuses the write."""

MAX_KEY_LEN = 512


@dataclass(frozen=True)
class Done(Generic[R]):
    """What `reconcile` returns when the outside world shows the effect happened."""

    result: R


@dataclass(frozen=True)
class NotDone:
    """What `reconcile` returns when the effect did not happen: the ledger redoes it."""

    reason: str = ""


@dataclass(frozen=True)
class Attempt:
    """What `effect` and `reconcile` receive: the plan, this attempt's token and its history."""

    op_key: str
    plan: Any
    token: uuid.UUID
    number: int
    previous_token: uuid.UUID | None
    previous_started_at: datetime | None
    _check: Callable[[], None] = dataclasses.field(repr=False, compare=False)

    @property
    def is_retry(self) -> bool:
        """True when an earlier attempt exists (whose effect may or may not have happened)."""
        return self.previous_token is not None

    def check(self) -> None:
        """Raise `CommitRefused` if this attempt was superseded or the caller's fence is gone.

        Call it right before an irreversible call and between chunks of a long effect.
        """
        self._check()


def to_json(value: Any, *, what: str) -> Any:
    """The JSON form the ledger stores and returns (UUIDs, datetimes, paths become strings)."""
    try:
        decoded = json.loads(json.dumps(value, default=_json_default, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise BadOperation(f"the {what} must be JSON-serialisable: {exc}") from exc
    if reason := _unstorable(decoded):
        raise BadOperation(f"the {what} contains {reason}, which Postgres cannot store")
    return decoded


def _unstorable(value: Any) -> str | None:
    """Why Postgres could not store this decoded JSON value (or key): text and jsonb refuse a NUL
    and an unpaired surrogate (a file name decoded with `surrogateescape`)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return "a NUL character"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return "an unpaired surrogate"
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _json_default(value: Any) -> Any:
    if isinstance(value, uuid.UUID | PurePath | decimal.Decimal):
        return str(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    model_dump = getattr(value, "model_dump", None)  # pydantic, without importing it
    if callable(model_dump):
        return model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _storable(text: str) -> str:
    """`text` with what Postgres' text and jsonb refuse (NUL, unpaired surrogates) escaped."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def _error_payload(exc: BaseException) -> dict[str, Any]:
    try:
        message = str(exc)
    except Exception:
        message = f"<{type(exc).__name__}: str() failed>"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-4:])
    return {
        "type": _storable(type(exc).__name__),
        "message": _storable(message[:2000]),
        "traceback": _storable(tb[-3000:]),
    }


def _run_fence(fence: Fence | None, s: Session, op_key: str, token: uuid.UUID, action: str) -> None:
    """The caller's lease check, inside the ledger's transaction; database errors pass through."""
    if fence is None:
        return
    try:
        ok = fence(s)
    except SQLAlchemyError:
        raise
    except Exception as exc:
        raise CommitRefused(op_key, token, action, f"the caller's fence refused ({exc})") from exc
    if ok is False:
        raise CommitRefused(op_key, token, action, "the caller's fence refused")


def _holder(s: Session, op_key: str) -> str:
    row = s.execute(
        select(AssetOperation.status, AssetOperation.attempt_token).where(AssetOperation.op_key == op_key)
    ).first()
    if row is None:
        return "the operation no longer exists"
    if row.status == OperationStatus.DONE:
        return f"the operation is already done (committed by attempt {row.attempt_token})"
    return f"attempt {row.attempt_token} superseded it"


def run_operation(
    session_factory: SessionFactory,
    op_key: str,
    *,
    plan: Any,
    effect: Callable[[Attempt], R],
    reconcile: Callable[[Attempt], Done[R] | NotDone | type[NotDone]],
    run_id: uuid.UUID | None = None,
    step: str | None = None,
    effect_kind: str = "effect",
    fence: Fence | None = None,
    takeover_after_s: float = 0.0,
) -> Any:
    """Perform the effect named `op_key` at most once and return its (JSON) result.

    `plan` describes the effect (stored; the same key with another plan raises `PlanConflict`).
    `effect(attempt)` does it and returns a JSON-able result. `reconcile(attempt)` is called only
    when an earlier attempt left no result: it looks at the outside world and returns
    `Done(result)` or `NotDone()`. `fence(session)` (optional) is the caller's lease check, run in
    every transaction that starts or finishes an attempt. `takeover_after_s` > 0 refuses
    (`AttemptInProgress`) to take over an attempt younger than that, for callers that have no
    lease of their own to serialise them.

    Raises `CommitRefused` when this call lost the operation to a newer attempt or its fence;
    the effect's own exceptions propagate (recorded as `last_error`; the next call reconciles).
    """
    if not isinstance(op_key, str) or not op_key.strip() or len(op_key) > MAX_KEY_LEN or _unstorable(op_key):
        raise BadOperation(f"op key must be 1..{MAX_KEY_LEN} characters, no NUL, got {op_key!r}")
    plan_json = to_json(plan, what="plan")
    token = uuid.uuid4()

    with session_factory() as s, s.begin():
        s.execute(
            pg_insert(AssetOperation)
            .values(op_key=op_key, run_id=run_id, step=step, effect_kind=effect_kind, plan=plan_json)
            .on_conflict_do_nothing(index_elements=[AssetOperation.op_key])
        )
        row = s.execute(
            select(
                AssetOperation.plan,
                AssetOperation.status,
                AssetOperation.result,
                AssetOperation.attempts,
                AssetOperation.attempt_token,
                AssetOperation.attempt_started_at,
                (func.now() - AssetOperation.attempt_started_at).label("age"),
                # Compared as jsonb, by Postgres: a float such as 9.540277552637683e16 is stored as
                # the numeric 95402775526376830 and reads back as another Python number.
                (AssetOperation.plan == cast(plan_json, JSONB)).label("same_plan"),
            )
            .where(AssetOperation.op_key == op_key)
            .with_for_update()
        ).one()
        if not row.same_plan:
            raise PlanConflict(op_key, row.plan, plan_json)
        if row.status == OperationStatus.DONE:
            return row.result
        if (
            row.attempt_token is not None
            and takeover_after_s > 0
            and row.age is not None
            and row.age < timedelta(seconds=takeover_after_s)
        ):
            raise AttemptInProgress(
                f"ledger operation {op_key!r}: attempt {row.attempt_token} started "
                f"{row.age.total_seconds():.1f}s ago (< {takeover_after_s}s); not taking it over"
            )
        _run_fence(fence, s, op_key, token, "start an attempt")
        s.execute(
            update(AssetOperation)
            .where(AssetOperation.op_key == op_key)
            .values(
                attempt_token=token,
                # When the attempt starts, not when its transaction began: a start transaction
                # that waited for the row lock would otherwise look old to `takeover_after_s`.
                attempt_started_at=func.clock_timestamp(),
                attempts=AssetOperation.attempts + 1,
                run_id=func.coalesce(run_id, AssetOperation.run_id),
                step=func.coalesce(step, AssetOperation.step),
                updated_at=func.now(),
            )
        )

    def check() -> None:
        _check_current(session_factory, op_key, token, fence)

    attempt = Attempt(
        op_key=op_key,
        plan=plan_json,
        token=token,
        number=row.attempts + 1,
        previous_token=row.attempt_token,
        previous_started_at=row.attempt_started_at,
        _check=check,
    )
    try:
        if attempt.is_retry:
            verdict = reconcile(attempt)
            if isinstance(verdict, Done):
                return _commit(session_factory, attempt, fence, verdict.result, Resolution.RECONCILED)
            if not (verdict is NotDone or isinstance(verdict, NotDone)):
                raise TypeError(
                    f"reconcile of {op_key!r} must return Done(result) or NotDone(), "
                    f"not {type(verdict).__name__}"
                )
            attempt.check()  # the redo is irreversible: make sure this attempt still owns it
        result = effect(attempt)
    except CommitRefused:
        raise
    except Exception as exc:
        _record_error(session_factory, op_key, token, exc)
        raise
    return _commit(session_factory, attempt, fence, result, Resolution.EFFECT)


def _commit(
    session_factory: SessionFactory,
    attempt: Attempt,
    fence: Fence | None,
    result: Any,
    resolution: Resolution,
) -> Any:
    """The fenced result commit: only the attempt holding the token, and only once."""
    value = to_json(result, what="result")
    with session_factory() as s, s.begin():
        _run_fence(fence, s, attempt.op_key, attempt.token, "commit its result")
        done = s.execute(
            update(AssetOperation)
            .where(
                AssetOperation.op_key == attempt.op_key,
                AssetOperation.attempt_token == attempt.token,
                AssetOperation.status == OperationStatus.ATTEMPTING,
            )
            .values(
                status=OperationStatus.DONE,
                result=value,
                resolution=resolution,
                last_error=None,
                finished_at=func.now(),
                updated_at=func.now(),
            )
            .returning(AssetOperation.result)
        ).first()
        if done is None:
            raise CommitRefused(
                attempt.op_key, attempt.token, "commit its result", _holder(s, attempt.op_key)
            )
    return done.result  # as stored (jsonb may rewrite a number): the form every later call returns


def _check_current(
    session_factory: SessionFactory, op_key: str, token: uuid.UUID, fence: Fence | None
) -> None:
    with session_factory() as s, s.begin():
        _run_fence(fence, s, op_key, token, "continue")
        current = s.execute(
            select(AssetOperation.attempt_token, AssetOperation.status).where(AssetOperation.op_key == op_key)
        ).first()
        if current is None or current.attempt_token != token or current.status != OperationStatus.ATTEMPTING:
            raise CommitRefused(op_key, token, "continue", _holder(s, op_key))


def _record_error(session_factory: SessionFactory, op_key: str, token: uuid.UUID, exc: BaseException) -> None:
    """Best effort, for operators: only the current attempt writes its error."""
    try:
        with session_factory() as s, s.begin():
            s.execute(
                update(AssetOperation)
                .where(
                    AssetOperation.op_key == op_key,
                    AssetOperation.attempt_token == token,
                    AssetOperation.status == OperationStatus.ATTEMPTING,
                )
                .values(last_error=_error_payload(exc), updated_at=func.now())
            )
    except Exception:  # never mask the effect's own error, but say that it went unrecorded
        log.warning("could not record the error of ledger operation %s", op_key, exc_info=True)


def get_operation(session: Session, op_key: str) -> AssetOperation | None:
    """The stored row (for admin views and tests), read in the caller's session."""
    return session.get(AssetOperation, op_key)
