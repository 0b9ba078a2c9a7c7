"""What the throughput benchmark runs: kind `noop5` (5 no-op steps) and plain Celery tasks.

Loaded in the worker with `ENGINE_EXTRA_KINDS=bench.kinds`; the plain tasks register on the same
app, so one worker process serves both. Plain chains travel on the `engine` queue (idle without
beat), our steps on `noop5.v1`: both on the same Redis broker.
"""

from __future__ import annotations

import redis
from celery import shared_task
from pydantic import BaseModel

from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step
from proj.settings import get_settings

PLAIN_QUEUE = "engine"
PLAIN_COUNTER = "bench:plain:done"


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
