"""What a step body sees: its input, earlier results, its lease and the run's cancel flag.

This module does not import `proj.engine.kind`: a kind's steps are typed by the contexts they
get (`kind.StepFn`), and a context needs only a little of its kind (`RunKind`), so the two
modules would otherwise name each other (`tests/unit/test_layers.py`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel
from sqlalchemy.orm import Session

from proj import db
from proj.engine.errors import CancelRequested, DeadlineExceeded, LeaseLost
from proj.engine.heartbeat import Lease
from proj.engine.store import leases as store
from proj.settings import get_settings


class RunKind(Protocol):
    """What a context needs of its run's kind (`proj.engine.kind.Kind` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def input_model(self) -> type[BaseModel]: ...

    def fans_out(self, stage: int) -> bool: ...


def load_results(session: Session, run_id: uuid.UUID, kind: RunKind) -> dict[str, Any]:
    """Committed results by step name; a fan-out step gives the list in item order."""
    out: dict[str, Any] = {}
    for stage, name, result in store.results(session, run_id):
        if kind.fans_out(stage):
            out.setdefault(name, []).append(result)
        else:
            out[name] = result
    return out


class Committer(Protocol):
    """Commits the running attempt's success inside a transaction the body opened
    (`StepContext.finish`); the execute ladder hands one to the context it builds
    (`commits.InBodyCommit`) and reads back what the commit returned."""

    def commit(self, session: Session, result: Any) -> None: ...

    def landed(self) -> None:
        """The transaction `commit` joined has committed."""


@dataclass
class PlanContext:
    """What fan-out `over`, wait topics and timers may read: the input and earlier results."""

    run_id: uuid.UUID
    kind: RunKind
    raw_input: dict[str, Any]
    _results: dict[str, Any] | None = None
    _session: Session | None = None
    _input: BaseModel | None = None

    @property
    def input(self) -> Any:
        if self._input is None:
            self._input = self.kind.input_model.model_validate(self.raw_input)
        return self._input

    def result(self, step_name: str) -> Any:
        """The committed result of an earlier step (a list for a fan-out step)."""
        if self._results is None:
            if self._session is not None:
                self._results = load_results(self._session, self.run_id, self.kind)
            else:
                with db.transaction() as s:
                    self._results = load_results(s, self.run_id, self.kind)
        if step_name not in self._results:
            raise KeyError(f"step {step_name!r} has no committed result in run {self.run_id}")
        return self._results[step_name]


@dataclass
class StepContext(PlanContext):
    """The context of one attempt. Business writes go through `fenced()`."""

    step_id: int = 0
    step: str = ""
    stage: int = 0
    attempt: int = 0
    item: Any = None
    item_index: int = 0
    lease: Lease | None = None
    committer: Committer | None = None
    _cancel_checked_at: float = field(default=0.0)
    _cancel_cached: bool = False
    _late_cached: bool = False

    @property
    def token(self) -> uuid.UUID:
        assert self.lease is not None
        return self.lease.token

    @property
    def lease_lost(self) -> bool:
        """True once the heartbeat saw another attempt take the lease: stop, do not commit."""
        return self.lease is not None and self.lease.lost.is_set()

    def _read_stop_reasons(self) -> None:
        """Whether a cancel was asked and whether the deadline passed, read at most every 0.2 s."""
        now = time.monotonic()
        if now - self._cancel_checked_at >= 0.2:
            self._cancel_checked_at = now
            with db.transaction() as s:
                row = store.stop_reasons(s, self.run_id)
            if row is not None:
                self._cancel_cached = self._cancel_cached or row.cancel
                self._late_cached = self._late_cached or row.late

    def cancel_requested(self) -> bool:
        """True when the run was asked to stop. Cheap enough to call per chunk."""
        if self._cancel_cached or (self.lease is not None and self.lease.cancel.is_set()):
            return True
        self._read_stop_reasons()
        return self._cancel_cached

    def deadline_passed(self) -> bool:
        """True once the run's deadline has passed (the database's clock)."""
        if not self._late_cached:
            self._read_stop_reasons()
        return self._late_cached

    def checkpoint(self) -> None:
        """Raise `LeaseLost`, `CancelRequested` or `DeadlineExceeded` if the body should stop now."""
        if self.lease_lost:
            raise LeaseLost(f"step {self.step_id}: lease lost, stopped at a checkpoint")
        if self.cancel_requested():
            raise CancelRequested(f"run {self.run_id} was canceled")
        if self.deadline_passed():
            raise DeadlineExceeded(f"run {self.run_id} passed its deadline")

    def fence(self, session: Session) -> None:
        """Inside `session`'s transaction: lock this attempt's step row while it still holds the
        lease (and extend it), or raise `LeaseLost`. Every fenced write starts with this."""
        if not store.fence(session, step_id=self.step_id, token=self.token, ttl=get_settings().lease_ttl_s):
            if self.lease is not None:
                self.lease.lost.set()
            raise LeaseLost(f"step {self.step_id}: lease lost, commit refused")

    @contextmanager
    def fenced(self) -> Iterator[Session]:
        """A transaction that only commits while this attempt still holds the lease.

        The fence row lock is held to commit, so the sweeper cannot hand the step to another
        worker in between.
        """
        with db.transaction() as s:
            self.fence(s)
            yield s

    @contextmanager
    def finish(self, result: Any) -> Iterator[Session]:
        """The step's last business writes and its result, committed in ONE fenced transaction.

        With `fenced()` a worker could die after the business commit and before the step's
        own, and the whole body would run again; with `finish(result)` either both commit or
        neither does. Use it as the body's last act and return the same `result`.
        """
        if self.committer is None:
            raise RuntimeError("finish() is only available inside a running step")
        with db.transaction() as s:
            self.fence(s)
            yield s
            s.flush()
            self.committer.commit(s, result)
        self.committer.landed()

    def report_progress(self, done: float, total: float, message: str | None = None) -> None:
        """Live progress for operators (copy %, download %); best effort, never fenced."""
        import json

        payload = {"done": done, "total": total, "message": message, "at": time.time()}
        with db.transaction() as s:
            store.report_progress(s, step_id=self.step_id, token=self.token, progress=json.dumps(payload))
