"""Signal → step running: latency with 1 and with 1,000 parked runs, and one topic with 1,000 waiters.

    .venv/bin/python -m bench.signal_latency [--samples 50] [--parked 1000] [--herd 1000] [--json]

One real worker (`celery -A proj worker -P prefork -c 2 -O fair`, as bench/throughput.py) and
one beat (the sweeper, every 1 s) on their own database (`proj_bench_signal`, recreated) and
Redis db 6. The kind `gate` (bench/latency_kinds.py) parks on `wait_for(topic, check=…)` where
the check reads a business row (`benchkit.gate`), like `gated` in tests/kinds.py; its next step
`after` records `clock_timestamp()` as its body starts.

A sample: open the gate row (committed), take the time, call `runs.signal(topic)` (store the
signal, wake the parked step, publish after commit), then read

- signal → the wait step re-claimed by the worker (`engine.attempt`: `started_at` of its re-check),
- signal → the next step's body running (its `benchkit.mark` row),

against the same host clock (this process' `time.time()` vs Postgres `clock_timestamp()`/`now()`
on the same machine). Phases, in this order:

1. **1 parked**: park one run, signal it, measure; `--samples` times (each alone in `waiting`).
2. **1,000 parked**: park `--parked` runs on distinct topics, then signal `--samples` of them
   one at a time (random order) and measure each.
3. **one topic, 1,000 waiters**: park `--herd` runs on one topic; one signal; time until every
   wait step was re-claimed and every `after` step started. Run once per `--herd-batches`
   value of `WAKE_BATCH` (the signalling process decides how many woken steps share a message),
   side by side in one invocation. Target (issue #17): all 1,000 `after` steps running ≤ 2.0 s.
   The last `WAKE_BATCH` runs twice: "fresh", signalled seconds after its runs parked, behind
   the dead row versions that parking them left (~20k by then: autovacuum has not come yet),
   and "settled", after `VACUUM (ANALYZE)` of the engine tables, the state of runs parked for
   longer than autovacuum's minute.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    RedisWatch,
    add_service_args,
    broker_db,
    machine,
    machine_line,
    prepare_database,
    print_report,
    service_env,
    set_env,
    summary,
    wait_until,
)
from bench.common import beat as start_beat
from bench.common import worker as start_worker


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--samples", type=int, default=50, help="signals measured per phase (1 and many parked)")
    p.add_argument("--parked", type=int, default=1000, help="parked runs on distinct topics (phase 2)")
    p.add_argument("--herd", type=int, default=1000, help="runs parked on one topic (phase 3)")
    p.add_argument(
        "--herd-batches",
        default="1,16",
        help="phase 3 once per WAKE_BATCH (steps per wake message; 1 = one message each), in turn",
    )
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork) or threads")
    p.add_argument("--pool", choices=("prefork", "threads"), default="prefork", help="the worker's pool")
    add_service_args(p, db="proj_bench_signal", broker="redis://127.0.0.1:6379/6")
    return p.parse_args(argv)


def configure_env(args: argparse.Namespace) -> dict[str, str]:
    return set_env(service_env(args))


class RedisRestarted(Exception):
    """Redis restarted (another session's fault test): queued messages are lost, redo the phase."""


class Signals:
    def __init__(self, pg: Any, procs: list[Any], broker: str) -> None:
        self.pg = pg
        self.procs = procs
        self.tag = uuid.uuid4().hex[:8]
        self.watch = RedisWatch(broker)
        self.watched_at = 0.0

    def check(self) -> bool:
        for p in self.procs:
            p.check()
        now = time.monotonic()
        if now - self.watched_at > 0.5:
            self.watched_at = now
            if self.watch.restarted():
                raise RedisRestarted()
        return False

    def phase(self, name: str, fn: Any) -> Any:
        """Run a phase; if Redis restarted meanwhile, drop its runs and run it again."""
        for _ in range(3):
            self.watch.start()
            try:
                out = fn()
                self.check()
                self.watched_at = 0.0
                self.check()
                return out
            except RedisRestarted:
                print(f"{name}: Redis restarted during the phase; running it again", file=sys.stderr)
            self.watch.start()  # waits until it is back
            time.sleep(5.0)  # the worker reconnects
            self.pg.execute("DELETE FROM engine.task_run WHERE kind = 'gate' AND status <> 'succeeded'")
        raise SystemExit("Redis kept restarting (other sessions' fault tests?): run the bench again later")

    def park(self, topics: list[str]) -> list[uuid.UUID]:
        """Enqueue one `gate` run per topic (one transaction) and wait until all are parked."""
        from proj import db
        from proj.engine import dispatch, runs

        ids, out = [], []
        with db.transaction() as s:
            for i, topic in enumerate(topics):
                ref, first = runs.insert_run(
                    s, "gate", {"topic": topic}, idempotency_key=f"{self.tag}-{topic}-{i}"
                )
                ids.append(ref.task_run_id)
                out.extend(first)
        dispatch.publish_after_commit(out)
        n = len(ids)
        wait_until(
            lambda: (
                self.check()
                or self.pg.execute(
                    "SELECT count(*) FROM engine.task_run WHERE id = ANY(%s) AND status = 'waiting'", (ids,)
                ).fetchone()[0]
                == n
            ),
            max(60.0, n / 10),
            f"{n} runs to park",
            interval=0.01 if n == 1 else 0.1,
        )
        return ids

    def fire(self, topic: str) -> tuple[float, float, int]:
        """Open the business row, then signal; returns (t0, signal call seconds, runs woken)."""
        from proj.engine import runs

        self.pg.execute(
            "INSERT INTO benchkit.gate (topic, open) VALUES (%s, true) "
            "ON CONFLICT (topic) DO UPDATE SET open = true",
            (topic,),
        )
        t0 = time.time()
        woken = runs.signal(topic)
        return t0, time.time() - t0, woken

    def times(self, run_ids: list[uuid.UUID], t0: float) -> list[tuple[float, float]]:
        """(re-claim, after-body) epoch times of the runs, once all are there.

        Polled with a count of `after` marks (an index probe per run), and the times read once
        when all are in: the detailed read costs Postgres ~0.1 s per 1,000 runs, and polled every
        0.1 s it took CPU from the very wake it measured."""
        n = len(run_ids)

        def done() -> bool:
            got = self.pg.execute(
                "SELECT count(*) FROM benchkit.mark WHERE run_id = ANY(%s) AND step = 'after'", (run_ids,)
            ).fetchone()[0]
            self.check()
            return got >= n

        poll = 0.01 if n == 1 else 0.05
        wait_until(done, max(60.0, n / 10), f"{n} runs to reach `after`", interval=poll)
        got = self.pg.execute(
            """
            SELECT extract(epoch FROM (SELECT max(a.started_at) FROM engine.step s
                     JOIN engine.attempt a ON a.step_id = s.id
                    WHERE s.run_id = r.id AND s.name = 'open')),
                   extract(epoch FROM m.at)
              FROM unnest(CAST(%s AS uuid[])) AS r(id)
              JOIN benchkit.mark m ON m.run_id = r.id AND m.step = 'after'
            """,
            (run_ids,),
        ).fetchall()
        return [(float(a) - t0, float(b) - t0) for a, b in got]

    def sample(self, topic: str, run_id: uuid.UUID) -> dict[str, float]:
        t0, call_s, woken = self.fire(topic)
        if woken != 1:
            raise SystemExit(f"signal {topic} woke {woken} runs, expected 1")
        ((reclaim, after),) = self.times([run_id], t0)
        return {"signal_call_s": call_s, "reclaimed_s": reclaim, "after_s": after}


def phase_summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    return {k: summary([s[k] * 1000 for s in samples]) for k in ("signal_call_s", "reclaimed_s", "after_s")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = configure_env(args)
    pg = prepare_database(args, env, benchkit=True)
    rng = random.Random(2)
    logdir = Path(tempfile.mkdtemp(prefix="bench-signal-"))
    report: dict[str, Any] = {
        "config": {
            "samples": args.samples,
            "parked": args.parked,
            "herd": args.herd,
            "worker": f"celery worker -P {args.pool} -c {args.concurrency} -O fair, 1 beat (sweep 1 s)",
            "db": args.db,
            "broker": args.broker,
        }
    }
    with broker_db(args.broker, "bench.signal_latency"):
        w = start_worker("signal", env, logdir, concurrency=args.concurrency, pool=args.pool)
        b = start_beat("beat", env, logdir)
        try:
            w.wait_ready()
            bench = Signals(pg, [w, b], args.broker)

            def warm_up() -> None:  # a few unmeasured samples (imports, pools, first messages)
                for i in range(3):
                    topic = f"warm:{bench.tag}:{uuid.uuid4().hex[:6]}:{i}"
                    bench.sample(topic, bench.park([topic])[0])

            bench.phase("warm-up", warm_up)

            log = sys.stderr if not args.json else None

            def one_parked() -> list[dict[str, float]]:
                out = []
                for i in range(args.samples):
                    topic = f"solo:{bench.tag}:{uuid.uuid4().hex[:6]}:{i}"
                    out.append(bench.sample(topic, bench.park([topic])[0]))
                return out

            one = bench.phase("1 parked", one_parked)
            report["one_parked"] = phase_summary(one)
            if log:
                print(f"1 parked: done {len(one)} samples", file=log)

            def many_parked() -> tuple[float, list[dict[str, float]]]:
                topics = [f"many:{bench.tag}:{uuid.uuid4().hex[:6]}:{i}" for i in range(args.parked)]
                t = time.perf_counter()
                ids = bench.park(topics)
                park_s = time.perf_counter() - t
                if log:
                    print(f"{args.parked} parked in {park_s:.1f}s", file=log)
                return park_s, [
                    bench.sample(topics[i], ids[i]) for i in rng.sample(range(args.parked), args.samples)
                ]

            report["park_many_s"], many = bench.phase(f"{args.parked} parked", many_parked)
            report["many_parked"] = phase_summary(many)
            report["many_parked"]["still_parked"] = pg.execute(
                "SELECT count(*) FROM engine.step WHERE status = 'waiting'"
            ).fetchone()[0]

            def herd(settled: bool = False) -> dict[str, Any]:
                herd_topic = f"herd:{bench.tag}:{uuid.uuid4().hex[:6]}:{os.environ['WAKE_BATCH']}"
                t = time.perf_counter()
                herd_ids = bench.park([herd_topic] * args.herd)
                park_s = time.perf_counter() - t
                if log:
                    print(f"{args.herd} parked on one topic in {park_s:.1f}s", file=log)
                if settled:
                    pg.execute("VACUUM (ANALYZE) engine.step, engine.task_run, engine.step_attempt")
                t0, call_s, woken = bench.fire(herd_topic)
                got = bench.times(herd_ids, t0)
                reclaims = [g[0] for g in got]
                afters = [g[1] for g in got]
                return {
                    "settled": settled,
                    "wake_batch": int(os.environ["WAKE_BATCH"]),
                    "waiters": args.herd,
                    "parked_in_s": park_s,
                    "woken": woken,
                    "signal_call_s": call_s,
                    "first_reclaimed_s": min(reclaims),
                    "all_reclaimed_s": max(reclaims),
                    "median_after_s": sorted(afters)[len(afters) // 2],
                    "all_after_s": max(afters),
                }

            from proj.settings import get_settings

            report["herd"] = []
            for size in [int(x) for x in args.herd_batches.split(",") if x.strip()]:
                os.environ["WAKE_BATCH"] = str(size)  # read by runs.signal in this process
                get_settings.cache_clear()
                report["herd"].append(bench.phase(f"one topic, WAKE_BATCH={size}", herd))
            report["herd"].append(bench.phase("one topic, settled", lambda: herd(settled=True)))
        finally:
            w.stop()
            b.stop()
    report["machine"] = machine(env["DATABASE_URL"])
    o, m = report["one_parked"], report["many_parked"]
    report["ratio_p50_many_over_one"] = m["after_s"]["p50"] / o["after_s"]["p50"]
    report["ratio_p99_many_over_one"] = m["after_s"]["p99"] / o["after_s"]["p99"]
    print_report(report, args.json, print_table)
    return 0


def print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"signal → step running; {cfg['worker']}; {cfg['samples']} signals per phase")
    print(machine_line(report["machine"]))
    print()
    head = "".join(f"{h:>9}" for h in ("p50 ms", "p90 ms", "p99 ms", "max ms"))
    print(f"{'parked':<8}{'from the signal() call to':<32}{head}")
    for key, label in (("one_parked", "1"), ("many_parked", str(cfg["parked"]))):
        for what, title in (
            ("signal_call_s", "signal() returned"),
            ("reclaimed_s", "wait step re-claimed"),
            ("after_s", "next step body running"),
        ):
            s = report[key][what]
            print(f"{label:<8}{title:<32}{s['p50']:>9.1f}{s['p90']:>9.1f}{s['p99']:>9.1f}{s['max']:>9.1f}")
    print(
        f"ratio {cfg['parked']} parked / 1 parked (next step running): p50 "
        f"{report['ratio_p50_many_over_one']:.2f}, p99 {report['ratio_p99_many_over_one']:.2f}"
    )
    print()
    for h in report["herd"]:
        print(
            f"one topic, {h['waiters']} waiters, WAKE_BATCH={h['wake_batch']}, "
            f"{'settled' if h['settled'] else 'fresh'} (parked in "
            f"{h['parked_in_s']:.1f}s): signal() woke {h['woken']} in {h['signal_call_s'] * 1000:.0f} ms; "
            f"first re-claim after {h['first_reclaimed_s'] * 1000:.0f} ms, all re-claimed after "
            f"{h['all_reclaimed_s']:.2f}s, all `after` steps running after {h['all_after_s']:.2f}s "
            f"(median {h['median_after_s']:.2f}s)"
        )
    fresh = [h for h in report["herd"] if not h["settled"]]
    if len(fresh) > 1:
        base, best = fresh[0], fresh[-1]
        print(
            f"all `after` running: WAKE_BATCH={best['wake_batch']} / WAKE_BATCH={base['wake_batch']} = "
            f"{best['all_after_s'] / base['all_after_s']:.2f}"
        )
    for h in report["herd"][-2:]:
        state = "settled" if h["settled"] else "fresh"
        verdict = "met" if h["all_after_s"] <= 2.0 else "NOT met"
        print(f"target (all `after` running ≤ 2.0 s), {state}: {h['all_after_s']:.2f}s, {verdict}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    raise SystemExit(main())
