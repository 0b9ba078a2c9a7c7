"""Outbox latency: business commit → run started, with the post-commit nudge and with beat alone.

    .venv/bin/python -m bench.outbox_latency [--events 150] [--rate 10] [--json]

Needs the real services: Postgres on 127.0.0.1:5432 and Redis on 127.0.0.1:6379 (what the tests
use). Recreates its own database (`proj_bench_outbox`) and uses its own Redis db (12), starts one
`celery -A proj worker` (prefork) and one `celery -A proj beat` (outbox beat every 1 s), then
for each mode commits `--events` transactions, each adding one outbox event for a `demo` run, at
`--rate` per second with random spacing (so commits fall anywhere within a beat tick), and prints
p50/p99 of

- commit → `outbox_event.dispatched_at` (the dispatcher handed the event to the engine), and
- commit → `task_run.started_at` (a worker claimed the run's first step),

measured against the same host clock (the commit time is taken in this process right after
`COMMIT` returned; the other two are Postgres `clock_timestamp()`/`now()` on the same machine).
Modes: `nudge` (after commit, one `outbox.dispatch` message is sent at once) and `beat` (nudge
disabled: only beat's 1 s tick dispatches). Takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    VENV_BIN,
    add_service_args,
    recreate_database,
    service_env,
    set_env,
    worker_args,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--events", type=int, default=150, help="measured events per mode")
    p.add_argument("--rate", type=float, default=10.0, help="commits per second (mean)")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured events before measuring")
    p.add_argument("--concurrency", type=int, default=4, help="prefork worker processes")
    p.add_argument("--beat-interval", type=float, default=1.0, help="outbox beat period, seconds")
    add_service_args(p, db="proj_bench_outbox", broker="redis://127.0.0.1:6379/12")
    return p.parse_args(argv)


def configure_env(args: argparse.Namespace) -> dict[str, str]:
    """Settings are read once per process: set them before `proj` is imported (here and children)."""
    env = service_env(args, kinds="", quiet_periodic=False, OUTBOX_BEAT_INTERVAL_S=args.beat_interval)
    return set_env(env)


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, **env}
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [str(VENV_BIN / "celery"), "-A", "proj", *args],
        cwd=ROOT,
        env=full_env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_until(cond: Any, timeout: float, what: str, procs: list[tuple[str, Any, Path]]) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for name, proc, log in procs:
            if proc.poll() is not None:
                raise SystemExit(
                    f"{name} exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def commit_events(n: int, rate: float, tag: str) -> dict[str, float]:
    """Commit `n` transactions of one outbox event each; return key → commit time (epoch s)."""
    import outbox
    from proj import db

    committed: dict[str, float] = {}
    for i in range(n):
        key = f"{tag}-{i}"
        with db.transaction() as s:
            outbox.add(s, "demo", key, {"title": f"bench {i}", "parts": 1})
        committed[key] = time.time()
        time.sleep(random.expovariate(rate))
    return committed


def collect(
    committed: dict[str, float], timeout: float, procs: list[tuple[str, Any, Path]]
) -> dict[str, Any]:
    """Wait until every run started; return latency percentiles in milliseconds."""
    import psycopg

    keys = list(committed)
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:

        def rows() -> list[tuple[Any, ...]]:
            return conn.execute(
                "SELECT o.idempotency_key, extract(epoch FROM o.dispatched_at), "
                "extract(epoch FROM r.started_at) FROM outbox.outbox_event o "
                "LEFT JOIN engine.task_run r ON r.kind = o.kind AND r.idempotency_key = o.idempotency_key "
                "WHERE o.idempotency_key = ANY(%s)",
                (keys,),
            ).fetchall()

        wait_until(
            lambda: sum(1 for r in rows() if r[2] is not None) == len(keys), timeout, "runs to start", procs
        )
        data = rows()
    dispatched = sorted((float(r[1]) - committed[r[0]]) * 1000 for r in data)
    started = sorted((float(r[2]) - committed[r[0]]) * 1000 for r in data)
    return {"events": len(keys), "dispatched_ms": summary(dispatched), "started_ms": summary(started)}


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "p50": round(statistics.median(values), 1),
        "p99": round(q[98], 1),
        "mean": round(statistics.fmean(values), 1),
        "max": round(max(values), 1),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = configure_env(args)
    recreate_database(args.pg_admin, args.db)
    import redis

    from proj.cli import migrate_to_head

    migrate_to_head()
    redis.Redis.from_url(args.broker).flushdb()

    import proj.celery  # noqa: F401  installs the outbox nudge in this process
    from outbox import nudge

    tmp = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    worker_log, beat_log = tmp / "worker.log", tmp / "beat.log"
    worker = spawn(worker_args("outbox-bench", args.concurrency, "INFO"), env, worker_log)
    beat = spawn(["beat", "--loglevel", "WARNING", "-s", str(tmp / "beat-schedule")], env, beat_log)
    procs = [("worker", worker, worker_log), ("beat", beat, beat_log)]
    results: dict[str, Any] = {
        "events_per_mode": args.events,
        "rate_per_s": args.rate,
        "beat_interval_s": args.beat_interval,
        "worker_concurrency": args.concurrency,
    }
    try:
        wait_until(lambda: b" ready." in worker_log.read_bytes(), 60, "the worker", procs)
        tag = uuid.uuid4().hex[:8]
        collect(commit_events(args.warmup, args.rate, f"{tag}-warm"), 60, procs)
        installed = nudge.current()
        try:
            for mode in ("nudge", "beat"):
                nudge.restore_nudger(installed if mode == "nudge" else None)
                committed = commit_events(args.events, args.rate, f"{tag}-{mode}")
                results[mode] = collect(committed, 60, procs)
        finally:
            nudge.restore_nudger(installed)
    finally:
        stop(worker)
        stop(beat)

    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"outbox latency, {args.events} events per mode at ~{args.rate:g}/s, beat every "
        f"{args.beat_interval:g}s, worker -c {args.concurrency}"
    )
    print(f"{'mode':<6} {'to':<11} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'max ms':>8}")
    for mode in ("nudge", "beat"):
        for what, label in (("dispatched_ms", "dispatched"), ("started_ms", "run started")):
            s = results[mode][what]
            print(
                f"{mode:<6} {label:<11} {s['p50']:>8.1f} {s['p99']:>8.1f} {s['mean']:>8.1f} {s['max']:>8.1f}"
            )


if __name__ == "__main__":
    main()
