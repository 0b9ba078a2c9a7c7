"""Declaring a kind: name, version, retry policy, input model and a canvas of stages.

A kind is declared once per version; each step becomes the Celery task `<kind>.v<version>.<step>`
on the queue `<kind>.v<version>`, so only workers that serve that version ever see it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from proj.engine import broker
from proj.engine.errors import UnknownKind

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from proj.engine.context import PlanContext, StepContext


@dataclass(frozen=True)
class RetryPolicy:
    """Explicit per kind (invariant 9): attempts and exponential backoff with jitter.

    `outage_s`: how long the step may wait out an outage of a service it needs (its body raises
    `errors.Unavailable`): those attempts are retried after the same backoff but not counted,
    until the outage has lasted `outage_s`; then they count again. 0 (the default): an
    `Unavailable` is an ordinary failure. The run's deadline and a cancel still end it."""

    max_attempts: int
    initial_s: float = 1.0
    max_s: float = 60.0
    multiplier: float = 2.0
    jitter: float = 0.25
    outage_s: float = 0.0

    def backoff(self, attempt: int) -> float:
        """Delay before attempt `attempt + 1`, after `attempt` failures (1-based).

        `attempt` counts an outage's unspent attempts too, a thousand and more in a day: the
        growth stops at the cap instead of overflowing a float (`2.0 ** 1024`), which left such
        a failure unrecorded
        (`tests/unit/test_retry_and_kinds.py::test_backoff_stays_at_its_cap_however_many_outage_attempts_came_before`)."""
        growth = max(0, attempt - 1)
        if self.multiplier <= 1.0:  # never grows: cannot overflow
            base = self.initial_s * self.multiplier**growth
        else:
            base = self.initial_s
            for _ in range(growth):  # a few dozen turns at most: it stops at the cap
                if base >= self.max_s or base <= 0:
                    break
                base *= self.multiplier
        base = min(self.max_s, base)
        spread = base * self.jitter
        return max(0.0, min(self.max_s, base + random.uniform(-spread, spread)))

    @classmethod
    def network(cls) -> RetryPolicy:
        """Network side effects: 5 attempts, 1 s → 60 s."""
        return cls(max_attempts=5, initial_s=1.0, max_s=60.0)

    @classmethod
    def file(cls) -> RetryPolicy:
        """File side effects: 3 attempts."""
        return cls(max_attempts=3, initial_s=1.0, max_s=60.0)

    @classmethod
    def db(cls) -> RetryPolicy:
        """Database-only work."""
        return cls(max_attempts=5, initial_s=0.5, max_s=30.0)


StepFn = Callable[["StepContext"], Any]
CheckFn = Callable[["StepContext"], Any]


@dataclass(frozen=True)
class WaitSpec:
    """A wait: `check` reads the business tables; `topic` wakes it early; `timeout_s` re-checks."""

    topic: Callable[[PlanContext], str]
    timeout_s: float | Callable[[PlanContext], float]
    check: CheckFn | None = None
    until: Callable[[PlanContext], datetime] | None = None


@dataclass(frozen=True)
class ChildSpec:
    """A child run: `kind` enqueued with `input(ctx)`, idempotently (the key is derived from the
    parent run, the step and its item index); the step parks until the child finishes and its
    result is the child's. `timeout_s` only re-checks the child now and then (a lost wake-up)."""

    kind: str
    input: Callable[[StepContext], Mapping[str, Any]]
    timeout_s: float = 300.0


@dataclass(frozen=True)
class StepDef:
    """One named step. `retry` overrides the kind's policy for this step."""

    name: str
    fn: StepFn | None
    retry: RetryPolicy | None = None
    wait: WaitSpec | None = None
    child: ChildSpec | None = None


@dataclass(frozen=True)
class Stage:
    """A position in the chain: one step, a static group, or a fan-out of one step over items."""

    steps: tuple[StepDef, ...]
    over: Callable[[PlanContext], Sequence[Any]] | None = None

    @property
    def single(self) -> bool:
        """One step: neither a group nor a fan-out."""
        return self.over is None and len(self.steps) == 1

    @property
    def label(self) -> str:
        names = ",".join(s.name for s in self.steps)
        if self.over is not None:
            return f"map({names})"
        return names if len(self.steps) == 1 else f"group({names})"


def step(name: str, fn: StepFn, *, retry: RetryPolicy | None = None) -> Stage:
    """A single step in the chain."""
    return Stage(steps=(StepDef(name, fn, retry),))


def group(*stages: Stage) -> Stage:
    """Run several single steps in parallel; the chain continues when all have committed."""
    steps: list[StepDef] = []
    for s in stages:
        if not s.single or s.steps[0].wait is not None or s.steps[0].child is not None:
            raise ValueError("group() takes single steps")
        steps.append(s.steps[0])
    return Stage(steps=tuple(steps))


def fan_out(
    name: str,
    fn: StepFn,
    *,
    over: Callable[[PlanContext], Sequence[Any]],
    retry: RetryPolicy | None = None,
) -> Stage:
    """Run `fn` once per item of `over(ctx)`; the fan-in is counted in Postgres, not a chord."""
    return Stage(steps=(StepDef(name, fn, retry),), over=over)


def wait_for(
    name: str,
    *,
    topic: Callable[[PlanContext], str],
    timeout_s: float | Callable[[PlanContext], float],
    check: CheckFn | None = None,
) -> Stage:
    """Park until `check` holds (re-checked on each signal of `topic` and every `timeout_s`).

    Without `check`, the wait is satisfied by any stored signal of `topic` (also one sent before
    the run existed); the newest payload becomes the step's result.
    """
    return Stage(steps=(StepDef(name, None, None, WaitSpec(topic, timeout_s, check)),))


def sleep_until(name: str, *, until: Callable[[PlanContext], datetime]) -> Stage:
    """Durable sleep: the timer lives in Postgres, the worker slot is freed meanwhile."""
    spec = WaitSpec(topic=lambda ctx: f"sleep:{ctx.run_id}", timeout_s=0.0, until=until)
    return Stage(steps=(StepDef(name, None, None, spec),))


def child(
    name: str,
    *,
    kind: str,
    input: Callable[[StepContext], Mapping[str, Any]],
    over: Callable[[PlanContext], Sequence[Any]] | None = None,
    retry: RetryPolicy | None = None,
    recheck_s: float = 300.0,
) -> Stage:
    """Start a child run of `kind` and wait for it without holding a worker slot.

    The child is enqueued once per step (and item, with `over`: one child per item, the fan-in
    counted in Postgres): a retried or re-delivered step finds the same child. The step's
    result is the child's result; a failed or canceled child fails the step with the child's
    error, under this step's retry policy. `input(ctx)` sees the run's input, earlier results
    and, under `over`, `ctx.item`.
    """
    spec = ChildSpec(kind=kind, input=input, timeout_s=recheck_s)
    return Stage(steps=(StepDef(name, None, retry, None, spec),), over=over)


def queue_name(kind: str, version: int) -> str:
    """The queue of one kind version: only workers serving it consume it (invariant 10)."""
    return f"{kind}.v{version}"


def task_name(kind: str, version: int, step_name: str) -> str:
    """The Celery task name of a step, as Flower shows it."""
    return f"{kind}.v{version}.{step_name}"


CancelHook = Callable[["Session", Any, Any], None]


@dataclass(frozen=True)
class Kind:
    """A declared kind at one version. Equal name + version must mean equal step names."""

    name: str
    version: int
    retry: RetryPolicy
    input_model: type[BaseModel]
    canvas: tuple[Stage, ...]
    on_cancel: CancelHook | None = None
    compensation: str | None = None
    compensation_input: Callable[[Any, Any], Mapping[str, Any]] | None = None
    concurrency_key: Callable[[Any], str | None] | None = None
    concurrency_limit: int | None = None
    global_limit: int | None = None
    description: str = ""
    deadline_s: float | None = None
    _by_name: dict[str, StepDef] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.canvas:
            raise ValueError(f"kind {self.name} has no steps")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"kind {self.name}: deadline_s must be positive")
        for stage in self.canvas:
            for s in stage.steps:
                if s.name in self._by_name:
                    raise ValueError(f"kind {self.name}@{self.version}: duplicate step {s.name}")
                if not s.name.replace("_", "").isalnum():
                    raise ValueError(f"step name {s.name!r} must be alphanumeric/underscore")
                self._by_name[s.name] = s

    @property
    def queue(self) -> str:
        return queue_name(self.name, self.version)

    def task_name(self, step_name: str) -> str:
        return task_name(self.name, self.version, step_name)

    def step_names(self) -> list[str]:
        return [s.name for stage in self.canvas for s in stage.steps]

    def step_def(self, name: str) -> StepDef:
        return self._by_name[name]

    def policy_for(self, step_def: StepDef) -> RetryPolicy:
        return step_def.retry or self.retry

    def fans_out(self, stage: int) -> bool:
        """Whether `stage` is a fan-out: its step's results read back as a list in item order."""
        return stage < len(self.canvas) and self.canvas[stage].over is not None

    @property
    def has_limits(self) -> bool:
        return self.global_limit is not None or self.concurrency_limit is not None

    @property
    def start_step(self) -> str | None:
        """The step whose messages start runs in priority order, if the kind has one.

        That is the first step (item 0) of the first stage, on a kind without limits: its
        messages are interchangeable between the kind's pending runs (same task, same queue).
        When the first stage has more rows (a group, a fan-out), the rest are held back until
        item 0 is claimed (`holds_start_siblings`). A first step that waits (`acquire` waits
        for its approval) is a start step too: which run parks first is ordered the same way.
        Limited kinds order their starts in the admission line instead (`admission.admit`).
        """
        if self.has_limits:
            return None
        return self.canvas[0].steps[0].name

    @property
    def holds_start_siblings(self) -> bool:
        """The first stage can have more rows than item 0: they are published when it is claimed."""
        first = self.canvas[0]
        return self.start_step is not None and not first.single


_REGISTRY: dict[tuple[str, int], Kind] = {}
_ON_REGISTER: list[Callable[[Kind], None]] = []


def on_register(listener: Callable[[Kind], None]) -> None:
    """Call `listener` with every kind registered from now on.

    Why: the wiring registers one Celery task and queue per served step when it builds the app;
    a kind declared after that (a script that imported the app first) must be served too
    (`tests/integration/test_wiring.py`).
    """
    _ON_REGISTER.append(listener)


def register(kind: Kind) -> Kind:
    """Add a kind version to the process registry (idempotent for the same object)."""
    key = (kind.name, kind.version)
    existing = _REGISTRY.get(key)
    if existing is not None and existing is not kind and existing.step_names() != kind.step_names():
        raise ValueError(f"{kind.name}@{kind.version} declared twice with different steps")
    _REGISTRY[key] = kind
    if existing is None:
        for listener in list(_ON_REGISTER):
            listener(kind)
    return kind


def get_kind(name: str, version: int | None = None) -> Kind:
    """The kind at `version`, or its current (highest) version.

    A name this process does not know yet loads the wiring once (`proj.engine.broker.app`: the
    service's kinds and `ENGINE_EXTRA_KINDS`), so an engine entry point used before anything
    built the app still knows every configured kind (`tests/integration/test_wiring.py`).
    """
    kind = _lookup(name, version)
    if kind is None and broker.bound() is None:
        broker.app()
        kind = _lookup(name, version)
    if kind is not None:
        return kind
    if version is not None:
        raise UnknownKind(f"unknown kind {name}@{version}")
    raise UnknownKind(f"unknown kind {name!r}; known: {sorted(kind_names())}")


def _lookup(name: str, version: int | None) -> Kind | None:
    if version is not None:
        return _REGISTRY.get((name, version))
    versions = [v for (n, v) in _REGISTRY if n == name]
    return _REGISTRY[(name, max(versions))] if versions else None


def kind_names() -> set[str]:
    return {n for (n, _) in _REGISTRY}


def all_kinds() -> list[Kind]:
    return sorted(_REGISTRY.values(), key=lambda k: (k.name, k.version))


def served_kinds(spec: str = "") -> list[Kind]:
    """Kinds this worker serves: the `ENGINE_SERVE` list, or each kind's current and previous."""
    if spec.strip():
        wanted: Iterable[tuple[str, int]] = (
            (part.split("@")[0].strip(), int(part.split("@")[1])) for part in spec.split(",") if part.strip()
        )
        return [_served(n, v) for n, v in wanted]
    out: list[Kind] = []
    for name in sorted(kind_names()):
        versions = sorted((v for (n, v) in _REGISTRY if n == name), reverse=True)
        out.extend(_REGISTRY[(name, v)] for v in versions[:2])
    return out


def _served(name: str, version: int) -> Kind:
    """One `ENGINE_SERVE` entry's kind. Why the message: the bare `unknown kind nosuch@1` named
    neither the setting nor what it may name
    (`tests/integration/test_operator_review.py::test_an_engine_serve_naming_no_kind_says_which_exist`)."""
    try:
        return get_kind(name, version)
    except UnknownKind:
        known = ", ".join(f"{k.name}@{k.version}" for k in all_kinds())
        served = f"{name}@{version}"
        raise UnknownKind(f"ENGINE_SERVE names {served}, which no loaded kind is; known: {known}") from None


def served_versions(spec: str = "", consumed: Iterable[str] | None = None) -> list[tuple[str, int]]:
    """The (kind, version) queues this worker consumes, for `liveness.LIVENESS.serve`: the
    served kinds, less any queue a `consumed` list (Celery's `-Q`) leaves out."""
    selected = set(consumed or ())
    return [(k.name, k.version) for k in served_kinds(spec) if not selected or k.queue in selected]
