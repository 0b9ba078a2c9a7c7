"""What one step costs the engine itself, in one process and without a Celery worker: the CPU
of the client and of Postgres per step, beside two one-row statements that do nothing else.

Why: per-message mode (`INLINE_STEPS=0`) needs two statements per step, the claim and the
commit (`proj.engine.store.claims`, `proj.engine.store.commits`), and issue #17 asks what bounds
it. `bench.throughput` measures the whole worker, where both sides' Celery costs and the
contention of 2 CPUs blur the engine's own share. Here each step is delivered the way the
worker's task delivers it (`protocol.execute`), one after another, and only the engine runs.

Four figures per step, from one invocation:
- **message step**: claim, no-op body and one-statement commit (`INLINE_STEPS=0`), without the
  publish of the next message;
- **publish**: that publish (`dispatch.publish`: the Celery message and its `task-sent` event),
  which a plain Celery chain link pays as well. It goes to a Redis db this bench owns; nothing
  consumes it;
- **inline step**: a step of a chain that runs inline (`INLINE_STEPS=10`): one statement commits
  a step and claims the next;
- **floor**: two one-row updates by primary key through the same autocommit path
  (`bench.kinds.floor_step`), the first without waiting for its WAL flush (as the claim), the
  second waiting for it (as the commit), on a scratch table with only a primary key.
  `bench.throughput --floor` runs the same two statements in every link of a plain Celery chain.

Client CPU is this process' (`time.process_time`); Postgres CPU is that of the backends of the
engine's pool (`application_name` `proj`, read from `/proc`), so the bench's own bookkeeping
connection is not counted. Wall time is sequential: one step at a time, round trips included.

    .venv/bin/python -m bench.step_cost                  # 2,000 runs of 5 steps per mode
    .venv/bin/python -m bench.step_cost --runs 500 --json
    .venv/bin/python -m bench.step_cost --statements 5   # and the claim's and the commit's
                                                         # Postgres CPU apart, 5 repeats

`--statements R` adds the Postgres CPU of the claim and of the commit of a message step, each
measured apart: a wave of the runs' second steps is claimed (`store.claims.claim`), then the
same steps are committed (`store.commits.succeed_and_publish_next`), R times, and it prints the
median and the spread of the repeats. Apart, a change to one statement shows above the noise
of the whole ladder (session 12 measured migration 0012 this way).

It recreates database `proj_bench_cost` (`--db`) and owns Redis db 14 (`--broker`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from bench.common import (
    add_service_args,
    broker_db,
    machine,
    machine_line,
    prepare_database,
    proc_cpu,
    service_env,
    set_env,
)

STEPS = 5  # kind `noop5`


@dataclass
class Cost:
    """Per step, in milliseconds (`postgres_cpu` None: not measured, the publish)."""

    client_cpu: float
    postgres_cpu: float | None
    wall: float


def backend_cpu(pg: Any) -> float:
    """CPU seconds so far of the Postgres backends of the engine's pool."""
    pids = [r[0] for r in pg.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'proj'")]
    return sum(proc_cpu(pid) for pid in pids)  # 0 for a pooled connection closed meanwhile


@contextmanager
def measured(pg: Any, steps: int, out: list[Cost]) -> Iterator[None]:
    """Append the cost per step of the block to `out`."""
    cpu0, pg0, wall0 = time.process_time(), backend_cpu(pg), time.perf_counter()
    yield
    cpu1, pg1, wall1 = time.process_time(), backend_cpu(pg), time.perf_counter()
    out.append(Cost(1000 * (cpu1 - cpu0) / steps, 1000 * (pg1 - pg0) / steps, 1000 * (wall1 - wall0) / steps))


class PublishMeter:
    """Wraps `dispatch.publish` to add up the CPU and wall time spent in it (the messages are sent)."""

    def __init__(self) -> None:
        from proj.engine import dispatch

        self.cpu = 0.0
        self.wall = 0.0
        self.calls = 0
        self._inner: Callable[[Sequence[Any]], list[Any]] = dispatch.publish
        dispatch.publish = self  # looked up by name at each call

    def __call__(self, items: Sequence[Any]) -> list[Any]:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            return self._inner(items)
        finally:
            self.cpu += time.process_time() - cpu0
            self.wall += time.perf_counter() - wall0
            self.calls += len(items)

    def take(self) -> tuple[float, float, int]:
        taken = (self.cpu, self.wall, self.calls)
        self.cpu = self.wall = 0.0
        self.calls = 0
        return taken


def use_inline_steps(n: int) -> None:
    from proj.settings import get_settings

    os.environ["INLINE_STEPS"] = str(n)
    get_settings.cache_clear()


def insert_runs(n: int) -> list[int]:
    """N runs of `noop5`, in one transaction; their first steps' ids (nothing published)."""
    from proj import db
    from proj.engine import runs

    tag = uuid.uuid4().hex
    ids: list[int] = []
    with db.transaction() as s:
        for i in range(n):
            _ref, first = runs.insert_run(s, "noop5", {"i": i}, idempotency_key=f"{tag}-{i}")
            ids.extend(d.step_id for d in first)
    return ids


def pending_steps(pg: Any) -> list[int]:
    return [r[0] for r in pg.execute("SELECT id FROM engine.step WHERE status = 'pending' ORDER BY id")]


def reset(pg: Any) -> None:
    pg.execute("TRUNCATE engine.step_attempt, engine.step, engine.task_run CASCADE")


def message_steps(pg: Any, n: int, meter: PublishMeter) -> tuple[Cost, Cost]:
    """Every step as a delivery of its own; (the ladder without the publish, the publish)."""
    from proj.engine import protocol

    use_inline_steps(0)
    reset(pg)
    ids = insert_runs(n)
    costs: list[Cost] = []
    meter.take()
    starts, steps = True, 0
    while ids:  # one wave per stage: each run's next step is pending after the wave before
        with measured(pg, len(ids), costs):
            for step_id in ids:
                protocol.execute(step_id, starts_run=starts, limited=False)
        steps += len(ids)
        starts = False
        ids = pending_steps(pg)
    assert steps == n * STEPS, f"{steps} steps ran, {n * STEPS} expected"
    cpu, wall, calls = meter.take()
    assert calls == n * (STEPS - 1), f"{calls} messages published, {n * (STEPS - 1)} expected"
    total = Cost(
        sum(c.client_cpu for c in costs) / len(costs),
        sum(c.postgres_cpu or 0.0 for c in costs) / len(costs),
        sum(c.wall for c in costs) / len(costs),
    )
    publish = Cost(1000 * cpu / steps, None, 1000 * wall / steps)
    ladder = Cost(total.client_cpu - publish.client_cpu, total.postgres_cpu, total.wall - publish.wall)
    return ladder, publish


def inline_steps(pg: Any, n: int) -> Cost:
    """Each run's five steps in one delivery: one claim, then one statement per step."""
    from proj.engine import protocol

    use_inline_steps(10)
    reset(pg)
    ids = insert_runs(n)
    costs: list[Cost] = []
    with measured(pg, n * STEPS, costs):
        for step_id in ids:
            protocol.execute(step_id, starts_run=True, limited=False)
    done = pg.execute("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'").fetchone()[0]
    assert done == n, f"{done} of {n} runs succeeded inline"
    return costs[0]


def statements(pg: Any, n: int) -> tuple[float, float]:
    """Postgres CPU ms per statement of a message step's claim and of its commit, measured
    apart over the second steps of `n` runs (their first steps run through the ladder)."""
    from proj import db
    from proj.engine import protocol
    from proj.engine.kind import get_kind
    from proj.engine.store import claims, commits

    use_inline_steps(0)
    reset(pg)
    for step_id in insert_runs(n):
        protocol.execute(step_id, starts_run=True, limited=False)
    ids = pending_steps(pg)
    tokens = {step_id: uuid.uuid4() for step_id in ids}
    claimed: dict[int, claims.ClaimedRow] = {}
    pg0 = backend_cpu(pg)
    for step_id in ids:
        with db.autocommit() as conn:
            row = claims.claim(conn, step_id=step_id, token=tokens[step_id], owner="bench", ttl=60.0)
        assert row is not None, f"step {step_id} was not claimed"
        claimed[step_id] = row
    pg1 = backend_cpu(pg)
    kind = get_kind("noop5", None)
    for step_id, row in claimed.items():
        following = kind.canvas[row.stage + 1]
        sdef = following.steps[0]
        nxt = commits.NextMessage(row.run_id, row.stage + 1, sdef.name, following.label, row.max_attempts)
        with db.autocommit() as conn:
            done = commits.succeed_and_publish_next(
                conn, step_id=step_id, token=tokens[step_id], stage=row.stage, result="null", next_step=nxt
            )
        assert done is not None, f"step {step_id} was not committed"
    pg2 = backend_cpu(pg)
    return 1000 * (pg1 - pg0) / len(ids), 1000 * (pg2 - pg1) / len(ids)


def floor(pg: Any, n: int) -> Cost:
    """Two one-row statements per step (`bench.kinds.floor_step`), as the ladder issues its two."""
    from bench.kinds import floor_reset, floor_step

    floor_reset(pg, n)
    costs: list[Cost] = []
    with measured(pg, n, costs):
        for row in range(1, n + 1):
            floor_step(row)
    return costs[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_service_args(p, db="proj_bench_cost", broker="redis://127.0.0.1:6379/14")
    p.add_argument("--runs", type=int, default=2000, help="runs of 5 steps per mode")
    p.add_argument("--warmup", type=int, default=100, help="runs per mode before measuring")
    p.add_argument(
        "--statements",
        type=int,
        default=0,
        metavar="R",
        help="also the claim and the commit apart, R repeats",
    )
    args = p.parse_args()
    args.concurrency = 1
    env = set_env(service_env(args, kinds="bench.kinds", sweep_s=None, INLINE_STEPS=0))
    pg = prepare_database(args, env)
    pg.execute("SET application_name = 'bench-step-cost'")

    import proj.celery  # noqa: F401  (the app: kinds, the broker binding the publish uses)

    with broker_db(args.broker, "bench.step_cost"):
        meter = PublishMeter()
        message_steps(pg, args.warmup, meter)  # prepared statements, pool, caches
        inline_steps(pg, args.warmup)
        floor(pg, args.warmup * STEPS)
        ladder, publish = message_steps(pg, args.runs, meter)
        inline = inline_steps(pg, args.runs)
        base = floor(pg, args.runs * STEPS)
        apart = [statements(pg, args.runs) for _ in range(args.statements)]

    rows = {
        "message step: claim + commit": ladder,
        "message step: publish the next": publish,
        "inline step": inline,
        "floor: two one-row updates": base,
    }
    if args.json:
        figures = {name: asdict(cost) for name, cost in rows.items()}
        if apart:
            figures["statements apart"] = {
                "claim_postgres_cpu": [c for c, _ in apart],
                "commit_postgres_cpu": [m for _, m in apart],
            }
        print(json.dumps({"machine": machine(env["DATABASE_URL"]), "runs": args.runs, **figures}))
        return
    print(f"{args.runs} runs x {STEPS} no-op steps per mode, one process, no Celery worker")
    print(machine_line(machine(env["DATABASE_URL"])))
    print()
    print(f"{'ms per step':34s} {'client CPU':>10s} {'Postgres CPU':>13s} {'wall':>8s}")
    for name, c in rows.items():
        pg_cpu = f"{'-':>13s}" if c.postgres_cpu is None else f"{c.postgres_cpu:13.3f}"
        print(f"{name:34s} {c.client_cpu:10.3f} {pg_cpu} {c.wall:8.3f}")
    print()
    assert ladder.postgres_cpu is not None and base.postgres_cpu is not None
    print(
        "a message step's claim and commit over the floor: "
        f"client +{ladder.client_cpu - base.client_cpu:.3f} ms, "
        f"Postgres +{ladder.postgres_cpu - base.postgres_cpu:.3f} ms"
    )
    if apart:
        print()
        print(f"a message step's statements apart, Postgres CPU ms, {len(apart)} repeats: median (min-max)")
        for name, values in (("claim", [c for c, _ in apart]), ("commit", [m for _, m in apart])):
            print(f"  {name:8s} {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
