"""What the throughput benchmark runs: kind `noop5` (5 no-op steps), plain Celery tasks, and the
floor's tasks (a plain task that also runs two one-row statements).

Loaded in the worker with `ENGINE_EXTRA_KINDS=bench.kinds`; the plain tasks register on the same
app, so one worker process serves both. Plain chains travel on the `engine` queue (idle without
beat), our steps on `noop5.v1`: both on the same Redis broker.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import shared_task
from celery.signals import task_postrun, task_prerun
from pydantic import BaseModel
from sqlalchemy import text

from proj import db
from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.settings import get_settings

# `bench.throughput --deliveries`: each prefork child appends, per task it runs, its start and end
# (wall clock) to a file named by its pid in this directory.
DELIVERY_LOG = "BENCH_DELIVERY_LOG"

PLAIN_QUEUE = "engine"
PLAIN_COUNTER = "bench:plain:done"
FLOOR_COUNTER = "bench:floor:done"


class NoopInput(BaseModel):
    i: int = 0


def noop(ctx: StepContext) -> None:
    return None


NOOP5 = register(
    Kind(
        name="noop5",
        version=1,
        retry=RetryPolicy.db(),
        input_model=NoopInput,
        canvas=tuple(step(f"s{i}", noop) for i in range(1, 6)),
        description="benchmark: five no-op steps",
    )
)

_redis: redis.Redis | None = None


def counter() -> redis.Redis:
    """The broker's Redis (redis-py reconnects in a forked child by itself)."""
    global _redis
    if _redis is None:
        _redis = redis.Redis.from_url(get_settings().broker_url or "redis://127.0.0.1:6379/0")
    return _redis


@shared_task(name="plain.noop", ignore_result=True)
def plain_noop() -> None:
    return None


@shared_task(name="plain.done", ignore_result=True)
def plain_done() -> None:
    """The chain's fifth task: a no-op that makes completion observable without a backend."""
    counter().incr(PLAIN_COUNTER)


# The floor (`bench.throughput --floor`, `bench.step_cost`): what any engine that claims a step
# before its body and commits it after (DESIGN invariants 1 and 3) pays at least per step, with one
# row per step and nothing else: two one-row updates by primary key through the engine's autocommit
# path (`proj.db.autocommit`). The first does not wait for its WAL flush, as the claim does not
# (`proj.engine.store.claims`); the second waits, as a commit must.
FLOOR_DDL = "CREATE TABLE IF NOT EXISTS bench_floor (id bigint PRIMARY KEY, status text NOT NULL)"
FLOOR_FILL = "INSERT INTO bench_floor SELECT g, 'pending' FROM generate_series(1, %(n)s) g"
FLOOR_CLAIM = text(
    """
    WITH claimed AS (
        UPDATE bench_floor SET status = 'running' WHERE id = :id AND status = 'pending' RETURNING id
    ), relaxed AS (
        SELECT set_config('synchronous_commit', 'off', true)
    )
    SELECT claimed.id FROM claimed, relaxed
    """
)
FLOOR_COMMIT = text(
    "UPDATE bench_floor SET status = 'succeeded' WHERE id = :id AND status = 'running' RETURNING id"
)


def floor_reset(pg: Any, n: int) -> None:
    """Rows 1..n pending, and no others (`pg`: an autocommit psycopg connection)."""
    pg.execute(FLOOR_DDL)
    pg.execute("TRUNCATE bench_floor")
    pg.execute(FLOOR_FILL, {"n": n})
    pg.execute("VACUUM ANALYZE bench_floor")


def floor_step(row: int) -> None:
    """Claim row `row`, then commit it: two autocommit statements, as the engine's message step."""
    with db.autocommit() as conn:
        if conn.first(FLOOR_CLAIM, {"id": row}) is None:
            raise RuntimeError(f"floor row {row} was not pending")
    with db.autocommit() as conn:
        if conn.first(FLOOR_COMMIT, {"id": row}) is None:
            raise RuntimeError(f"floor row {row} was not running")


@shared_task(name="floor.link", ignore_result=True)
def floor_link(row: int) -> None:
    floor_step(row)


@shared_task(name="floor.done", ignore_result=True)
def floor_done(row: int) -> None:
    """The floor chain's fifth link; makes completion observable, as `plain.done`."""
    floor_step(row)
    counter().incr(FLOOR_COUNTER)


def record_deliveries(directory: str) -> None:
    """Log each task a worker process runs (`task_prerun` to `task_postrun`): the time a child
    spends per delivery, and between deliveries, waiting for its main process to hand it the next
    (`bench.throughput --deliveries`). One line per task, so both sides pay the same per delivery;
    plain has five deliveries per chain where ours has one per run, so rates measured with it on
    lean towards ours and are not the benchmark's figures."""
    started: dict[str, float] = {}

    @task_prerun.connect(weak=False)
    def _began(task_id: str | None = None, **_: Any) -> None:
        if task_id is not None:
            started[task_id] = time.time()

    @task_postrun.connect(weak=False)
    def _ended(task_id: str | None = None, **_: Any) -> None:
        began = started.pop(task_id or "", None)
        if began is not None:
            with open(os.path.join(directory, str(os.getpid())), "a") as f:
                f.write(f"{began:.6f} {time.time():.6f}\n")


if os.environ.get(DELIVERY_LOG):
    record_deliveries(os.environ[DELIVERY_LOG])
