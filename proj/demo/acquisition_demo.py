"""`proj demo`: walk one download request from approval to library file, showing its timeline.

A loopback swarm in a throwaway directory (a seeding qbittorrent-nox holding a few MiB of random
data, and the managed one our kinds drive, whose on-finish hook is `proj signal download:%K`), a
local webhook receiver and an in-process worker and beat. It requests the torrent, approves it a
second later and follows the business timeline (`acq.task_event`, `acq.download_task.progress`,
copy progress from the copy steps) until the requester is notified, then checks the library's
bytes against the payload's."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from proj.demo.engine_demo import BAR_WIDTH, POLL_S, offset
from proj.demo.screen import console
from proj.demo.services import Servers, check_broker, configure, guarded
from proj.engine.store import views

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
    """qBittorrent's on-finish program: `<venv>/proj signal download:%K`, output kept in `log`.

    qBittorrent splits the line on spaces (double quotes group; no shell), so `sh -c` adds the
    redirection. The hook inherits qbittorrent-nox's environment: DATABASE_URL and BROKER_URL
    (the embedded servers' Unix-socket URLs included) are in os.environ before it starts.
    """
    script = Path(sys.executable).parent / "proj"
    prog = [str(script)] if script.exists() else [sys.executable, "-m", "proj.cli"]
    cmd = " ".join(shlex.quote(a) for a in [*prog, "signal", "download:%K"])
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
    copies: list[views.KeyedStep]
    problems: list[views.EndedBadly]

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
        copies = views.steps_named_by_key(s, f"import:{task_id}", "copy")
        problems = views.ended_badly_by_keys(s, run_keys(task_id))
    return Snapshot(task.status, task.progress, task.created_at, task.now, events, copies, problems)


def describe(detail: dict[str, Any] | None) -> str:
    """An event's detail as `k=v` pairs, long values (infohashes) shortened."""
    parts = []
    for k, v in (detail or {}).items():
        v = str(v)
        parts.append(f"{k}={v[:12] + '…' if len(v) > 24 else v}")
    return " ".join(parts)


def copy_state(row: views.KeyedStep) -> tuple[str, float]:
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

    from proj import db

    deadline = time.monotonic() + wait_s
    while True:
        with db.transaction() as s:
            at = views.first_signal(s, f"download:{infohash}")
        if at is not None or time.monotonic() >= deadline:
            return at
        time.sleep(0.2)


def print_errors(task_id: uuid.UUID, swarm: Swarm) -> None:
    """Where each run stands and every step error, then the hook's and qBittorrent's logs."""

    from proj import db

    with db.transaction() as s:
        runs = views.runs_with_open_steps_by_keys(s, run_keys(task_id))
        errors = views.step_errors_by_keys(s, run_keys(task_id))
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
        from proj.engine.celery_engine import CeleryTaskEngine
        from proj.engine.preflight import migrate_to_head

        check_broker()
        head = migrate_to_head()
        t = time.monotonic()
        swarm = start_swarm(servers)
        console.print(
            f"swarm:    seeder ({len(PAYLOAD_FILES)} files, {swarm.size} bytes, "
            f"≤{SEED_RATE >> 20} MiB/s) "
            f"and managed qBittorrent {swarm.managed.webui_url}, on-finish hook `proj signal "
            f"download:%K` (up in {time.monotonic() - t:.1f} s)",
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
            from proj.demo.serve import serve as serve_front_door

            console.print(final, soft_wrap=True)
            assert servers.work is not None
            serve_front_door(console, servers.work, swarm.torrent)
        return code, final

    return guarded(body)
