"""Throughput: N runs x 5 no-op steps through the engine vs N plain Celery chains of 5 no-op tasks.

One invocation starts one real worker (`celery -A proj worker -P prefork`, or `--pool threads`),
serving both the `noop5` kind and the plain tasks of `bench.kinds`, on its own database and Redis
db, then measures plain and ours alternately and prints median rates and the ratio ours/plain.

    .venv/bin/python -m bench.throughput [--runs 200] [--concurrency 2] [--rounds 2] [--json]

Completion is observed by polling every 50 ms: `engine.task_run` succeeded count for ours, a
Redis counter INCRed by each chain's last task for plain. Both timings run from the first
message submitted to the poll that sees all N done, so they include enqueueing (ours inserts the
N runs with `enqueue_many`, one transaction and one statement, then publishes the N first steps
with one producer; plain sends the N chains with one producer).

`--floor` adds a third side, alternating with the two: plain chains whose every link also runs
two one-row statements (`bench.kinds.floor_step`), the least an engine pays per message step if
it claims each step before its body and commits it after (`bench/README.md`, session 9).

`--deliveries` logs each task the prefork children run (`bench.kinds.record_deliveries`) and
prints, per side, how long a child spends per delivery, how long it then waits for the next,
and how busy the children were (`bench/README.md`, session 11).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import (
    CLK_TCK,
    ROOT,
    VENV_BIN,
    add_service_args,
    held,
    print_report,
    proc_cpu,
    service_env,
    set_env,
    wait_for_redis,
    worker_args,
)

POLL_S = 0.05
LOCK_KEY = "bench:throughput:lock"
LOCK_TTL_S = 600
STEPS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200, help="runs (ours) and chains (plain) per round")
    p.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork) or threads")
    p.add_argument(
        "--pool",
        choices=("prefork", "threads"),
        default="prefork",
        help="the worker's pool, the same for every side (threads: one process, no child to hand each "
        "message to)",
    )
    p.add_argument("--rounds", type=int, default=2, help="measured rounds of each (alternating)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up runs/chains of each")
    add_service_args(
        p, db="proj_bench", broker="redis://127.0.0.1:6379/11", db_help="database (created if missing)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="per-round timeout, seconds")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="record the worker with py-spy (--subprocesses) during the ours rounds; "
        "writes FILE (speedscope JSON if it ends in .json, else flamegraph SVG)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run a third side, 'floor': plain chains whose every link also runs the two one-row "
        "statements of bench.kinds.floor_step, the least any engine pays that claims each step before "
        "its body and commits it after",
    )
    p.add_argument(
        "--deliveries",
        action="store_true",
        help="log every task the prefork children run and print the time per delivery, the wait "
        "between deliveries and how busy the children were (the logging costs both sides per delivery)",
    )
    p.add_argument(
        "--profile-sides",
        default="ours",
        help="which rounds --profile records: ours, plain or ours,plain (the side is then part "
        "of the file name: FILE.ours.json, FILE.plain.json)",
    )
    return p.parse_args(argv)


def configure_env(args: argparse.Namespace) -> dict[str, str]:
    """Settings are read once per process: set them before `proj` is imported (here and worker).
    Only the engine's own kinds and `bench.kinds`; no sweep interval nor periodic settings (defaults)."""
    return set_env(service_env(args, kinds="bench.kinds", sweep_s=None, quiet_periodic=False))


# --------------------------------------------------------------------------------------------
# services


def ensure_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')


class Worker:
    """One `celery -A proj worker` in its own session, so a signal reaches its children."""

    def __init__(self, concurrency: int, env: dict[str, str], log: Path, pool: str = "prefork") -> None:
        self.log = log
        full_env = {**os.environ, **env}
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "celery"), "-A", "proj", *worker_args("bench", concurrency, "WARNING", pool)],
            cwd=ROOT,
            env=full_env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def check(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise SystemExit(f"worker exited {code}:\n{self.log.read_text(errors='replace')[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


# --------------------------------------------------------------------------------------------
# where the CPU goes (Linux /proc): worker main, worker children, Postgres, Redis, this driver
# (a process' CPU is bench/common.py's `proc_cpu`; the machine's here also counts irq + softirq)


def _machine_cpu() -> tuple[float, float, float]:
    """(busy, total, irq) CPU seconds of the whole machine since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(parts[:8])
    idle = parts[3] + parts[4] + parts[7]  # idle, iowait, steal (the hypervisor's, not ours)
    irq = parts[5] + parts[6]  # irq + softirq: loopback networking is mostly here
    return (total - idle) / CLK_TCK, total / CLK_TCK, irq / CLK_TCK


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class CpuMeter:
    """CPU seconds per component over one round (a process born mid-round counts from birth)."""

    def __init__(self, worker_pid: int, pg: Any) -> None:
        self.worker_pid = worker_pid
        self.pg = pg

    def _groups(self) -> dict[str, list[int]]:
        backends = [
            int(r[0])
            for r in self.pg.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            ).fetchall()
        ]
        redis_pids, pg_aux = [], []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            comm = _comm(int(p.name))
            if comm == "redis-server":
                redis_pids.append(int(p.name))
            elif comm == "postgres" and "(" not in _cmdline(int(p.name)):
                pg_aux.append(int(p.name))  # walwriter, checkpointer, autovacuum… (not backends)
        return {
            "worker main": [self.worker_pid],
            "worker children": _children(self.worker_pid),
            "postgres backends": backends,
            "postgres aux": pg_aux,
            "redis-server": redis_pids,
            "driver": [os.getpid()],
        }

    def snapshot(self) -> dict[str, Any]:
        groups = self._groups()
        return {
            "pids": {g: {p: proc_cpu(p) for p in pids} for g, pids in groups.items()},
            "machine": _machine_cpu(),
        }

    def since(self, start: dict[str, Any]) -> dict[str, float]:
        end = self.snapshot()
        out: dict[str, float] = {}
        for group, pids in end["pids"].items():
            before = start["pids"].get(group, {})
            out[group] = sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in pids.items())
        busy, total, irq = (e - b for e, b in zip(end["machine"], start["machine"], strict=True))
        out["irq+softirq"] = irq
        out["other"] = max(0.0, busy - sum(out.values()))  # other users of the machine
        out["machine busy"] = busy
        out["machine busy %"] = 100.0 * busy / total if total else 0.0
        return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# the two sides


class RedisRestarted(Exception):
    """The broker lost its queues during a round."""


class Bench:
    def __init__(self, args: argparse.Namespace, worker: Worker) -> None:
        import psycopg
        import redis

        from bench.kinds import PLAIN_COUNTER

        self.args = args
        self.worker = worker
        self.redis = redis.Redis.from_url(args.broker)
        self.counter_key = PLAIN_COUNTER
        self.pg = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
        self.cpu = CpuMeter(worker.proc.pid, self.pg)
        # Process groups frozen while a round is submitted (`bench.dbos_compare --submit-frozen`).
        self.hold_pids: list[int] = []

    # ours ----------------------------------------------------------------------------------

    def reset_ours(self) -> None:
        self.pg.execute("TRUNCATE engine.step_attempt, engine.step, engine.task_run CASCADE")

    def ours_done(self) -> int:
        row = self.pg.execute(
            "SELECT count(*) FROM engine.task_run WHERE status = 'succeeded' AND kind = 'noop5'"
        ).fetchone()
        return int(row[0])

    def submit_ours(self, n: int) -> None:
        from proj.engine import runs

        tag = uuid.uuid4().hex
        runs.enqueue_many("noop5", [(f"{tag}-{i}", {"i": i}) for i in range(n)])

    # plain ---------------------------------------------------------------------------------

    def reset_plain(self) -> None:
        self.redis.delete(self.counter_key)

    def plain_done(self) -> int:
        return int(self.redis.get(self.counter_key) or 0)

    def submit_plain(self, n: int) -> None:
        from celery import chain

        from bench.kinds import PLAIN_QUEUE, plain_done, plain_noop
        from proj.celery import app

        with app.producer_or_acquire() as producer:
            for _ in range(n):
                sig = chain(*(plain_noop.si() for _ in range(STEPS - 1)), plain_done.si())
                sig.apply_async(queue=PLAIN_QUEUE, producer=producer)

    # floor: plain chains, and two one-row statements in each link ------------------------------

    def reset_floor(self, n: int) -> None:
        from bench.kinds import FLOOR_COUNTER, floor_reset

        floor_reset(self.pg, n * STEPS)
        self.redis.delete(FLOOR_COUNTER)

    def floor_done(self) -> int:
        from bench.kinds import FLOOR_COUNTER

        return int(self.redis.get(FLOOR_COUNTER) or 0)

    def submit_floor(self, n: int) -> None:
        from celery import chain

        from bench.kinds import PLAIN_QUEUE, floor_done, floor_link
        from proj.celery import app

        with app.producer_or_acquire() as producer:
            for i in range(n):
                rows = [i * STEPS + k for k in range(1, STEPS + 1)]
                sig = chain(*(floor_link.si(r) for r in rows[:-1]), floor_done.si(rows[-1]))
                sig.apply_async(queue=PLAIN_QUEUE, producer=producer)

    # one round -----------------------------------------------------------------------------

    def _redis_run_id(self) -> str | None:
        import redis

        try:
            return str(self.redis.info("server")["run_id"])
        except redis.exceptions.ConnectionError:
            return None

    def run(self, side: str, n: int, tries: int = 3) -> dict[str, Any]:
        """One round; again (up to `tries`) if Redis was restarted under it (some tests do that)."""
        import kombu.exceptions
        import redis

        gone = (RedisRestarted, redis.exceptions.ConnectionError, kombu.exceptions.OperationalError)
        for _ in range(tries):
            try:
                return self.round(side, n)
            except gone as exc:
                print(f"{side} round interrupted ({exc}); running it again", file=sys.stderr)
                deadline = time.monotonic() + 60
                while self._redis_run_id() is None and time.monotonic() < deadline:
                    time.sleep(0.5)
                time.sleep(2.0)  # let the worker reconnect
                self.worker.check()
        raise SystemExit(f"{side}: Redis kept going away; run the benchmark again on a quieter machine")

    def round(self, side: str, n: int) -> dict[str, Any]:
        reset, submit, done = {
            "ours": (self.reset_ours, self.submit_ours, self.ours_done),
            "plain": (self.reset_plain, self.submit_plain, self.plain_done),
            "floor": (lambda: self.reset_floor(n), self.submit_floor, self.floor_done),
        }[side]
        reset()
        wall0 = time.time()
        redis_run = self._redis_run_id()
        log_at = self.worker.log.stat().st_size
        cpu0 = self.cpu.snapshot()
        t0 = time.perf_counter()
        with held(self.hold_pids):
            submit(n)
        t_sub = time.perf_counter() - t0
        if self.hold_pids:
            t0 = time.perf_counter()  # execution alone: the clock starts when the workers thaw
        deadline = t0 + self.args.timeout
        polls = 0
        while True:
            got = done()
            if got >= n:
                break
            polls += 1
            if polls % 20 == 0 and self._redis_run_id() != redis_run:
                raise RedisRestarted("Redis restarted during the round: its queued messages are lost")
            if time.perf_counter() > deadline:
                self.worker.check()
                with self.worker.log.open("rb") as f:
                    f.seek(log_at)
                    if b"Connection to broker lost" in f.read():
                        raise RedisRestarted("the worker lost the broker during the round")
                raise SystemExit(f"{side}: only {got}/{n} done after {self.args.timeout}s")
            time.sleep(POLL_S)
        elapsed = time.perf_counter() - t0
        return {**round_result(n, elapsed, t_sub, self.cpu.since(cpu0)), "window": (wall0, time.time())}


def read_deliveries(directory: Path) -> list[list[tuple[float, float]]]:
    """Each child's deliveries (start, end), in order, from `bench.kinds.record_deliveries`' files."""
    return [
        sorted(_span(line) for line in path.read_text().splitlines() if line) for path in directory.iterdir()
    ]


def _span(line: str) -> tuple[float, float]:
    began, ended = line.split()[:2]
    return float(began), float(ended)


def delivery_stats(
    children: list[list[tuple[float, float]]], window: tuple[float, float], concurrency: int
) -> dict[str, float]:
    """Of the deliveries that began in `window`: how many, the median time a child spent in one,
    the median wait of a child between the end of one and the start of its next (its main
    process fetching and handing it the next message), and the share of the window the
    `concurrency` children spent in deliveries."""
    t0, t1 = window
    spans: list[float] = []
    gaps: list[float] = []
    for rows in children:
        mine = [(a, b) for a, b in rows if t0 <= a <= t1]
        spans.extend(b - a for a, b in mine)
        gaps.extend(nxt[0] - prev[1] for prev, nxt in zip(mine, mine[1:], strict=False))
    return {
        "deliveries": len(spans),
        "ms_per_delivery": 1000 * statistics.median(spans) if spans else 0.0,
        "ms_between": 1000 * statistics.median(gaps) if gaps else 0.0,
        "children_busy_pct": 100 * sum(spans) / (concurrency * (t1 - t0)),
    }


def wal_syncs(pg: Any) -> int:
    """WAL flushes (fsyncs) so far, by every process of the cluster (`pg_stat_wal`, Postgres 14+):
    a durable commit costs one, a claim none (`proj.engine.store.claims`, "One durable commit
    per step")."""
    return int(pg.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()[0])


def round_result(n: int, elapsed: float, t_sub: float, cpu: dict[str, float]) -> dict[str, Any]:
    """The figures of one round of `n` runs x `STEPS` steps (also bench/dbos_compare.py's DBOS side)."""
    return {
        "seconds": elapsed,
        "submit_s": t_sub,
        "runs_per_s": n / elapsed,
        "steps_per_s": n * STEPS / elapsed,
        "cpu_ms_per_step": {k: 1000.0 * v / (n * STEPS) for k, v in cpu.items() if "%" not in k},
        "machine_busy_pct": cpu["machine busy %"],
    }


# --------------------------------------------------------------------------------------------
# report


def machine() -> dict[str, Any]:
    import celery
    import kombu
    import psycopg
    import redis
    import sqlalchemy

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        pg_version = conn.execute("SHOW server_version").fetchone()[0]
    redis_version = redis.Redis.from_url(os.environ["BROKER_URL"]).info("server")["redis_version"]
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "sqlalchemy": sqlalchemy.__version__,
        "psycopg": psycopg.__version__,
        "postgres": pg_version,
        "redis": redis_version,
    }


def summarise(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for side, rs in rounds.items():
        keys = ("steps_per_s", "runs_per_s", "seconds", "submit_s", "machine_busy_pct")
        out[side] = {k: statistics.median(r[k] for r in rs) for k in keys}
        if "deliveries" in rs[0]:
            out[side]["deliveries"] = {
                k: statistics.median(r["deliveries"][k] for r in rs) for k in rs[0]["deliveries"]
            }
        out[side]["cpu_ms_per_step"] = {
            g: statistics.median(r["cpu_ms_per_step"][g] for r in rs) for g in rs[0]["cpu_ms_per_step"]
        }
    return out


SERVICE_GROUPS = ("worker main", "worker children", "postgres backends", "postgres aux", "redis-server")
NOISY_OTHER_MS = 1.0  # 'other' CPU per step above which the machine was not quiet


def service_cpu(side: dict[str, Any]) -> float:
    """CPU ms per step spent by the worker, its Postgres backends and Redis (not the driver)."""
    return sum(side["cpu_ms_per_step"][g] for g in SERVICE_GROUPS)


def target_ratio(inline_steps: int) -> float:
    """Issue #17's targets: inline mode ≥ 1.9× plain Celery (goal 4), per-message mode
    (`INLINE_STEPS=0`) ≥ 0.8× (goal 3)."""
    return 1.9 if inline_steps > 0 else 0.8


def print_table(report: dict[str, Any]) -> None:
    cfg, m = report["config"], report["machine"]
    print(
        f"{cfg['runs']} runs x {STEPS} no-op steps; worker -P {cfg['pool']} -c {cfg['concurrency']} -O fair, "
        f"prefetch multiplier {cfg['prefetch_multiplier']}; broker {cfg['broker']}; db {cfg['db']}"
    )
    print(
        f"machine: {m['nproc']} cpu ({m['cpu']}); Python {m['python']}, Celery {m['celery']}, "
        f"Postgres {m['postgres']}, Redis {m['redis']}"
    )
    print()
    print(f"{'round':<10}{'side':<7}{'seconds':>9}{'submit s':>10}{'steps/s':>10}{'runs/s':>9}")
    for r in report["rounds"]:
        print(
            f"{r['round']:<10}{r['side']:<7}{r['seconds']:>9.2f}{r['submit_s']:>10.2f}"
            f"{r['steps_per_s']:>10.1f}{r['runs_per_s']:>9.1f}"
        )
    print()
    sides = list(report["median"])
    for side in sides:
        s = report["median"][side]
        print(
            f"{'median':<10}{side:<7}{s['seconds']:>9.2f}{s['submit_s']:>10.2f}"
            f"{s['steps_per_s']:>10.1f}{s['runs_per_s']:>9.1f}"
        )
    print()
    medians = [report["median"][side] for side in sides]
    print(f"{'CPU ms per step (median of rounds)':<40}" + "".join(f"{side:>10}" for side in sides))
    for g in medians[0]["cpu_ms_per_step"]:
        print(f"  {g:<38}" + "".join(f"{m['cpu_ms_per_step'][g]:>10.2f}" for m in medians))
    print(
        f"  {'machine busy, % of ' + str(m['nproc']) + ' cpu':<38}"
        + "".join(f"{md['machine_busy_pct']:>10.0f}" for md in medians)
    )
    if report["noisy"]:
        print(
            "  WARNING: other processes were busy during the rounds ('other' above): the machine was"
            " not quiet, rates are pessimistic and the ratio noisy; run again when it is idle"
        )
    print(
        f"CPU cost ratio (worker + postgres + redis CPU per step, plain/ours) = {report['cpu_ratio']:.2f}"
        " -- what the rate ratio would be if the machine were only CPU-bound by this benchmark"
    )
    if report["wal_flushes_per_ours_step"] is None:
        print("WAL flushes per step: not measured with --floor (the floor's commits flush too)")
    else:
        print(
            f"WAL flushes per step, ours = {report['wal_flushes_per_ours_step']:.2f} -- pg_stat_wal.wal_sync"
            " over the measured rounds, the whole cluster's (plain writes nothing to Postgres)"
        )
    if "deliveries" in medians[0]:
        print(f"{'prefork children (--deliveries, median)':<40}" + "".join(f"{side:>10}" for side in sides))
        rows = (
            ("deliveries per round", "deliveries", ".0f"),
            ("ms in a delivery", "ms_per_delivery", ".2f"),
            ("ms waiting for the next delivery", "ms_between", ".2f"),
            ("children busy, % of the round", "children_busy_pct", ".0f"),
        )
        for label, key, fmt in rows:
            print(f"  {label:<38}" + "".join(f"{md['deliveries'][key]:>10{fmt}}" for md in medians))
        print("  (rates with --deliveries on pay a log line per delivery: read the shares, not the ratio)")
    print()
    target = target_ratio(report["config"]["inline_steps"])
    verdict = "met" if report["ratio"] >= target else "NOT met"
    print(f"ratio ours/plain = {report['ratio']:.2f} (target >= {target:.1f}: {verdict})")
    print(f"  round by round, each against the plain round just before it: {_ratios(report['round_ratios'])}")
    if "floor_ratio" in report:
        print(
            f"ratio floor/plain = {report['floor_ratio']:.2f}"
            f" (CPU cost ratio {report['floor_cpu_ratio']:.2f})"
            " -- plain chains whose links also claim and commit one row each: the most that an engine"
            " with a claim and a commit per message step could reach here"
        )
        print(f"  round by round: {_ratios(report['floor_round_ratios'])}")


def round_ratios(rounds: dict[str, list[dict[str, Any]]], side: str) -> list[float]:
    """`side`'s rate over plain's, round by round. Rounds alternate, so each pair ran minutes
    apart at most: a machine whose speed drifts over an invocation (plain Celery's rate moved
    by half between invocations on session 11's machine) moves both sides of a pair alike."""
    return [r["steps_per_s"] / p["steps_per_s"] for p, r in zip(rounds["plain"], rounds[side], strict=True)]


def _ratios(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values) + (
        f" (median {statistics.median(values):.2f})" if len(values) > 1 else ""
    )


def start_profiler(pid: int, out: str, seconds: float) -> subprocess.Popen[bytes]:
    fmt = "speedscope" if out.endswith(".json") else "flamegraph"
    return subprocess.Popen(
        [
            str(VENV_BIN / "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--subprocesses",
            "--format",
            fmt,
            "--output",
            out,
            "--duration",
            str(int(seconds)),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = configure_env(args)
    ensure_database(args.pg_admin, args.db)

    import redis

    import proj.celery  # noqa: F401  (the app first: it loads bench.kinds)
    from proj.cli import migrate_to_head

    migrate_to_head()
    broker = redis.Redis.from_url(args.broker)
    wait_for_redis(broker)
    # One benchmark per Redis db: a second one would flush and consume the first one's messages.
    if not broker.set(LOCK_KEY, os.getpid(), nx=True, ex=LOCK_TTL_S):
        holder = (broker.get(LOCK_KEY) or b"?").decode()
        raise SystemExit(
            f"another bench.throughput (pid {holder}) is using {args.broker}; "
            "wait for it or pass another --broker db"
        )
    broker.flushdb()
    broker.set(LOCK_KEY, os.getpid(), ex=LOCK_TTL_S)

    log = Path(tempfile.mkdtemp(prefix="bench-")) / "worker.log"
    deliveries = log.parent / "deliveries"
    if args.deliveries:
        from bench.kinds import DELIVERY_LOG

        deliveries.mkdir()
        env = {**env, DELIVERY_LOG: str(deliveries)}
    worker = Worker(args.concurrency, env, log, args.pool)
    sides = ("plain", "ours", "floor") if args.floor else ("plain", "ours")
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    flat: list[dict[str, Any]] = []
    try:
        bench = Bench(args, worker)
        # Warm-up doubles as the readiness check (at WARNING the worker prints no "ready").
        bench.args.timeout, timeout = max(args.timeout, 90.0), args.timeout
        for side in sides:
            bench.run(side, args.warmup)
        bench.args.timeout = timeout
        wal0 = wal_syncs(bench.pg)
        for i in range(args.rounds):
            for side in sides:
                prof = None
                profiled = [x.strip() for x in args.profile_sides.split(",")]
                if args.profile and side in profiled:
                    out = args.profile
                    if len(profiled) > 1:
                        out = f".{side}.".join(out.rsplit(".", 1))
                    out = out if args.rounds == 1 else f"{i}.".join(out.rsplit(".", 1))
                    prof = start_profiler(worker.proc.pid, out, args.runs * STEPS / 100 + 5)
                    time.sleep(1.0)
                r = bench.run(side, args.runs)
                if prof is not None:
                    prof.send_signal(signal.SIGINT)
                    prof.wait(30)
                rounds[side].append(r)
                flat.append({"round": f"{i + 1}", "side": side, **r})
                worker.check()
    finally:
        worker.stop()
        if broker.get(LOCK_KEY) == str(os.getpid()).encode():
            broker.delete(LOCK_KEY)
    time.sleep(1.0)  # the worker's backends report their WAL statistics as they exit
    if args.deliveries:
        children = read_deliveries(deliveries)
        for r in [*flat, *(r for side_rounds in rounds.values() for r in side_rounds)]:
            r["deliveries"] = delivery_stats(children, r["window"], args.concurrency)
    # With --floor the floor's commits flush too, and pg_stat_wal is the whole cluster's.
    wal_per_step = None if args.floor else (wal_syncs(bench.pg) - wal0) / (args.rounds * args.runs * STEPS)

    median = summarise(rounds)
    from proj.celery import app
    from proj.settings import get_settings

    report = {
        "config": {
            "runs": args.runs,
            "steps_per_run": STEPS,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "concurrency": args.concurrency,
            "pool": args.pool,
            "prefetch_multiplier": app.conf.worker_prefetch_multiplier,
            "broker": args.broker,
            "db": args.db,
            "poll_s": POLL_S,
            "inline_steps": get_settings().inline_steps,
        },
        "machine": machine(),
        "rounds": flat,
        "median": median,
        "ratio": median["ours"]["steps_per_s"] / median["plain"]["steps_per_s"],
        "round_ratios": round_ratios(rounds, "ours"),
        "cpu_ratio": service_cpu(median["plain"]) / service_cpu(median["ours"]),
        "wal_flushes_per_ours_step": wal_per_step,
        "noisy": any(median[side]["cpu_ms_per_step"]["other"] > NOISY_OTHER_MS for side in median),
    }
    if args.floor:
        report["floor_ratio"] = median["floor"]["steps_per_s"] / median["plain"]["steps_per_s"]
        report["floor_round_ratios"] = round_ratios(rounds, "floor")
        report["floor_cpu_ratio"] = service_cpu(median["plain"]) / service_cpu(median["floor"])
    print_report(report, args.json, print_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
