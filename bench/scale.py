"""Throughput with empty tables vs 100,000 finished runs and 10,000 parked runs; sweeper plans.

    .venv/bin/python -m bench.scale [--runs 200] [--rounds 3] [--finished 100000] [--parked 10000] [--json]

Two databases side by side, so both are measured alternately in one invocation:

- `proj_bench_scale_empty`: migrated, nothing in it;
- `proj_bench_scale_big`: migrated, then `--finished` finished runs of a 5-step kind (97 %
  succeeded, 2 % failed, 1 % canceled; every step with its `step_attempt` row, created over the
  last ~23 days) and `--parked` runs parked on distinct topics (run `waiting`, wait step
  `waiting`, `wait_until` 30 days away, a `parked` attempt row), inserted with
  `INSERT … SELECT generate_series`, then `VACUUM ANALYZE`.

Each database has its own worker (`celery -A proj worker -P prefork -c 2 -O fair`, as
bench/throughput.py) and beat (sweeper every 1 s, so the sweeper's cost at scale is part of the
figure) on its own Redis db (4 and 6). The side not being measured is frozen (SIGSTOP on its
process groups) so it takes no CPU. A round is bench/throughput.py's `ours` round, imported
(`bench.throughput.Bench`: N `noop5` runs × 5 no-op steps, from the first submission to the
poll that sees all N succeeded), run in a child process pointed at that side's database and
broker, after an unmeasured warm-up; between rounds only the `noop5` runs are deleted (the
filler stays). Order: empty, big, empty, big, …; figures are medians. Target: ≤ 10 % drop.

Then `EXPLAIN (ANALYZE, BUFFERS)` of the sweeper's statements on the big database, captured
from a real `proj.engine.sweeper.sweep()` call (so they are exactly the shipped SQL), plus the
signal wake (`runs.signal`), each in a rolled-back transaction; any `Seq Scan` on `step`,
`task_run` or `step_attempt` is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    PG_ADMIN,
    ROOT,
    broker_db,
    machine,
    machine_line,
    print_report,
    recreate_database,
    service_env,
    set_env,
)
from bench.common import beat as start_beat
from bench.common import worker as start_worker

EMPTY, BIG = "empty", "big"
BIG_TABLES = ("step", "task_run", "step_attempt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200, help="noop5 runs per measured round")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per side (alternating)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured runs before each round")
    p.add_argument(
        "--no-analyze",
        dest="analyze",
        action="store_false",
        help="skip the untimed ANALYZE of the engine tables after each warm-up",
    )
    p.add_argument("--finished", type=int, default=100_000, help="finished runs in the big database")
    p.add_argument("--parked", type=int, default=10_000, help="parked runs in the big database")
    p.add_argument("--concurrency", type=int, default=2, help="prefork worker processes per side")
    p.add_argument("--db-prefix", default="proj_bench_scale", help="databases <prefix>_empty, <prefix>_big")
    p.add_argument("--pg-admin", default=PG_ADMIN)
    p.add_argument("--broker-empty", default="redis://127.0.0.1:6379/4")
    p.add_argument("--broker-big", default="redis://127.0.0.1:6379/6")
    p.add_argument("--timeout", type=float, default=90.0, help="per-round timeout, seconds")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    # internal: one measured round in a child process (its settings point at one side)
    p.add_argument("--measure", choices=(EMPTY, BIG), help=argparse.SUPPRESS)
    p.add_argument("--worker-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-log", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def side_env(args: argparse.Namespace, side: str) -> dict[str, str]:
    broker = args.broker_empty if side == EMPTY else args.broker_big
    return service_env(args, db=f"{args.db_prefix}_{side}", broker=broker)


# --------------------------------------------------------------------------------------------
# filling the big database

FILL_FINISHED = """
INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status,
       current_stage, current_step, result, last_error, cancel_requested_at, cancel_reason,
       available_at, created_at, updated_at, started_at, finished_at)
SELECT md5('fin-' || g)::uuid, 'filler', 1, 'fin-' || g, jsonb_build_object('i', g), md5('in-' || g),
       CASE WHEN mod(g, 100) = 0 THEN 'canceled' WHEN mod(g, 50) = 1 THEN 'failed' ELSE 'succeeded' END,
       CASE WHEN mod(g, 100) = 0 THEN 3 WHEN mod(g, 50) = 1 THEN 4 ELSE 5 END,
       NULL,
       CASE WHEN mod(g, 100) <> 0 AND mod(g, 50) <> 1 THEN '{"ok": true}'::jsonb END,
       CASE WHEN mod(g, 50) = 1 THEN '{"type": "RuntimeError", "message": "bench", "step": "s5"}'::jsonb END,
       CASE WHEN mod(g, 100) = 0 THEN t + interval '3 s' END,
       CASE WHEN mod(g, 100) = 0 THEN 'bench' END,
       t, t, t + interval '5 s', t, t + interval '5 s'
  FROM generate_series(1, %(n)s) g, LATERAL (SELECT now() - g * interval '20 s' AS t) x
"""
FILL_FINISHED_STEPS = """
INSERT INTO engine.step (run_id, stage, name, item_index, status, attempts, max_attempts,
       next_attempt_at, published_at, result, error, created_at, started_at, finished_at)
SELECT md5('fin-' || g)::uuid, st, 's' || (st + 1), 0, x.status,
       CASE x.status WHEN 'failed' THEN 3 WHEN 'canceled' THEN 0 ELSE 1 END, 3,
       t + st * interval '1 s', t + st * interval '1 s',
       CASE WHEN x.status = 'succeeded' THEN '{"ok": true}'::jsonb END,
       CASE WHEN x.status = 'failed' THEN '{"type": "RuntimeError", "message": "bench"}'::jsonb END,
       t + st * interval '1 s', t + st * interval '1 s', t + (st + 1) * interval '1 s'
  FROM generate_series(1, %(n)s) g CROSS JOIN generate_series(0, 4) st,
       LATERAL (SELECT now() - g * interval '20 s' AS t,
                       CASE WHEN mod(g, 100) = 0 AND st >= 3 THEN 'canceled'
                            WHEN mod(g, 50) = 1 AND st = 4 THEN 'failed'
                            ELSE 'succeeded' END AS status) x
"""
FILL_FINISHED_ATTEMPTS = """
INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker, outcome, error, started_at, ended_at)
SELECT s.id, a, gen_random_uuid(), 'bench:0',
       CASE WHEN s.status = 'failed' AND a = s.attempts THEN 'failed'
            WHEN s.status = 'failed' THEN 'retry' ELSE 'succeeded' END,
       s.error, s.started_at, s.finished_at
  FROM engine.step s CROSS JOIN LATERAL generate_series(1, s.attempts) a
 WHERE s.run_id IN (SELECT id FROM engine.task_run WHERE kind = 'filler')
"""
FILL_PARKED = """
INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status,
       current_stage, current_step, available_at, created_at, updated_at, started_at)
SELECT md5('park-' || g)::uuid, 'gate', 1, 'park-' || g,
       jsonb_build_object('topic', 'park:' || g, 'timeout_s', 2592000.0), md5('pin-' || g), 'waiting',
       0, 'open', t, t, t, t
  FROM generate_series(1, %(n)s) g, LATERAL (SELECT now() - g * interval '1 s' AS t) x
"""
FILL_PARKED_STEPS = """
INSERT INTO engine.step (run_id, stage, name, item_index, status, attempts, max_attempts,
       next_attempt_at, published_at, wait_topic, wait_since, wait_until, wakeups, created_at, started_at)
SELECT md5('park-' || g)::uuid, 0, 'open', 0, 'waiting', 0, 3, t, NULL, 'park:' || g, t,
       now() + interval '30 days', 1, t, t
  FROM generate_series(1, %(n)s) g, LATERAL (SELECT now() - g * interval '1 s' AS t) x
"""
FILL_PARKED_ATTEMPTS = """
INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker, outcome, started_at, ended_at)
SELECT s.id, 1, gen_random_uuid(), 'bench:0', 'parked', s.started_at, s.started_at
  FROM engine.step s WHERE s.status = 'waiting'
"""


def fill(url: str, finished: int, parked: int) -> dict[str, Any]:
    import psycopg

    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.transaction():
            for q, n in (
                (FILL_FINISHED, finished),
                (FILL_FINISHED_STEPS, finished),
                (FILL_FINISHED_ATTEMPTS, None),
                (FILL_PARKED, parked),
                (FILL_PARKED_STEPS, parked),
                (FILL_PARKED_ATTEMPTS, None),
            ):
                conn.execute(q, {"n": n} if n is not None else None)
        t1 = time.perf_counter()
        conn.execute("VACUUM (ANALYZE) engine.task_run, engine.step, engine.step_attempt, engine.task_signal")
        t2 = time.perf_counter()
        counts = {
            t: conn.execute(f"SELECT count(*) FROM engine.{t}").fetchone()[0]
            for t in ("task_run", "step", "step_attempt")
        }
        sizes = {
            t: conn.execute(f"SELECT pg_size_pretty(pg_total_relation_size('engine.{t}'))").fetchone()[0]
            for t in ("task_run", "step", "step_attempt")
        }
    return {"insert_s": t1 - t0, "vacuum_analyze_s": t2 - t1, "rows": counts, "sizes": sizes}


# --------------------------------------------------------------------------------------------
# one measured round (child process)


def measure(args: argparse.Namespace) -> int:
    """Child: warm up, then one `ours` round of bench.throughput against this side."""
    from types import SimpleNamespace

    set_env(side_env(args, args.measure))
    from bench.throughput import Bench

    class ScaleBench(Bench):
        def reset_ours(self) -> None:  # keep the filler: delete only the benchmark's runs
            self.pg.execute("DELETE FROM engine.task_run WHERE kind = 'noop5'")

    # what Bench needs of bench.throughput.Worker: its pid (CPU accounting), log and check()
    def check() -> None:  # gone, or a zombie not yet reaped by the driver
        try:
            state = Path(f"/proc/{args.worker_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "X"
        if state in ("Z", "X"):
            raise SystemExit(f"worker {args.worker_pid} died")

    worker = SimpleNamespace(
        proc=SimpleNamespace(pid=args.worker_pid), log=Path(args.worker_log), check=check
    )
    bench_args = SimpleNamespace(broker=os.environ["BROKER_URL"], timeout=args.timeout)
    bench = ScaleBench(bench_args, worker)
    bench.run("ours", args.warmup)
    if args.analyze:
        # Table statistics as a live system has them (autovacuum re-analyzes after 10 % of a table
        # changed): this machine's Postgres runs with autovacuum off, and the empty side would
        # otherwise be planned with "0 rows" statistics while it holds thousands of dead rows.
        bench.pg.execute("ANALYZE engine.task_run, engine.step, engine.step_attempt")
    result = bench.run("ours", args.runs)
    bench.reset_ours()
    print(json.dumps(result))
    return 0


def run_child(args: argparse.Namespace, side: str, worker: Any) -> dict[str, Any] | None:
    cmd = [
        sys.executable,
        "-m",
        "bench.scale",
        "--measure",
        side,
        "--worker-pid",
        str(worker.pid),
        "--worker-log",
        str(worker.log),
        "--runs",
        str(args.runs),
        "--warmup",
        str(args.warmup),
        "--db-prefix",
        args.db_prefix,
        "--pg-admin",
        args.pg_admin,
        "--broker-empty",
        args.broker_empty,
        "--broker-big",
        args.broker_big,
        "--timeout",
        str(args.timeout),
        "--concurrency",
        str(args.concurrency),
        *([] if args.analyze else ["--no-analyze"]),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, timeout=600)
    if out.returncode != 0:
        print(f"{side} round failed ({out.returncode})", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# plans of the sweeper's statements on the big database


def capture_statements() -> list[tuple[str, str, Any]]:
    """Run one real sweep (and one signal) with a statement listener: (label, sql, params)."""
    from sqlalchemy import event

    from proj import db
    from proj.engine import runs
    from proj.engine.sweeper import sweep

    engine = db.get_engine()
    seen: list[tuple[str, str, Any]] = []
    label = ["sweep"]

    def listen(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        seen.append((label[0], statement, params))

    event.listen(engine, "before_cursor_execute", listen)
    try:
        for _ in range(20):  # skipped while another sweep holds the advisory lock
            seen.clear()
            if not sweep().skipped:
                break
            time.sleep(0.2)
        label[0] = "signal"
        runs.signal("bench-scale:nobody-waits")
    finally:
        event.remove(engine, "before_cursor_execute", listen)
    return seen


def name_statement(label: str, sql: str) -> str | None:
    s = " ".join(sql.split())
    if "pg_try_advisory_xact_lock" in s or "pg_advisory_xact_lock" in s or s.startswith("select pg_"):
        return None
    if label == "signal":
        if s.startswith("INSERT INTO engine.task_signal"):
            return "signal: store"
        if "s.wait_topic =" in s:
            return "signal: wake parked steps on the topic (runs.wake)"
        return None
    if "lease_until < now()" in s:
        return "sweep: expired leases"
    if "wait_until <= now()" in s:
        return "sweep: waiting timers due (runs.wake)"
    if "cancel_requested_at IS NOT NULL" in s and s.startswith("SELECT"):
        return "sweep: cancel scan"
    if "p.status = 'pending'" in s:
        return "sweep: due steps to (re)publish"
    if s.startswith("UPDATE engine.task_run SET status = 'running'"):
        return None  # only runs when something woke
    return "sweep: " + s[:60]


def explain_all(url: str) -> list[dict[str, Any]]:
    from sqlalchemy import create_engine

    from proj.settings import sqlalchemy_url

    statements = capture_statements()
    engine = create_engine(sqlalchemy_url(url))
    out: list[dict[str, Any]] = []
    try:
        for label, sql, params in statements:
            name = name_statement(label, sql)
            if name is None:
                continue
            with engine.connect() as conn:
                trans = conn.begin()
                try:
                    rows = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + sql, params).fetchall()
                finally:
                    trans.rollback()  # EXPLAIN ANALYZE of an UPDATE runs it: undo
            plan = "\n".join(r[0] for r in rows)
            seq = sorted({m for m in re.findall(r"Seq Scan on (\w+)", plan) if m in BIG_TABLES})
            ms = re.search(r"Execution Time: ([\d.]+) ms", plan)
            out.append(
                {
                    "statement": name,
                    "sql": " ".join(sql.split()),
                    "plan": plan,
                    "seq_scans_on_big_tables": seq,
                    "indexes": sorted(
                        set(re.findall(r"Index (?:Only )?Scan (?:Backward )?using (\w+)", plan))
                    ),
                    "execution_ms": float(ms.group(1)) if ms else None,
                }
            )
    finally:
        engine.dispose()
    return out


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure:
        return measure(args)
    envs = {side: side_env(args, side) for side in (EMPTY, BIG)}
    set_env(envs[BIG])  # this process' `proj` (plans, sweep capture) talks to the big database
    import psycopg
    from alembic import command

    from bench.latency_kinds import BENCHKIT_DDL
    from proj.engine.preflight import alembic_config
    from proj.settings import sqlalchemy_url

    fills: dict[str, Any] = {}
    for side, env in envs.items():
        recreate_database(args.pg_admin, f"{args.db_prefix}_{side}")
        command.upgrade(alembic_config(sqlalchemy_url(env["DATABASE_URL"])), "head")
        with psycopg.connect(env["DATABASE_URL"], autocommit=True) as conn:
            conn.execute(BENCHKIT_DDL)
            conn.execute("ANALYZE")
    log = None if args.json else sys.stderr
    if log:
        print(f"filling {args.db_prefix}_big: {args.finished} finished + {args.parked} parked …", file=log)
    fills[BIG] = fill(envs[BIG]["DATABASE_URL"], args.finished, args.parked)
    if log:
        print(f"  {json.dumps(fills[BIG])}", file=log)

    logdir = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    procs: dict[str, list[Any]] = {}
    rounds: list[dict[str, Any]] = []
    with broker_db(args.broker_empty, "bench.scale"), broker_db(args.broker_big, "bench.scale"):
        try:
            for side, env in envs.items():
                w = start_worker(f"scale-{side}", env, logdir, concurrency=args.concurrency)
                procs[side] = [w, start_beat(f"beat-{side}", env, logdir)]
            for side in procs:
                procs[side][0].wait_ready()
                for p in procs[side]:
                    p.signal(signal.SIGSTOP)
            for i in range(args.rounds):
                for side in (EMPTY, BIG):
                    for p in procs[side]:
                        p.signal(signal.SIGCONT)
                    time.sleep(1.0)
                    r = None
                    for _ in range(3):
                        r = run_child(args, side, procs[side][0])
                        if r is not None:
                            break
                        # A Redis restart (other sessions' fault tests) can kill a Celery process
                        # (kombu reconnect bug); start what died and run the round again.
                        dead = [p for p in procs[side] if not p.alive()]
                        if not dead:
                            raise SystemExit(f"{side} round failed; worker log: {procs[side][0].log}")
                        print(f"{side}: {', '.join(p.name for p in dead)} died; restarting", file=sys.stderr)
                        for p in dead:
                            p.start()
                        procs[side][0].wait_ready()
                    for p in procs[side]:
                        p.check()
                        p.signal(signal.SIGSTOP)
                    if r is None:
                        raise SystemExit(f"{side} round failed three times")
                    r.update(round=i + 1, side=side)
                    rounds.append(r)
                    if log:
                        print(f"round {i + 1} {side:<5} {r['steps_per_s']:.1f} steps/s", file=log)
            plans = explain_all(envs[BIG]["DATABASE_URL"])  # big side frozen: no concurrent sweep
        finally:
            for ps in procs.values():
                for p in ps:
                    p.stop()

    med = {
        side: {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rounds if r["side"] == side),
            "service_cpu_ms_per_step": statistics.median(
                sum(
                    r["cpu_ms_per_step"][g]
                    for g in ("worker main", "worker children", "postgres backends", "postgres aux")
                )
                for r in rounds
                if r["side"] == side
            ),
            "postgres_backends_ms_per_step": statistics.median(
                r["cpu_ms_per_step"]["postgres backends"] for r in rounds if r["side"] == side
            ),
        }
        for side in (EMPTY, BIG)
    }
    ratio = med[BIG]["steps_per_s"] / med[EMPTY]["steps_per_s"]
    # each big round over the empty round just before it: slow drifts of the machine's load cancel
    pairs = [
        b["steps_per_s"] / e["steps_per_s"]
        for e, b in zip(rounds[0::2], rounds[1::2], strict=True)
        if e["side"] == EMPTY and b["side"] == BIG
    ]
    report = {
        "config": {
            "runs": args.runs,
            "steps_per_run": 5,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "finished": args.finished,
            "parked": args.parked,
            "worker": f"celery worker -P prefork -c {args.concurrency} -O fair + beat (sweep 1 s) per side",
        },
        "machine": machine(envs[BIG]["DATABASE_URL"]),
        "fill": fills[BIG],
        "rounds": rounds,
        "median": med,
        "ratio_big_over_empty": ratio,
        "pair_ratios": pairs,
        "median_pair_ratio": statistics.median(pairs),
        "drop_pct": 100.0 * (1.0 - statistics.median(pairs)),
        "cpu_ratio_empty_over_big": med[EMPTY]["service_cpu_ms_per_step"]
        / med[BIG]["service_cpu_ms_per_step"],
        "plans": plans,
        "seq_scans": {
            p["statement"]: p["seq_scans_on_big_tables"] for p in plans if p["seq_scans_on_big_tables"]
        },
    }
    print_report(report, args.json, print_table)
    return 0


def print_table(report: dict[str, Any]) -> None:
    cfg, f = report["config"], report["fill"]
    print(
        f"{cfg['runs']} runs x 5 no-op steps per round, {cfg['rounds']} rounds per side, alternating; "
        f"{cfg['worker']}"
    )
    print(machine_line(report["machine"]))
    print(
        f"big: {f['rows']['task_run']} runs, {f['rows']['step']} steps, {f['rows']['step_attempt']} "
        f"attempts ({cfg['finished']} finished + {cfg['parked']} parked; task_run {f['sizes']['task_run']}, "
        f"step {f['sizes']['step']}, step_attempt {f['sizes']['step_attempt']}); inserted in "
        f"{f['insert_s']:.1f}s, VACUUM ANALYZE {f['vacuum_analyze_s']:.1f}s"
    )
    print()
    print(
        f"{'round':<7}{'side':<7}{'seconds':>9}{'steps/s':>10}{'runs/s':>9}{'service CPU ms/step':>22}"
        f"{'others ms/step':>16}"
    )
    for r in report["rounds"]:
        cpu = sum(
            r["cpu_ms_per_step"][g]
            for g in ("worker main", "worker children", "postgres backends", "postgres aux")
        )
        print(
            f"{r['round']:<7}{r['side']:<7}{r['seconds']:>9.2f}{r['steps_per_s']:>10.1f}"
            f"{r['runs_per_s']:>9.1f}{cpu:>22.2f}{r['cpu_ms_per_step']['other']:>16.2f}"
        )
    for side in (EMPTY, BIG):
        m = report["median"][side]
        print(
            f"{'median':<7}{side:<7}{'':>9}{m['steps_per_s']:>10.1f}{'':>9}{m['service_cpu_ms_per_step']:>22.2f}"
        )
    print()
    print(
        f"ratio big/empty: median of the per-round pairs {report['median_pair_ratio']:.2f} "
        f"({', '.join(f'{x:.2f}' for x in report['pair_ratios'])}), of the medians "
        f"{report['ratio_big_over_empty']:.2f}; drop {report['drop_pct']:.1f} % (target <= 10 %: "
        f"{'met' if report['drop_pct'] <= 10 else 'NOT met'}); CPU cost ratio (worker + postgres CPU per "
        f"step, empty/big) = {report['cpu_ratio_empty_over_big']:.2f}"
    )
    print(
        "  ('others ms/step' is CPU used by the rest of the machine: a round where it is high was "
        "disturbed and its rate is pessimistic)"
    )
    print()
    print("EXPLAIN (ANALYZE, BUFFERS) on the big database (statements captured from sweep() and signal()):")
    for p in report["plans"]:
        verdict = (
            "SEQ SCAN on " + ", ".join(p["seq_scans_on_big_tables"])
            if p["seq_scans_on_big_tables"]
            else "no seq scan on the big tables"
        )
        print()
        print(
            f"== {p['statement']}: {verdict}; indexes {', '.join(p['indexes']) or '-'}; "
            f"{p['execution_ms']} ms"
        )
        for line in p["plan"].splitlines():
            print("   " + line)


if __name__ == "__main__":
    raise SystemExit(main())
