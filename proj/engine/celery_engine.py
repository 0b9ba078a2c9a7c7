"""`CeleryTaskEngine`: the `TaskEngine` port on Celery (execution) and Postgres (truth)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

from proj import db
from proj.engine import broker, runs
from proj.engine.port import TaskRunRef, TaskRunView

log = logging.getLogger(__name__)


class CeleryTaskEngine:
    """Implements `proj.engine.port.TaskEngine`.

    `start()` runs an in-process worker (thread pool) and, with the `beat` role, the sweeper
    loop — what the demo and embedded users need. Production runs `celery -A proj worker` and
    `celery -A proj beat` instead; the behaviour is the same.
    """

    def __init__(self) -> None:
        # The wiring loads every kind: the port must know them all before its first enqueue.
        self._app = broker.app()
        self._worker: Any = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()

    def enqueue(
        self,
        kind: str,
        input: Mapping[str, Any],
        *,
        idempotency_key: str,
        available_at: datetime | None = None,
        priority: int = 0,
        deadline_at: datetime | None = None,
    ) -> TaskRunRef:
        return runs.enqueue(
            kind,
            input,
            idempotency_key=idempotency_key,
            available_at=available_at,
            priority=priority,
            deadline_at=deadline_at,
        )

    def enqueue_many(
        self,
        kind: str,
        items: Iterable[tuple[str, Mapping[str, Any]]],
        *,
        available_at: datetime | None = None,
        priority: int = 0,
        deadline_at: datetime | None = None,
    ) -> list[TaskRunRef]:
        return runs.enqueue_many(
            kind, items, available_at=available_at, priority=priority, deadline_at=deadline_at
        )

    def result(self, task_run_id: UUID, timeout_s: float) -> Any:
        return runs.result(task_run_id, timeout_s)

    def signal(self, topic: str, payload: Any = None) -> int:
        return runs.signal(topic, payload)

    def cancel(self, task_run_id: UUID, reason: str) -> None:
        runs.cancel(task_run_id, reason)

    def get(self, task_run_id: UUID) -> TaskRunView | None:
        return runs.get(task_run_id)

    def find(self, kind: str, idempotency_key: str) -> TaskRunView | None:
        return runs.find(kind, idempotency_key)

    def start(self, *, roles: Sequence[str] = ("worker",), concurrency: int = 2) -> None:
        """Run a worker (`worker`) and/or the periodic sweeper (`beat`) in this process.

        `outbox` (with `beat`) also dispatches the outbox every tick, as `celery -A proj beat`
        does. Off by default: tests drive `outbox.dispatch` themselves and count its calls.
        """
        from proj.engine.preflight import check_connection_budget, check_pooling, check_schema

        app = self._app
        db.serve_threads(concurrency)  # before the first connection: the pool is sized to the threads
        check_schema()
        check_connection_budget(concurrency=concurrency, one_process=True)  # a thread pool
        check_pooling()
        self._stopping.clear()
        if "worker" in roles:
            from proj.engine.kind import served_versions
            from proj.engine.liveness import LIVENESS
            from proj.settings import get_settings

            # This process' liveness lock and reaper, before its first claim, and the version
            # queues it consumes (the sweeper re-sends lost messages only to consumed queues).
            LIVENESS.serve(served_versions(get_settings().engine_serve))
            ready = threading.Event()
            # The remote-control (pidbox) consumer shares the worker thread's AMQP connection;
            # stopping it from another thread deadlocks py-amqp. Embedded workers do without it.
            app.conf.worker_enable_remote_control = False
            worker = app.WorkController(
                pool_cls="threads",
                concurrency=concurrency,
                loglevel="WARNING",
                without_heartbeat=True,
                without_mingle=True,
                without_gossip=True,
                ready_callback=lambda *_: ready.set(),
            )
            self._worker = worker
            t = threading.Thread(target=worker.start, name="engine-worker", daemon=True)
            t.start()
            self._threads.append(t)
            if not ready.wait(30):
                raise RuntimeError("in-process worker did not become ready in 30 s")
        if "beat" in roles:
            t = threading.Thread(
                target=self._beat_loop, args=("outbox" in roles,), name="engine-beat", daemon=True
            )
            t.start()
            self._threads.append(t)

    def _beat_loop(self, dispatch_outbox: bool = False) -> None:
        from proj.engine.sweeper import sweep
        from proj.settings import get_settings

        while not self._stopping.is_set():
            try:
                sweep()
            except Exception:  # keep sweeping; the next tick retries, but say so every time
                log.exception("sweep failed; retrying in 1 s")
                time.sleep(1)
            if dispatch_outbox:
                # The post-commit nudge (an `outbox.dispatch` message this process' worker
                # consumes from the `engine` queue) is best effort; beat is the guarantee. Run the
                # task `proj/celery.py` installs (same session factory, engine and retry policy)
                # right here, as `celery -A proj beat` would schedule it.
                try:
                    from outbox.celery import TASK_NAME

                    self._app.tasks[TASK_NAME]()
                except Exception:  # the next tick retries; say so (a row's own failure is on it)
                    log.exception("outbox dispatch failed; retrying in 1 s")
                    time.sleep(1)
            self._stopping.wait(get_settings().sweep_interval_s)

    def stop(self) -> None:
        """Ask the worker to shut down from its own thread, as a signal handler would.

        Stopping its consumers from this thread would race the worker thread for the broker
        connection (py-amqp deadlocks on it), so we raise Celery's shutdown flag, which the
        worker's event loop checks, and wait for the thread to finish.
        """
        from celery.worker import state

        self._stopping.set()
        if self._worker is not None:
            state.should_stop = 0
            worker_thread = self._threads[0]
            worker_thread.join(timeout=15)
            state.should_stop = None
            if worker_thread.is_alive():
                self._worker.stop(in_sighandler=False)
            self._worker = None
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()
        if self._worker is None and not self._threads:
            from proj.engine.liveness import LIVENESS

            LIVENESS.stop()  # this process claims no more steps: its liveness session can go
