"""Admission of limited kinds: slots counted in Postgres across all workers (statements in
`proj.engine.store.admission`).

A claim of a kind with `global_limit` or `concurrency_limit` passes every gate in the claim
transaction, or is refused with a reason and waits in line; a holder that lets go hands its slot
to the head of the line (`handoff`), so the order holds and the latency is a message, not a
sweep. Proof: `tests/integration/test_limits.py`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from sqlalchemy.orm import Session

from proj.engine import dispatch
from proj.engine.dispatch import Dispatch
from proj.engine.heartbeat import lock_idle_ms
from proj.engine.kind import Kind, all_kinds
from proj.engine.store import admission as store
from proj.settings import get_settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gate:
    """One limit a claim must pass: the kind's global limit, or its limit per concurrency key."""

    scope: str  # 'global' | 'key'
    kind: str
    limit: int
    key: str | None = None
    key_limit: int | None = None  # the global gate: the kind's limit per key (its line skips full keys)

    @property
    def lock(self) -> str:
        return f"gk:{self.kind}" if self.scope == "global" else f"ck:{self.kind}:{self.key}"

    def reason(self, held: int) -> str:
        if self.scope == "global":
            return f"waiting for a slot: {self.kind} has {held}/{self.limit} runs in a step (global limit)"
        return (
            f"waiting for a slot: concurrency key {self.key!r} of {self.kind} has "
            f"{held}/{self.limit} runs in a step"
        )


@dataclass(frozen=True)
class Denial:
    """Why a claim was refused."""

    gate: Gate
    held: int


def any_limits() -> bool:
    """Whether any kind known to this process declares a limit."""
    return any(k.global_limit is not None or k.concurrency_limit is not None for k in all_kinds())


def limit_gates(kind: Kind, concurrency_key: str | None) -> list[Gate]:
    """The limits of a kind, global first (the advisory lock order, so claims never deadlock).

    Keys are scoped to the kind (and shared by its versions). A run without a key (the kind's
    function returned None) is only under the global limit.
    """
    gates: list[Gate] = []
    if kind.global_limit is not None:
        gates.append(Gate("global", kind.name, kind.global_limit, key_limit=kind.concurrency_limit))
    if kind.concurrency_limit is not None and concurrency_key is not None:
        gates.append(Gate("key", kind.name, kind.concurrency_limit, concurrency_key))
    return gates


def slot_of(s: Session, step_id: int) -> store.Slot | None:
    """The run (kind, version, key, order) of a pending, due step of a live run; None if not."""
    return store.slot_of(s, step_id)


def holders(s: Session, gate: Gate, run_id: uuid.UUID | None = None) -> tuple[int, bool]:
    """How many runs hold a slot of `gate`, and whether `run_id` is one of them."""
    return store.holders(s, kind=gate.kind, key=_key(gate), run_id=run_id)


def _key(gate: Gate) -> str | None:
    """The key a gate counts by (None: the kind's global gate)."""
    return gate.key if gate.scope == "key" else None


def waiters(s: Session, gate: Gate, n: int, before: store.Slot | None = None) -> list[store.Waiter]:
    """Blocked steps in line for `gate`, best first (priority desc, then the oldest run); with
    `before`, only those ordered before that run. The global line leaves out a waiter whose key
    is full: it could not use the slot."""
    if n <= 0:
        return []
    return store.waiters(
        s,
        kind=gate.kind,
        key=_key(gate),
        n=n,
        fresh=blocked_fresh_s(),
        before=before,
        key_limit=gate.key_limit if gate.scope == "global" else None,
    )


def blocked_fresh_s() -> float:
    """How long a refused step keeps its place in line without being retried."""
    return 3.0 * get_settings().republish_after_s + 2.0 * get_settings().sweep_interval_s


def admit(s: Session, slot: store.Slot, gates: list[Gate]) -> tuple[Denial | None, list[Dispatch]]:
    """Pass every gate, or say which one refused; also the better-ordered waiters to wake.

    Runs inside the claim transaction, before its UPDATE. The advisory lock (taken before any
    row lock, so claims never deadlock) serialises claims of one kind/key and is held to the
    commit, so the count sees every earlier claim. Releases need no lock: they only free slots.
    A slot goes to this step only if fewer better-ordered waiters than free slots are in line.
    """
    kicks: list[Dispatch] = []
    for gate in gates:
        store.lock_gate(s, gate.lock, idle_ms=lock_idle_ms())
        held, mine = holders(s, gate, slot.run_id)
        if mine:
            continue  # a sibling of this run holds the slot already
        if held >= gate.limit:
            return Denial(gate, held), kicks
        free = gate.limit - held
        better = waiters(s, gate, free, before=slot)
        kicks += nudge(s, better)  # slots are free for them: do not wait for the sweeper
        if len(better) >= free:
            return Denial(gate, held), kicks
    return None, kicks


def deny(s: Session, step_id: int, denial: Denial) -> list[Dispatch]:
    """Leave the step pending with its reason; no busy loop: it is retried by a hand-off, or
    by the sweeper after `republish_after_s` (its `published_at` is reset now)."""
    reason = denial.gate.reason(denial.held)
    store.deny(s, step_id=step_id, reason=reason, scope=denial.gate.scope)
    log.debug("step %s refused: %s", step_id, reason)
    return []


def nudge(s: Session, rows: list[store.Waiter]) -> list[Dispatch]:
    """Send waiters a message now (a row being claimed already is skipped, never waited for)."""
    if not rows:
        return []
    woken = store.nudge_waiters(s, [r.id for r in rows])
    return [
        dispatch.step_dispatch(r.id, r.kind, r.version, r.name, r.priority) for r in rows if r.id in woken
    ]


def handoff(s: Session, kind: Kind, concurrency_key: str | None) -> list[Dispatch]:
    """A holder of `kind`/`key` let go (commit, park, cancel, lease expiry): wake the head of
    the line for each freed slot so the order holds and the latency is a message, not a sweep."""
    heads: dict[int, store.Waiter] = {}
    for gate in limit_gates(kind, concurrency_key):
        for row in waiters(s, gate, gate.limit - holders(s, gate)[0]):
            heads.setdefault(row.id, row)
    return nudge(s, list(heads.values()))
