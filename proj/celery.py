"""The Celery app: `celery -A proj worker|beat|flower`.

Steps are tasks named `<kind>.v<version>.<step>` on the queue `<kind>.v<version>`; a worker
registers and consumes only the versions it serves (`ENGINE_SERVE`, default current+previous).
Engine housekeeping (`engine.sweep`, `outbox.dispatch`) travels on the `engine` queue.
"""

from __future__ import annotations

import importlib
import logging
import os

from celery import Celery, signals
from kombu import Queue
from sqlalchemy.orm import Session

import outbox
from outbox import celery as outbox_celery
from proj import db, logs
from proj.engine import broker
from proj.engine.errors import IdempotencyConflict
from proj.engine.kind import on_register, served_versions
from proj.settings import Settings, get_settings
from proj.transport import transport_for

log = logging.getLogger(__name__)

PERIODIC_KINDS = ("reconcile_downloads", "verify_library", "purge")


def create_app(settings: Settings | None = None) -> Celery:
    """Build the app from settings, register every known kind's steps, and bind it to the engine.

    The one wiring module: the engine never imports this file; it is handed the app through
    `proj.engine.broker.bind` (why: `proj/engine/broker.py`). Kinds declared after this call
    are registered as they are declared (`proj.engine.kind.on_register`).
    """
    settings = settings or get_settings()
    app = Celery("proj")
    app.conf.update(
        broker_url=settings.broker_url,
        broker_transport=transport_for(settings.broker_url, settings.broker_transport),
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=False,  # Postgres, not the broker, recovers lost work
        worker_prefetch_multiplier=1,
        # A worker whose processes are all busy takes no message (Redis; AMQP ignores it): a
        # recovered step's message goes to a worker that can run it now, instead of waiting
        # behind a long step in the busy one's prefetch (`bench.recovery`, issue #17).
        worker_disable_prefetch=settings.disable_prefetch and (settings.broker_url or "").startswith("redis"),
        task_default_queue="engine",
        task_create_missing_queues=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_concurrency=settings.worker_concurrency,
        timezone="UTC",
        beat_schedule={
            "engine-sweep": {
                "task": "engine.sweep",
                "schedule": settings.sweep_interval_s,
                "options": {"queue": "engine", "expires": max(5.0, settings.sweep_interval_s * 5)},
            },
        },
    )
    # Invariant 6: `outbox.dispatch` on the `engine` queue, every beat tick and after each commit
    # that added events. The engine's typed input errors are deterministic: dead after 3 attempts.
    outbox_celery.install(
        app,
        session_factory=_outbox_session,
        engine_factory=_outbox_engine,
        beat_interval=float(os.environ.get("OUTBOX_BEAT_INTERVAL_S", "1.0")),
        queue="engine",
        policy=outbox.RetryPolicy(poison=(ValueError, TypeError, IdempotencyConflict)),
    )
    app.task(name="engine.sweep", ignore_result=True)(sweep_task)
    app.task(name="engine.periodic", ignore_result=True)(periodic_task)
    every = {
        "reconcile_downloads": settings.periodic_reconcile_s,
        "verify_library": settings.periodic_verify_s,
        "purge": settings.periodic_purge_s,
    }
    for kind_name in PERIODIC_KINDS:
        app.conf.beat_schedule[f"periodic-{kind_name}"] = {
            "task": "engine.periodic",
            "schedule": every[kind_name],
            "args": (kind_name, every[kind_name]),
            "options": {"queue": "engine", "expires": every[kind_name]},
        }
    broker.bind(app)
    load_kinds(settings)
    register_step_tasks(app, settings)
    on_register(lambda _kind: register_step_tasks(app, settings))
    return app


def _outbox_session() -> Session:  # resolved per call: `db.dispose()` may replace the engine
    return db.sessions()()


def _outbox_engine() -> outbox.Engine:
    from proj.engine.celery_engine import CeleryTaskEngine

    return CeleryTaskEngine()


def load_kinds(settings: Settings | None = None) -> None:
    """Import every module that declares kinds (the service's, plus `ENGINE_EXTRA_KINDS`)."""
    settings = settings or get_settings()
    importlib.import_module("proj.kinds")
    for module in filter(None, (m.strip() for m in settings.engine_extra_kinds.split(","))):
        importlib.import_module(module)


def register_step_tasks(app: Celery, settings: Settings | None = None) -> None:
    """Register one Celery task per served step, and consume only the served version queues.

    Idempotent: called when the app is built and again for every kind declared afterwards.
    """
    from proj.engine import protocol
    from proj.engine.kind import served_kinds

    settings = settings or get_settings()
    queues = [Queue("engine")]
    for kind in served_kinds(settings.engine_serve):
        queues.append(Queue(kind.queue))
        for step_name in kind.step_names():
            name = kind.task_name(step_name)
            if name in app.tasks:
                continue

            starts = step_name == kind.start_step

            def run_step(
                step_id: int,
                more: list[int] | None = None,
                *,
                _starts: bool = starts,
                _task: tuple[str, str] = (name, kind.queue),
                _limited: bool = kind.has_limits,
            ) -> str:
                # `more` is a keyword: a worker older than batched wakes refuses the message
                # (unexpected argument) instead of misreading it; the sweeper re-sends singly.
                return protocol.execute(
                    int(step_id),
                    starts_run=_starts,
                    more=[int(i) for i in more or ()],
                    task=_task,
                    limited=_limited,
                )

            app.task(name=name, ignore_result=True)(run_step)
    app.conf.task_queues = queues


def sweep_task() -> dict[str, object]:
    """Beat-driven recovery (`engine.sweep`); see `proj.engine.sweeper`."""
    from proj.engine.sweeper import sweep

    return sweep().__dict__


def periodic_task(kind: str, every_s: float) -> str:
    """`engine.periodic`: enqueue a periodic kind keyed by its time bucket: two beats make one run."""
    import time

    from proj.engine import runs

    bucket = int(time.time() // every_s)
    ref = runs.enqueue(kind, {"bucket": bucket}, idempotency_key=f"{kind}:{bucket}")
    return str(ref.task_run_id)


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _log_format(logger: logging.Logger, **_: object) -> None:
    """`LOG_FORMAT=json`: the loggers Celery just set up (root, task) write JSON (`proj.logs`)."""
    if get_settings().log_format == "json":
        logs.use_json(logger)


@signals.worker_process_init.connect
def _child_init(**_: object) -> None:
    db.reset_after_fork()
    # Take this child's liveness lock and start its reaper now, not at its first claim: an idle
    # child is what recovers a dead sibling's step in about a second (`proj.engine.liveness`).
    # The same session says which version queues this worker consumes, so the sweeper re-sends
    # lost messages to them (and not, forever, to a queue nobody reads); `consume_from` is what
    # `-Q` selected (None: every declared queue).
    from proj.engine.liveness import LIVENESS

    LIVENESS.serve(served_versions(get_settings().engine_serve, app.amqp.queues.consume_from))


@signals.worker_ready.connect
def _pool_ready(sender: object = None, **_: object) -> None:
    """A worker without prefork children (`-P threads`, `-P solo`) claims in its own process:
    it says there which version queues it consumes. A prefork parent claims nothing and opens no
    liveness session; its children say it (`_child_init`)."""
    from celery.concurrency.prefork import TaskPool

    if isinstance(getattr(sender, "pool", None), TaskPool):
        return
    from proj.engine.liveness import LIVENESS

    LIVENESS.serve(served_versions(get_settings().engine_serve, app.amqp.queues.consume_from))


@signals.worker_process_shutdown.connect
def _child_exit(**_: object) -> None:
    """Export buffered spans: a prefork child leaves without running atexit hooks."""
    from proj.engine import tracing

    tracing.flush()


@signals.worker_init.connect
def _preflight(sender: object = None, **_: object) -> None:
    """Refuse to start on a stale schema, an impossible connection budget or an unsafe pooler;
    wait, not refuse, while Postgres has no connection for us yet (`preflight.when_admitted`).
    The budget counts this worker's own `-c`, and a pool without child processes (`-P threads`)
    as one process."""
    from proj.engine.preflight import check_connection_budget, check_pooling, check_schema, when_admitted

    concurrency, one_process = _pool_shape(sender)
    if one_process:
        db.serve_threads(concurrency or get_settings().worker_concurrency)

    def checks() -> None:
        check_schema()
        check_connection_budget(concurrency=concurrency, one_process=one_process)
        check_pooling()

    try:
        when_admitted(checks)  # waits while Postgres is full or starting up
    except Exception as exc:
        log.critical("worker refuses to start: %s", exc)
        raise SystemExit(f"worker refuses to start: {exc}") from exc
    finally:
        db.dispose()


def _pool_shape(worker: object) -> tuple[int | None, bool]:
    """(the worker's concurrency, whether its pool runs in its own process) from the
    WorkController `worker_init` passes; (None, False) when it says neither."""
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool

    concurrency = getattr(worker, "concurrency", None)
    pool_cls = getattr(worker, "pool_cls", None)
    impl = get_implementation(pool_cls) if pool_cls is not None else TaskPool
    one_process = not (isinstance(impl, type) and issubclass(impl, TaskPool))
    return (concurrency if isinstance(concurrency, int) and concurrency > 0 else None), one_process


app = create_app()
