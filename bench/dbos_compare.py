"""Durable step throughput: ours vs DBOS Transact on the same Postgres, in one invocation.

    .venv/bin/pip install -e '.[bench]'      # DBOS is a bench-only extra
    .venv/bin/python -m bench.dbos_compare [--runs 200] [--rounds 2] [--json]

Both sides run N runs/workflows of **5 no-op durable steps** and are timed from the first
submission to the poll that sees all N finished (submission included for both: N runs in one
transaction each side, ours with `enqueue_many`'s one statement, DBOS with one insert per
workflow), alternately, after a warm-up; figures are medians.

- **ours**: bench/throughput.py's `ours` round, imported (`bench.throughput.Bench`, kind `noop5`
  of bench/kinds.py) on one `celery -A proj worker -P prefork -c 2 -O fair` (its `Worker`),
  database `proj_bench_vs_dbos`, Redis db 4. Each step: claim with a lease in Postgres, body,
  fenced commit that creates the next step, publish through Redis.
- **DBOS** (bench/dbos_app.py): workflow `noop5` = five `@DBOS.step()` no-ops; every step's
  output is checkpointed in Postgres before the next runs. Enqueued with
  `DBOSClient.enqueue_in_transaction` (N in one transaction, like ours) on a DBOS queue, executed
  by `--dbos-procs` worker processes (`DBOS.launch()`, one executor id each, listening only to
  their queue), system database `proj_bench_dbos` on the same Postgres server. Configurations
  (`--dbos-configs`, `worker_concurrency:polling_interval_sec`):
  - `1:0.001` — the same concurrency as ours (2 processes × 1 workflow at a time, like 2 prefork
    children × 1 step); DBOS' default polling interval is 1 s, which would cap this at ~2
    workflows/s, so it is set to 1 ms, the fastest useful;
  - `8:0.01` — DBOS as it is meant to run: several workflows per process in threads;
  - `none:1.0` — DBOS' defaults (`register_queue(name)`): no per-process limit, 1 s polling (the
    first process to poll takes what is queued and runs it in its threads).

Sides not being measured are frozen (SIGSTOP on their process groups) so their pollers take no
CPU. CPU per step is accounted from /proc for each side: its worker processes, its database's
Postgres backends, Postgres auxiliary processes and redis-server. Target (issue "Benchmarks
side by side"): ours ≥ 2× DBOS.
"""

from __future__ import annotations

import argparse
import os
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
    ROOT,
    VENV_BIN,
    CpuMeter,
    add_service_args,
    broker_db,
    db_url,
    descendants,
    held,
    killpg,
    machine,
    machine_line,
    print_report,
    recreate_database,
    service_env,
    service_pids,
    set_env,
    wait_until,
)
from bench.throughput import round_result

STEPS = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200, help="runs / workflows per round")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per side (alternating)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured runs / workflows per side first")
    p.add_argument("--concurrency", type=int, default=2, help="our prefork worker processes")
    p.add_argument("--dbos-procs", type=int, default=2, help="DBOS worker processes per configuration")
    p.add_argument(
        "--dbos-configs",
        default="1:0.001,8:0.01,none:1.0",
        help="DBOS configurations to measure, worker_concurrency:polling_interval_sec, comma-separated",
    )
    add_service_args(
        p,
        db="proj_bench_vs_dbos",
        broker="redis://127.0.0.1:6379/4",
        db_help="our database (dropped and recreated)",
    )
    p.add_argument("--dbos-db", default="proj_bench_dbos", help="DBOS system database (recreated)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-round timeout, seconds")
    p.add_argument(
        "--submit-frozen",
        action="store_true",
        help="freeze each side's workers while its runs are submitted and start the clock when they "
        "thaw: the throughput of execution alone (by default submission is timed too)",
    )
    return p.parse_args(argv)


class Proc:
    """A subprocess in its own session, frozen and thawed as a group."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name, self.log = name, log
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise SystemExit(f"{self.name} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")

    def signal(self, sig: int) -> None:
        killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)


class DbosSide:
    """One DBOS configuration: its queue and its worker processes."""

    def __init__(self, args: argparse.Namespace, spec: str, logdir: Path, client: Any, engine: Any) -> None:
        conc, poll = spec.split(":")
        self.worker_concurrency = None if conc.lower() in ("none", "") else int(conc)
        self.poll = float(poll)
        label = "none" if self.worker_concurrency is None else str(self.worker_concurrency)
        self.name = f"dbos {args.dbos_procs}x{label}" if self.worker_concurrency else "dbos default"
        self.queue = f"bench_c{label}_p{str(self.poll).replace('.', '_')}"
        self.args, self.client, self.engine = args, client, engine
        self.url = db_url(args.pg_admin, args.dbos_db)
        self.logdir = logdir
        self.procs: list[Proc] = []

    def spawn(self, count: int) -> None:
        """Start worker processes up to `count` (the very first alone: it creates DBOS' schema)."""
        for i in range(len(self.procs), count):
            cmd = [
                str(VENV_BIN / "python"),
                "-m",
                "bench.dbos_app",
                "--url",
                self.url,
                "--queue",
                self.queue,
                "--executor",
                f"{self.queue}-{i}",
                "--worker-concurrency",
                str(self.worker_concurrency or 0),
                "--poll",
                str(self.poll),
            ]
            self.procs.append(Proc(f"{self.name}#{i}", cmd, self.logdir / f"{self.queue}-{i}.log"))

    def ready(self) -> bool:
        for p in self.procs:
            p.check()
        return all(b"dbos worker ready" in p.log.read_bytes() for p in self.procs)

    def pids(self) -> list[int]:
        return [d for p in self.procs for d in descendants(p.pid)]

    def in_flight(self) -> int:
        from sqlalchemy import text

        with self.engine.connect() as c:
            return int(
                c.execute(
                    text(
                        "SELECT count(*) FROM dbos.workflow_status WHERE queue_name = :q "
                        "AND status IN ('ENQUEUED', 'PENDING')"
                    ),
                    {"q": self.queue},
                ).scalar()
            )

    def succeeded(self, tag: str) -> int:
        from sqlalchemy import text

        with self.engine.connect() as c:
            return int(
                c.execute(
                    text(
                        "SELECT count(*) FROM dbos.workflow_status WHERE queue_name = :q "
                        "AND status = 'SUCCESS' AND workflow_uuid LIKE :t"
                    ),
                    {"q": self.queue, "t": tag + "-%"},
                ).scalar()
            )

    def submit(self, n: int, tag: str) -> None:
        from bench.dbos_app import APP_VERSION, WORKFLOW

        with self.engine.begin() as conn:
            for i in range(n):
                self.client.enqueue_in_transaction(
                    conn,
                    {
                        "queue_name": self.queue,
                        "workflow_name": WORKFLOW,
                        "workflow_id": f"{tag}-{i}",
                        "app_version": APP_VERSION,
                    },
                    i,
                )

    def round(self, n: int, meter: CpuMeter, timeout: float) -> dict[str, Any]:
        tag = uuid.uuid4().hex
        cpu0 = meter.snapshot()
        t0 = time.perf_counter()
        with held([p.pid for p in self.procs] if self.args.submit_frozen else []):
            self.submit(n, tag)
        t_sub = time.perf_counter() - t0
        if self.args.submit_frozen:
            t0 = time.perf_counter()  # execution alone: the clock starts when the workers thaw
        deadline = t0 + timeout
        while self.in_flight() > 0:
            if time.perf_counter() > deadline:
                for p in self.procs:
                    p.check()
                raise SystemExit(f"{self.name}: not done after {timeout}s")
            time.sleep(0.05)
        elapsed = time.perf_counter() - t0
        cpu = meter.since(cpu0)
        done = self.succeeded(tag)
        if done != n:
            raise SystemExit(f"{self.name}: {done}/{n} workflows succeeded")
        return round_result(n, elapsed, t_sub, cpu)


SERVICE = ("workers", "postgres backends", "postgres aux", "redis-server")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # as bench/throughput.py: no sweep interval nor periodic settings (defaults)
    env = set_env(service_env(args, kinds="bench.kinds", sweep_s=None, quiet_periodic=False))
    try:
        import dbos  # noqa: F401
    except ImportError:
        raise SystemExit("DBOS is not installed: .venv/bin/pip install -e '.[bench]'") from None
    import psycopg
    import sqlalchemy as sa
    from dbos import DBOSClient

    from bench.throughput import Bench, Worker

    recreate_database(args.pg_admin, args.db)
    recreate_database(args.pg_admin, args.dbos_db)
    import proj.celery  # noqa: F401  (the app first: it loads bench.kinds)
    from proj.cli import migrate_to_head

    migrate_to_head()
    dbos_url = db_url(args.pg_admin, args.dbos_db)
    logdir = Path(tempfile.mkdtemp(prefix="bench-dbos-"))
    log = None if args.json else sys.stderr
    sides: dict[str, Any] = {}
    rounds: list[dict[str, Any]] = []
    pg_ours = psycopg.connect(env["DATABASE_URL"], autocommit=True)
    pg_dbos = psycopg.connect(dbos_url, autocommit=True)

    def backends(conn: Any) -> list[int]:
        return [
            r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        ]

    with broker_db(args.broker, "bench.dbos_compare"):
        worker = Worker(args.concurrency, env, logdir / "worker.log")
        dbos_sides: list[DbosSide] = []
        engine = sa.create_engine(dbos_url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            specs = [s.strip() for s in args.dbos_configs.split(",") if s.strip()]
            dbos_sides = [DbosSide(args, spec, logdir, None, engine) for spec in specs]
            dbos_sides[0].spawn(1)  # alone: it creates (migrates) DBOS' system database
            wait_until(dbos_sides[0].ready, 120, f"{dbos_sides[0].name} to launch")
            client = DBOSClient(system_database_url=dbos_url)
            for side in dbos_sides:
                side.client = client
                side.spawn(args.dbos_procs)
            for side in dbos_sides:
                wait_until(side.ready, 120, f"{side.name} to launch")
            bench = Bench(argparse.Namespace(broker=args.broker, timeout=max(args.timeout, 90.0)), worker)
            if args.submit_frozen:
                bench.hold_pids = [worker.proc.pid]
            ours_meter = CpuMeter(
                lambda: {
                    "workers": descendants(worker.proc.pid),
                    "postgres backends": backends(pg_ours),
                    **service_pids(),
                    "driver": [os.getpid()],
                }
            )

            def dbos_meter(side: DbosSide) -> CpuMeter:
                return CpuMeter(
                    lambda: {
                        "workers": side.pids(),
                        "postgres backends": backends(pg_dbos),
                        **service_pids(),
                        "driver": [os.getpid()],
                    }
                )

            def run_ours(n: int) -> dict[str, Any]:
                cpu0 = ours_meter.snapshot()
                r = bench.run("ours", n)
                cpu = ours_meter.since(cpu0)
                return round_result(n, r["seconds"], r["submit_s"], cpu)

            freeze_all = [worker.proc.pid, *(p.pid for s in dbos_sides for p in s.procs)]
            sides = {"ours": (run_ours, [worker.proc.pid])}
            for side in dbos_sides:
                meter = dbos_meter(side)
                sides[side.name] = (
                    lambda n, side=side, meter=meter: side.round(n, meter, args.timeout),
                    [p.pid for p in side.procs],
                )

            def freeze(pids: list[int], sig: int) -> None:
                for pid in pids:
                    killpg(pid, sig)

            freeze(freeze_all, signal.SIGSTOP)
            for fn, pids in sides.values():  # warm-up (and readiness of our worker)
                freeze(pids, signal.SIGCONT)
                fn(args.warmup)
                freeze(pids, signal.SIGSTOP)
            for i in range(args.rounds):
                for name, (fn, pids) in sides.items():
                    freeze(pids, signal.SIGCONT)
                    time.sleep(0.5)
                    try:
                        r = fn(args.runs)
                    finally:
                        freeze(pids, signal.SIGSTOP)
                    r.update(round=i + 1, side=name)
                    rounds.append(r)
                    if log:
                        print(f"round {i + 1} {name:<10} {r['steps_per_s']:.1f} steps/s", file=log)
        finally:
            freeze_pids = [worker.proc.pid, *(p.pid for s in dbos_sides for p in s.procs)]
            for pid in freeze_pids:
                killpg(pid, signal.SIGCONT)
            worker.stop()
            for s in dbos_sides:
                for p in s.procs:
                    p.stop()
            engine.dispose()

    med: dict[str, Any] = {}
    for name in sides:
        rs = [r for r in rounds if r["side"] == name]
        med[name] = {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
            "submit_s": statistics.median(r["submit_s"] for r in rs),
            "cpu_ms_per_step": {
                g: statistics.median(r["cpu_ms_per_step"][g] for r in rs) for g in rs[0]["cpu_ms_per_step"]
            },
        }
        med[name]["service_cpu_ms_per_step"] = sum(med[name]["cpu_ms_per_step"][g] for g in SERVICE)
    others = [n for n in sides if n != "ours"]
    report = {
        "config": {
            "runs": args.runs,
            "steps_per_run": STEPS,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "timed": "execution alone (workers frozen during submission)"
            if args.submit_frozen
            else "submission and execution",
            "ours": f"celery worker -P prefork -c {args.concurrency} -O fair, {args.broker}, db {args.db}",
            "dbos": {
                s.name: {
                    "processes": args.dbos_procs,
                    "worker_concurrency": s.worker_concurrency,
                    "polling_interval_sec": s.poll,
                    "queue": s.queue,
                    "db": args.dbos_db,
                }
                for s in dbos_sides
            },
            "dbos_version": _dist_version(),
        },
        "machine": machine(env["DATABASE_URL"]),
        "rounds": rounds,
        "median": med,
        "ratio": {n: med["ours"]["steps_per_s"] / med[n]["steps_per_s"] for n in others},
        "cpu_ratio": {
            n: med[n]["service_cpu_ms_per_step"] / med["ours"]["service_cpu_ms_per_step"] for n in others
        },
    }
    print_report(report, args.json, print_table)
    return 0


def _dist_version() -> str:
    from importlib.metadata import version

    return version("dbos")


def print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"{cfg['runs']} runs/workflows x {STEPS} no-op durable steps, {cfg['rounds']} rounds per side, "
        f"alternating; DBOS {cfg['dbos_version']}; timed: {cfg['timed']}"
    )
    print(f"ours: {cfg['ours']}")
    for name, d in cfg["dbos"].items():
        print(
            f"{name}: {d['processes']} processes x worker_concurrency {d['worker_concurrency']}, "
            f"polling {d['polling_interval_sec']:g}s, queue {d['queue']}, db {d['db']}"
        )
    print(machine_line(report["machine"]))
    print()
    print(f"{'round':<7}{'side':<14}{'seconds':>9}{'submit s':>10}{'steps/s':>10}{'service CPU ms/step':>22}")
    for r in report["rounds"]:
        cpu = sum(r["cpu_ms_per_step"][g] for g in SERVICE)
        print(
            f"{r['round']:<7}{r['side']:<14}{r['seconds']:>9.2f}{r['submit_s']:>10.2f}"
            f"{r['steps_per_s']:>10.1f}{cpu:>22.2f}"
        )
    for name, m in report["median"].items():
        print(
            f"{'median':<7}{name:<14}{'':>9}{m['submit_s']:>10.2f}{m['steps_per_s']:>10.1f}"
            f"{m['service_cpu_ms_per_step']:>22.2f}"
        )
    print()
    names = list(report["median"])
    print("CPU ms per step (median)".ljust(34) + "".join(f"{n:>14}" for n in names))
    for g in report["median"]["ours"]["cpu_ms_per_step"]:
        print(f"  {g:<32}" + "".join(f"{report['median'][n]['cpu_ms_per_step'][g]:>14.2f}" for n in names))
    print()
    for name, ratio in report["ratio"].items():
        print(
            f"ratio ours/{name} = {ratio:.2f} (target >= 2.0: {'met' if ratio >= 2.0 else 'NOT met'}); "
            f"CPU cost ratio ({name}/ours, service CPU per step) = {report['cpu_ratio'][name]:.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())
