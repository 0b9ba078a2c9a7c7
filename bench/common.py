"""Helpers shared by the benchmarks (throughput, outbox_latency, recovery, signal_latency, scale,
dbos_compare).

The conventions are those of `bench/throughput.py` and `bench/outbox_latency.py`: each bench has
its own database (created with psycopg) and its own Redis db, starts real `celery -A proj`
subprocesses in their own sessions (so a signal reaches the whole tree), and measures the code of
the tree it is run from (`PYTHONPATH=<that tree>`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCK_TTL_S = 900


LATENCY_KINDS = "bench.kinds,bench.latency_kinds"
# periodic kinds (qBittorrent reconcile, library verify, purge) stay out of the way: once a day
QUIET_PERIODIC = {
    "PERIODIC_RECONCILE_S": "86400",
    "PERIODIC_VERIFY_S": "86400",
    "PERIODIC_PURGE_S": "86400",
}


def db_url(admin_url: str, name: str) -> str:
    return admin_url.rsplit("/", 1)[0] + "/" + name


def add_service_args(
    p: argparse.ArgumentParser, *, db: str, broker: str, db_help: str = "database (dropped and recreated)"
) -> None:
    """`--db`, `--pg-admin`, `--broker` and `--json`, with this bench's own database and Redis db."""
    p.add_argument("--db", default=db, help=db_help)
    p.add_argument("--pg-admin", default=PG_ADMIN)
    p.add_argument("--broker", default=broker)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def service_env(
    args: argparse.Namespace,
    *,
    db: str | None = None,
    broker: str | None = None,
    kinds: str = LATENCY_KINDS,
    concurrency: int | None = None,
    sweep_s: float | None = 1.0,
    quiet_periodic: bool = True,
    **settings: object,
) -> dict[str, str]:
    """The settings of a bench's processes (this one and its `celery` children).

    `DATABASE_URL` is database `db` (default `args.db`) on `args.pg_admin`'s server, `BROKER_URL`
    is `broker` (default `args.broker`), `ENGINE_EXTRA_KINDS` is `kinds`, `WORKER_CONCURRENCY` is
    `concurrency` (default `args.concurrency`), `SWEEP_INTERVAL_S` is `sweep_s` (left unset if
    None), the periodic kinds run once a day if `quiet_periodic`, and each extra keyword is one
    more setting (`LEASE_TTL_S=3.0`). Values are `str()` of what is passed. Export with `set_env`.
    """
    env = {
        "DATABASE_URL": db_url(args.pg_admin, args.db if db is None else db),
        "BROKER_URL": args.broker if broker is None else broker,
        "ENGINE_EXTRA_KINDS": kinds,
        "WORKER_CONCURRENCY": str(args.concurrency if concurrency is None else concurrency),
    }
    if sweep_s is not None:
        env["SWEEP_INTERVAL_S"] = str(sweep_s)
    if quiet_periodic:
        env.update(QUIET_PERIODIC)
    env.update({key: str(value) for key, value in settings.items()})
    return env


def set_env(env: dict[str, str]) -> dict[str, str]:
    """Settings are read once per process: call this before `proj` is imported. Returns `env`."""
    os.environ.update(env)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return env


def recreate_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid()",
            (name,),
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')


def wait_for_redis(r: Any, timeout: float = 60.0) -> None:
    """Ping the `redis.Redis` client `r` until it answers (a test elsewhere may be restarting Redis)."""
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            r.ping()
            return
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def prepare_database(args: argparse.Namespace, env: dict[str, str], *, benchkit: bool = False) -> Any:
    """Recreate database `args.db`, migrate it to head (with this process' settings: `set_env`
    first) and return an autocommit psycopg connection to `env["DATABASE_URL"]`; with `benchkit`,
    the `benchkit` schema of bench/latency_kinds.py is created in it too."""
    recreate_database(args.pg_admin, args.db)

    import psycopg

    from bench.latency_kinds import BENCHKIT_DDL
    from proj.cli import migrate_to_head

    migrate_to_head()
    pg = psycopg.connect(env["DATABASE_URL"], autocommit=True)
    if benchkit:
        pg.execute(BENCHKIT_DDL)
    return pg


@contextlib.contextmanager
def broker_db(url: str, owner: str) -> Iterator[None]:
    """Own one Redis db for the run (flushed first); refuse if another bench holds it."""
    import redis

    r = redis.Redis.from_url(url)
    wait_for_redis(r)
    db = int(r.connection_pool.connection_kwargs.get("db", 0))
    deadline = time.monotonic() + 120
    while True:  # a flush would drop the messages of whoever else uses this db (a test run?)
        me = r.client_id()
        others = [c for c in r.client_list() if int(c.get("db", -1)) == db and int(c["id"]) != me]
        if not others:
            break
        if time.monotonic() > deadline:
            raise SystemExit(
                f"{len(others)} other client(s) are using Redis db {db} ({url}); this bench flushes it: "
                "wait for them or pass another --broker db"
            )
        print(f"waiting for {len(others)} other client(s) of Redis db {db} to leave …", file=sys.stderr)
        time.sleep(5)
    key = "bench:lock"
    if not r.set(key, f"{owner}:{os.getpid()}", nx=True, ex=LOCK_TTL_S):
        holder = (r.get(key) or b"?").decode()
        raise SystemExit(f"{holder} is using {url}; wait for it or pass another --broker db")
    r.flushdb()
    r.set(key, f"{owner}:{os.getpid()}", ex=LOCK_TTL_S)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            if r.get(key) == f"{owner}:{os.getpid()}".encode():
                r.delete(key)


class Celery:
    """One `celery -A proj …` subprocess in its own session, with its log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: Path) -> None:
        self.name = name
        self.args = args
        self.env = env
        self.log = logdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        full_env = {**os.environ, **self.env}
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        with self.log.open("ab") as out:
            out.write(b"\n---- start ----\n")
        self.mark = self.log.stat().st_size
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "celery"), "-A", "proj", *self.args],
            cwd=ROOT,
            env=full_env,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            tail = self.log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"{self.name} exited {self.proc and self.proc.returncode}:\n{tail}")

    def ready(self) -> bool:
        """A worker at INFO prints ' ready.' once it consumes (only lines since the last start)."""
        self.check()
        with self.log.open("rb") as f:
            f.seek(self.mark)
            return b" ready." in f.read()

    def wait_ready(self, timeout: float = 90.0) -> None:
        wait_until(self.ready, timeout, f"{self.name} to be ready")

    def children(self) -> list[int]:
        try:
            return [int(p) for p in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()]
        except OSError:
            return []

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)


def worker_args(name: str, concurrency: int, loglevel: str, pool: str = "prefork") -> list[str]:
    """The arguments after `celery -A proj` of every bench worker: node `<name>-<our pid>@%h`,
    `-P <pool> -c <concurrency> -O fair` (prefork unless said), without mingle and gossip."""
    return [
        "worker",
        "-n",
        f"{name}-{os.getpid()}@%h",
        "-P",
        pool,
        "-c",
        str(concurrency),
        "-O",
        "fair",
        "--without-mingle",
        "--without-gossip",
        "--loglevel",
        loglevel,
    ]


def worker(
    name: str,
    env: dict[str, str],
    logdir: Path,
    concurrency: int,
    loglevel: str = "INFO",
    pool: str = "prefork",
) -> Celery:
    """`celery -A proj worker` with the same flags as bench/throughput.py (prefork, -O fair)."""
    return Celery(name, worker_args(name, concurrency, loglevel, pool), env, logdir)


def beat(name: str, env: dict[str, str], logdir: Path) -> Celery:
    schedule = str(logdir / f"{name}-schedule")
    return Celery(name, ["beat", "--loglevel", "WARNING", "-s", schedule], env, logdir)


def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def print_report(report: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], None]) -> None:
    """The figures as indented JSON (`--json`), else as the bench's `table`."""
    if as_json:
        print(json.dumps(report, indent=2, default=str))
    else:
        table(report)


def summary(values: list[float]) -> dict[str, float]:
    """p50/p90/p99/mean/max (p99 is interpolated: with few samples it is close to the max)."""
    values = sorted(values)
    if len(values) == 1:
        v = values[0]
        return {"n": 1, "p50": v, "p90": v, "p99": v, "mean": v, "min": v, "max": v}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p90": q[89],
        "p99": q[98],
        "mean": statistics.fmean(values),
        "min": values[0],
        "max": values[-1],
    }


def machine(database_url: str | None = None) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    out: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }
    if database_url:
        import psycopg

        with psycopg.connect(database_url, autocommit=True) as conn:
            out["postgres"] = conn.execute("SHOW server_version").fetchone()[0]
    with contextlib.suppress(Exception):
        import celery

        out["celery"] = celery.__version__
    return out


def machine_line(m: dict[str, Any]) -> str:
    load = "/".join(f"{x:.1f}" for x in m.get("loadavg", ()))
    pg = f", Postgres {m['postgres']}" if "postgres" in m else ""
    return (
        f"machine: {m['nproc']} cpu ({m['cpu']}), load average {load}; Python {m['python']}, "
        f"Celery {m.get('celery', '?')}{pg}"
    )


# --------------------------------------------------------------------------------------------
# CPU accounting from /proc (Linux), as bench/throughput.py does it

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(parts[:8])
    idle = parts[3] + parts[4] + parts[7]
    return (total - idle) / CLK_TCK, total / CLK_TCK


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            todo.extend(int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split())
    return out


def service_pids() -> dict[str, list[int]]:
    """Postgres auxiliary processes (not backends) and redis-server."""
    aux, rds = [], []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            comm = (p / "comm").read_text().strip()
        except OSError:
            continue
        if comm == "redis-server":
            rds.append(int(p.name))
        elif comm == "postgres":
            with contextlib.suppress(OSError):
                if b"(" not in (p / "cmdline").read_bytes():
                    aux.append(int(p.name))
    return {"postgres aux": aux, "redis-server": rds}


class CpuMeter:
    """CPU seconds per group over an interval; 'other' is the rest of the busy machine."""

    def __init__(self, groups: Callable[[], dict[str, list[int]]]) -> None:
        self.groups = groups

    def snapshot(self) -> dict[str, Any]:
        return {
            "pids": {g: {p: proc_cpu(p) for p in pids} for g, pids in self.groups().items()},
            "machine": machine_cpu(),
        }

    def since(self, start: dict[str, Any]) -> dict[str, float]:
        end = self.snapshot()
        out: dict[str, float] = {}
        for group, pids in end["pids"].items():
            before = start["pids"].get(group, {})
            out[group] = sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in pids.items())
        busy = end["machine"][0] - start["machine"][0]
        total = end["machine"][1] - start["machine"][1]
        out["other"] = max(0.0, busy - sum(out.values()))
        out["machine busy %"] = 100.0 * busy / total if total else 0.0
        return out


def redis_run_id(url: str) -> str | None:
    """The Redis server's run id (changes when it restarts: queued messages are then lost),
    None while it is down. Other sessions' fault tests restart the shared Redis."""
    import redis

    try:
        return str(redis.Redis.from_url(url, socket_timeout=2).info("server")["run_id"])
    except redis.exceptions.RedisError:
        return None


class RedisWatch:
    """Tell whether Redis restarted (or went away) between `start()` and `restarted()`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.run_id: str | None = None

    def start(self) -> None:
        deadline = time.monotonic() + 90
        while (rid := redis_run_id(self.url)) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"Redis at {self.url} is down")
            time.sleep(0.5)
        self.run_id = rid

    def restarted(self) -> bool:
        return redis_run_id(self.url) != self.run_id


def killpg(pid: int, sig: int) -> None:
    """Signal a process group that may be gone already."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


@contextlib.contextmanager
def held(pids: list[int]) -> Iterator[None]:
    """Freeze these process groups (SIGSTOP) for the duration; thaw them after, whatever happens."""
    for pid in pids:
        killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            killpg(pid, signal.SIGCONT)
