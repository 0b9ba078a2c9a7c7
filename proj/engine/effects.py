"""Side effects from a step body go through the ledger, fenced by the step's lease (invariant 4).

    from proj.engine.effects import effect, Done, NotDone

    def add_torrent(ctx: StepContext) -> dict:
        return effect(ctx, f"qbt-add:{infohash}", {"infohash": infohash, "tag": tag},
                      do=lambda att: qbt.add(...), reconcile=lambda att: ...)

The ledger records the run id and step name, and runs the same lease check as
`StepContext.fenced()` inside every transaction that starts or commits an attempt: a worker that
lost its lease can neither take the operation over nor commit a result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from ledger import Attempt, CommitRefused, Done, NotDone, run_operation
from proj import db
from proj.engine.context import StepContext
from proj.engine.errors import LeaseLost
from proj.settings import get_settings

R = TypeVar("R")


def step_fence(ctx: StepContext) -> Callable[[Session], None]:
    """A ledger fence for this step attempt: raises `LeaseLost` once the lease is gone."""
    return ctx.fence


def _session() -> Session:
    return db.sessions()()


def effect(
    ctx: StepContext,
    op_key: str,
    plan: Any,
    do: Callable[[Attempt], R],
    reconcile: Callable[[Attempt], Done[R] | NotDone],
    *,
    effect_kind: str = "effect",
) -> Any:
    """Run one side effect of this step through the ledger; returns its stored (JSON) result.

    A `CommitRefused` caused by this step's lost lease is re-raised as `LeaseLost` (the engine
    then refuses the step commit quietly); one caused by a newer attempt of the same op key
    propagates, so the step retries and finds the stored result.
    """
    try:
        return run_operation(
            _session,
            op_key,
            plan=plan,
            effect=_with_fault(do, effect_kind),
            reconcile=reconcile,
            run_id=ctx.run_id,
            step=ctx.step,
            effect_kind=effect_kind,
            fence=step_fence(ctx),
        )
    except CommitRefused as exc:
        if ctx.lease_lost:
            raise LeaseLost(str(exc)) from exc
        raise


def _with_fault(do: Callable[[Attempt], R], effect_kind: str) -> Callable[[Attempt], R]:
    """Fault injection (`FAULT_KILL_AFTER_EFFECT=<kind>`): die after the effect happened and
    before its result is committed — the window the ledger's reconcile exists for."""
    if get_settings().fault_kill_after_effect != effect_kind:
        return do

    def wrapped(att: Attempt) -> R:
        result = do(att)
        if att.number == 1:
            import os
            import signal

            if get_settings().fault_kill_scope == "group":  # the whole worker, as a host loss would
                os.killpg(os.getpgid(0), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return wrapped


__all__ = ["Attempt", "CommitRefused", "Done", "NotDone", "effect", "step_fence"]
