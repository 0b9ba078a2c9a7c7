"""Starting, checking and breaking the real services the tests use."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import redis

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_for(cond: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "") -> Any:
    """Poll `cond` until truthy; fail the test with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        time.sleep(interval)


def ensure_postgres() -> None:
    if _port_open(5432):
        return
    subprocess.run(
        "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
        shell=True,
        check=False,
    )
    wait_for(lambda: _port_open(5432), 30, what="postgres on 5432")


def ensure_redis() -> None:
    if _port_open(6379):
        return
    start_redis()


def start_redis() -> None:
    os.makedirs("/var/lib/redis", exist_ok=True)
    os.makedirs("/var/log/redis", exist_ok=True)
    subprocess.run(REDIS_START, check=True, stdout=subprocess.DEVNULL)
    wait_for(lambda: _port_open(6379), 30, what="redis on 6379")


def recreate_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
            "AND pid <> pg_backend_pid()",
            (name,),
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')


def pg_url() -> str:
    return os.environ["DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")


def sql(query: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement on the test database with a fresh connection; return the rows."""
    with psycopg.connect(pg_url(), autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def scalar(query: str, params: Any = None) -> Any:
    rows = sql(query, params)
    return rows[0][0] if rows else None


def create_testkit() -> None:
    from tests.kinds import TESTKIT_DDL

    with psycopg.connect(pg_url(), autocommit=True) as conn:
        conn.execute(TESTKIT_DDL)


def truncate_all() -> None:
    rows = sql(
        "SELECT schemaname || '.' || tablename FROM pg_tables WHERE schemaname NOT IN "
        "('pg_catalog', 'information_schema', 'public')"
    )
    if rows:
        sql("TRUNCATE " + ", ".join(r[0] for r in rows) + " RESTART IDENTITY CASCADE")


def flush_broker() -> None:
    """Drop queued messages left by the previous test (they are hints, but stale ones add noise)."""
    url = os.environ["BROKER_URL"]
    if url.startswith("redis://"):
        # The machine's Redis is shared: another run may be restarting it right now.
        wait_for(lambda: _flushed(url), 30, interval=0.5, what=f"{url} to answer FLUSHDB")
    elif url.startswith("amqp://"):
        import kombu

        from proj.engine.kind import all_kinds

        with kombu.Connection(url) as conn:
            for name in ["engine", *{k.queue for k in all_kinds()}]:
                ch = conn.channel()  # one per queue: a missing queue (404) closes its channel
                with contextlib.suppress(Exception):
                    ch.queue_purge(name)
                with contextlib.suppress(Exception):
                    ch.close()


def _flushed(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=5).flushdb())
    except redis.exceptions.ConnectionError:
        return False


def terminate_app_connections() -> int:
    """`pg_terminate_backend` every connection of the application (workers, beat)."""
    rows = sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = 'proj' AND pid <> pg_backend_pid()"
    )
    return len(rows)


class ProcessGroup:
    """Real worker and beat subprocesses, each in its own session so a signal hits the tree."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str] | None, *, program: str = "celery"
    ) -> Path:
        log = self.tmp / f"{name}.log"
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        argv = [str(VENV_BIN / "celery"), "-A", "proj", *args] if program == "celery" else [program, *args]
        self.procs[name] = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=full_env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return log

    def worker(
        self,
        name: str,
        *,
        concurrency: int = 2,
        env: dict[str, str] | None = None,
        wait: bool = True,
        pool: str = "prefork",
    ) -> subprocess.Popen[bytes]:
        log = self._spawn(
            name,
            [
                "worker",
                "-n",
                f"{name}@%h",
                "-c",
                str(concurrency),
                "-P",
                pool,
                "--loglevel",
                "INFO",
                "--without-mingle",
                "--without-gossip",
                "-O",
                "fair",
            ],
            env,
        )
        if wait:
            wait_for(
                lambda: b" ready." in log.read_bytes() or self._died(name, log),
                60,
                what=f"worker {name} ready",
            )
            self._died(name, log, raise_=True)
        return self.procs[name]

    def beat(self, name: str = "beat", env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self._spawn(
            name,
            ["beat", "--loglevel", "INFO", "-s", str(self.tmp / f"{name}-schedule")],
            env,
        )
        return self.procs[name]

    def python(self, name: str, code: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Run `code` in the project's Python, as a process of this group (its own session)."""
        self._spawn(name, ["-c", code], env, program=str(VENV_BIN / "python"))
        return self.procs[name]

    def _died(self, name: str, log: Path, raise_: bool = False) -> bool:
        code = self.procs[name].poll()
        if code is not None and raise_:
            raise AssertionError(f"{name} exited {code}:\n{log.read_text()[-3000:]}")
        return code is not None

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def children(self, name: str) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.procs[name].pid)], capture_output=True, text=True
        ).stdout
        return [int(p) for p in out.split()]

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to the whole process group (main process and prefork children)."""
        os.killpg(self.procs[name].pid, sig)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait(10)

    def stop_all(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
            del name
        self.procs.clear()


def dump_engine_state() -> str:
    """Runs, steps and errors as text: attached to failures so a red test explains itself."""
    lines = []
    for r in sql(
        "SELECT r.kind, r.status, r.current_step, r.last_error->>'message', s.name, s.status, "
        "s.attempts, s.error->>'message' FROM engine.task_run r LEFT JOIN engine.step s "
        "ON s.run_id = r.id ORDER BY r.created_at, s.stage, s.item_index"
    ):
        lines.append(" | ".join(str(x) for x in r))
    if scalar("SELECT to_regclass('outbox.outbox_event') IS NOT NULL"):
        for r in sql("SELECT kind, idempotency_key, status, attempts, last_error FROM outbox.outbox_event"):
            lines.append("outbox: " + " | ".join(str(x) for x in r))
    return "\n".join(lines)
