"""Wire the outbox into any Celery app: the `outbox.dispatch` task, its beat entry, the nudge.

    from outbox.celery import install
    install(app, session_factory=Session, engine_factory=MyTaskEngine)

`session_factory()` must return a new `Session`; `engine_factory()` anything with
`enqueue(kind, input, *, idempotency_key)`. Both are called lazily inside the worker (once per
process for the engine), so installing at import time opens no connection.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from celery import Celery

from outbox import nudge
from outbox.core import DEFAULT_POLICY, Engine, RetryPolicy, SessionFactory, dispatch

TASK_NAME = "outbox.dispatch"

# The nudge must not hang on a dead broker (it runs in a background thread anyway).
NUDGE_RETRY = {"max_retries": 1, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.2}


def install(
    app: Celery,
    session_factory: SessionFactory,
    engine_factory: Callable[[], Engine],
    *,
    beat_interval: float = 1.0,
    queue: str = "engine",
    task_name: str = TASK_NAME,
    batch: int = 100,
    policy: RetryPolicy = DEFAULT_POLICY,
    time_budget_s: float = 10.0,
    nudge_after_commit: bool = True,
) -> Any:
    """Register the dispatch task and its beat entry on `app`; returns the task.

    With `nudge_after_commit`, a commit that added events (via `outbox.add`) sends one dispatch
    message right away from a background thread; beat remains the guarantee.
    """
    engines: dict[int, Engine] = {}

    def engine_for_this_process() -> Engine:
        pid = os.getpid()
        if pid not in engines:
            engines.clear()
            engines[pid] = engine_factory()
        return engines[pid]

    @app.task(name=task_name, ignore_result=True)  # type: ignore[untyped-decorator]  # Celery is untyped
    def dispatch_task() -> dict[str, Any]:
        """Hand due outbox events to the task engine (beat every `beat_interval`, and nudges)."""
        return dispatch(
            session_factory,
            engine_for_this_process(),
            batch=batch,
            policy=policy,
            time_budget_s=time_budget_s,
        ).as_dict()

    route = {task_name: {"queue": queue}}
    routes = app.conf.task_routes
    if not routes:
        app.conf.task_routes = route
    elif isinstance(routes, dict):
        app.conf.task_routes = {**routes, **route}
    else:
        app.conf.task_routes = (route, *(routes if isinstance(routes, list | tuple) else (routes,)))

    schedule = dict(app.conf.beat_schedule or {})
    schedule[task_name] = {
        "task": task_name,
        "schedule": beat_interval,
        "options": {"queue": queue, "expires": max(5.0, beat_interval * 5)},
    }
    app.conf.beat_schedule = schedule

    if nudge_after_commit:

        def send() -> None:
            app.send_task(
                task_name,
                queue=queue,
                expires=max(30.0, beat_interval * 30),
                retry=True,
                retry_policy=NUDGE_RETRY,
            )

        nudge.set_nudger(send)
    return dispatch_task
