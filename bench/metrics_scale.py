"""`/metrics` at 1M finished runs: the scrape's time and the plan of every statement it runs.

    .venv/bin/python -m bench.metrics_scale [--runs 1000000] [--steps 3] [--scrapes 5] [--json]

Fills `proj_bench_metrics` (dropped and recreated, migrated to head) with `INSERT … SELECT
generate_series`, in one transaction:

- `--runs` finished runs of three kinds over the last ~29 days (97 % succeeded, 2 % failed,
  1 % canceled), each with `--steps` succeeded steps of varied durations;
- live work: 2,000 runs parked on a wait, 500 pending, 100 running (lease in the future);
- 10,000 of the finished runs' first steps woken by a signal (`signalled_at`, one attempt after);
- the outbox: one dispatched event per finished run, 50 pending, 10 dead.

Then `VACUUM (ANALYZE)`, and prints: the median wall time of `--scrapes` real scrapes
(`proj.admin.metrics.read_snapshot`, the code `/metrics` runs, with its bounded connection), and
per statement its median time and `EXPLAIN (ANALYZE, BUFFERS)`. A fast statement (read at
every scrape) whose plan has a `Seq Scan` on a big table is flagged and the exit code is 1;
the slow ones (the history, read in the background) are timed as one `read_history`.
Figures and plans: `bench/README.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any

from bench.common import PG_ADMIN, db_url, machine, machine_line, recreate_database

DB = "proj_bench_metrics"
BIG_TABLES = ("task_run", "step", "step_attempt", "outbox_event")
TABLES = ("engine.task_run", "engine.step", "engine.step_attempt", "outbox.outbox_event")

FILL_RUNS = """
INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status,
       current_stage, result, last_error, created_at, updated_at, started_at, finished_at)
SELECT md5('fin-' || g)::uuid, (ARRAY['acquire', 'import', 'notify'])[1 + mod(g, 3)], 1, 'fin-' || g,
       jsonb_build_object('i', g), md5('in-' || g),
       CASE WHEN mod(g, 100) = 0 THEN 'canceled' WHEN mod(g, 50) = 1 THEN 'failed' ELSE 'succeeded' END,
       %(steps)s, '{"ok": true}'::jsonb,
       CASE WHEN mod(g, 50) = 1 THEN '{"type": "RuntimeError", "message": "bench"}'::jsonb END,
       t, t, t, t + interval '2 s'
  FROM generate_series(1, %(n)s) g, LATERAL (SELECT now() - g * interval '2.5 s' AS t) x
"""
FILL_STEPS = """
INSERT INTO engine.step (run_id, stage, name, item_index, status, attempts, max_attempts,
       next_attempt_at, published_at, result, created_at, started_at, finished_at)
SELECT md5('fin-' || g)::uuid, st, 's' || (st + 1), 0, 'succeeded', 1, 3, t, t, '{"ok": true}'::jsonb,
       t, t, t + (0.005 + mod(g * 7 + st * 13, 1000) / 400.0) * interval '1 s'
  FROM generate_series(1, %(n)s) g CROSS JOIN generate_series(0, %(steps)s - 1) st,
       LATERAL (SELECT now() - g * interval '2.5 s' AS t) x
"""
FILL_SIGNALLED = """
WITH woken AS (
    UPDATE engine.step s SET signalled_at = s.started_at, wakeups = 1
     WHERE s.stage = 0 AND s.run_id IN (SELECT md5('fin-' || g)::uuid FROM generate_series(1, %(n)s) g)
 RETURNING s.id, s.started_at
)
INSERT INTO engine.step_attempt (step_id, attempt, lease_token, worker, outcome, started_at, ended_at)
SELECT id, 1, gen_random_uuid(), 'bench:0', 'succeeded',
       started_at + (0.004 + mod(id, 50) / 1000.0) * interval '1 s', started_at + interval '1 s'
  FROM woken
"""
FILL_LIVE = """
WITH runs AS (
    INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status,
           current_stage, created_at, updated_at, started_at)
    SELECT md5('live-' || g)::uuid, 'acquire', 1, 'live-' || g, '{}'::jsonb, 'h',
           CASE WHEN g <= 2000 THEN 'waiting' WHEN g <= 2500 THEN 'pending' ELSE 'running' END,
           0, now(), now(), now()
      FROM generate_series(1, 2600) g
    RETURNING id, status
)
INSERT INTO engine.step (run_id, stage, name, status, max_attempts, wait_topic, wait_until,
       wait_since, wakeups, lease_token, lease_until, attempts, started_at)
SELECT id, 0, 'approval', status, 5,
       CASE WHEN status = 'waiting' THEN 'approval:' || id END,
       CASE WHEN status = 'waiting' THEN now() + interval '1 day' END,
       CASE WHEN status = 'waiting' THEN now() END,
       CASE WHEN status = 'waiting' THEN 1 ELSE 0 END,
       CASE WHEN status = 'running' THEN gen_random_uuid() END,
       CASE WHEN status = 'running' THEN now() + interval '1 hour' END,
       CASE WHEN status = 'running' THEN 1 ELSE 0 END,
       CASE WHEN status <> 'pending' THEN now() END
  FROM runs
"""
FILL_OUTBOX = """
INSERT INTO outbox.outbox_event (kind, idempotency_key, payload, status, attempts, created_at,
       dispatched_at, next_attempt_at)
SELECT 'acquire', 'ev-' || g, '{}'::jsonb,
       CASE WHEN g <= %(n)s THEN 'dispatched' WHEN g <= %(n)s + 50 THEN 'pending' ELSE 'dead' END,
       1, now() - (g - %(n)s) * interval '1 s', CASE WHEN g <= %(n)s THEN now() END, now()
  FROM generate_series(1, %(n)s + 60) g
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=3, help="succeeded steps per finished run")
    p.add_argument("--scrapes", type=int, default=5)
    p.add_argument("--db", default=DB)
    p.add_argument("--pg-admin", default=PG_ADMIN)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def fill(url: str, runs: int, steps: int) -> dict[str, Any]:
    """The filler in one transaction, then VACUUM (ANALYZE): visibility map set, statistics fresh."""
    import psycopg

    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for table in TABLES:  # an autovacuum ANALYZE racing our VACUUM would keep the VM unset
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        with conn.transaction():
            conn.execute(FILL_RUNS, {"n": runs, "steps": steps})
            conn.execute(FILL_STEPS, {"n": runs, "steps": steps})
            conn.execute(FILL_SIGNALLED, {"n": min(10_000, runs)})
            conn.execute(FILL_LIVE)
            conn.execute(FILL_OUTBOX, {"n": runs})
        t1 = time.perf_counter()
        vacuum_until_visible(conn)
        t2 = time.perf_counter()
        for table in TABLES:
            conn.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")
        rows = {
            t: conn.execute(f"SELECT count(*) FROM {schema}.{t}").fetchone()[0]
            for schema, t in (("engine", "task_run"), ("engine", "step"), ("engine", "step_attempt"),
                              ("outbox", "outbox_event"))
        }  # fmt: skip
    return {"insert_s": round(t1 - t0, 1), "vacuum_analyze_s": round(t2 - t1, 1), "rows": rows}


def vacuum_until_visible(conn: Any, tries: int = 10) -> None:
    """VACUUM (ANALYZE) until the visibility map covers the tables, as autovacuum keeps it for
    old finished rows in production (a snapshot held elsewhere in this database, e.g. by a
    concurrent ANALYZE, stops VACUUM from marking pages all-visible)."""
    for _ in range(tries):
        conn.execute("VACUUM (ANALYZE) " + ", ".join(TABLES))
        row = conn.execute(
            "SELECT min(relallvisible::float8 / greatest(relpages, 1)) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname || '.' || c.relname = ANY(%s)",
            (list(TABLES),),
        ).fetchone()
        if row[0] >= 0.99:
            return
        time.sleep(1)
    print("warning: visibility map still incomplete after VACUUM", file=sys.stderr)


def statements() -> dict[str, tuple[Any, dict[str, Any], bool]]:
    """What a scrape runs (and the overview's minute chart): name → (statement, params, read at
    every scrape: True, or in the background history: False)."""
    from proj.admin import metrics
    from proj.engine.store import stats

    return {
        "proj_runs live+failed (RUN_COUNTS_LIVE)": (stats.RUN_COUNTS_LIVE, {}, True),
        "proj_steps (STEP_COUNTS)": (stats.STEP_COUNTS, {}, True),
        "proj_workers_alive (WORKERS_ALIVE)": (stats.WORKERS_ALIVE, {}, True),
        "proj_lease_recoveries_total (LEASE_RECOVERIES)": (stats.LEASE_RECOVERIES, {}, True),
        "proj_outbox_events pending/dead + oldest (OUTBOX_BACKLOG)": (metrics.OUTBOX_BACKLOG, {}, True),
        "overview: FINISHED_PER_MINUTE": (stats.FINISHED_PER_MINUTE, {}, True),
        "slow: proj_runs succeeded/canceled (RUN_COUNTS_FINISHED)": (stats.RUN_COUNTS_FINISHED, {}, False),
        "slow: proj_outbox_events dispatched (OUTBOX_DISPATCHED)": (metrics.OUTBOX_DISPATCHED, {}, False),
        "slow: proj_step_duration_seconds (STEP_DURATION_BUCKETS)": (
            stats.STEP_DURATION_BUCKETS,
            {"bounds": list(stats.STEP_DURATION_BOUNDS)},
            False,
        ),
        "slow: proj_signal_wake_seconds (SIGNAL_WAKE_BUCKETS)": (
            stats.SIGNAL_WAKE_BUCKETS,
            {"bounds": list(stats.SIGNAL_WAKE_BOUNDS)},
            False,
        ),
    }


def measure(url: str, scrapes: int) -> dict[str, Any]:
    from sqlalchemy import create_engine, text

    from proj.admin.metrics import metrics_engine, read_history, read_snapshot
    from proj.settings import get_settings

    settings = get_settings()
    bounded = metrics_engine(settings)  # the scrape's own bounds (METRICS_TIMEOUT_S, 2 s)
    slow = metrics_engine(settings, settings.metrics_slow_timeout_s)
    read_snapshot(bounded, settings)  # warm: catalog caches, shared buffers
    walls, history = [], []
    for _ in range(scrapes):
        t0 = time.perf_counter()
        read_snapshot(bounded, settings, overview=True)
        walls.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        read_history(slow)
        history.append((time.perf_counter() - t0) * 1000)
    out: dict[str, Any] = {
        "scrape_ms": {"median": round(statistics.median(walls), 1), "max": round(max(walls), 1)},
        "history_ms": {"median": round(statistics.median(history), 1), "max": round(max(history), 1)},
    }
    plain = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    per: dict[str, Any] = {}
    with plain.connect() as conn:
        for name, (stmt, params, gauge) in statements().items():
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                conn.execute(stmt, params).all()
                times.append((time.perf_counter() - t0) * 1000)
            plan = "\n".join(
                r[0] for r in conn.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + stmt.text), params)
            )
            seq = sorted({t for t in BIG_TABLES if re.search(rf"Seq Scan on {t}\b", plan)})
            per[name] = {
                "ms": round(statistics.median(times), 1),
                "gauge": gauge,
                "seq_scans": seq,
                "plan": plan,
            }
    out["statements"] = per
    return out


def table(report: dict[str, Any]) -> None:
    print(machine_line(report["machine"]))
    f = report["fill"]
    print(f"filled in {f['insert_s']} s, VACUUM ANALYZE {f['vacuum_analyze_s']} s; rows: {f['rows']}")
    s, h = report["scrape_ms"], report["history_ms"]
    print(
        f"\nscrape, fast part (read_snapshot, {report['scrapes']} runs): "
        f"median {s['median']} ms, max {s['max']} ms"
    )
    print(f"history, slow part (read_history, background): median {h['median']} ms, max {h['max']} ms\n")
    print(f"{'statement':<60} {'ms':>8}  part       seq scan on a big table")
    for name, st in report["statements"].items():
        flag = ", ".join(st["seq_scans"]) or "-"
        if st["gauge"] and st["seq_scans"]:
            flag += "  <-- GAUGE NOT INDEX-ONLY"
        print(f"{name:<60} {st['ms']:>8}  {'fast' if st['gauge'] else 'slow':<9}  {flag}")
    for name, st in report["statements"].items():
        print(f"\n--- {name}\n{st['plan']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = db_url(args.pg_admin, args.db)
    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("BROKER_URL", "redis://127.0.0.1:6379/13")
    began = time.perf_counter()
    recreate_database(args.pg_admin, args.db)
    from proj.cli import migrate_to_head
    from proj.settings import get_settings

    get_settings.cache_clear()
    migrate_to_head()
    if not args.json:
        print(f"filling {args.db}: {args.runs} finished runs × {args.steps} steps …", file=sys.stderr)
    report: dict[str, Any] = {
        "machine": machine(url),
        "scrapes": args.scrapes,
        "fill": fill(url, args.runs, args.steps),
    }
    report.update(measure(url, args.scrapes))
    report["total_s"] = round(time.perf_counter() - began, 1)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        table(report)
        print(f"\ntotal {report['total_s']} s")
    bad = [n for n, st in report["statements"].items() if st["gauge"] and st["seq_scans"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
