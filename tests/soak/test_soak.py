"""Chaos soak: many acquire → import → notify pipelines over one loopback swarm while a driver
kills, freezes and disconnects the parts underneath them.

Configured by the environment (all optional):

- `SOAK_PIPELINES` (200): distinct torrents, one pipeline each;
- `SOAK_SECONDS` (150): the chaos window: requests are spread over its first 40 %, faults stop
  at its end (or earlier, once every pipeline is done);
- `SOAK_SETTLE_S` (240): after the window, how long the pipelines may take to finish;
- `SOAK_SEED` (20240611): the seed of every random choice (payloads, fault order and timing);
- `SOAK_MAX_FAULTS` (80): a bound on injected faults;
- `SOAK_MIN_REDIS_RESTARTS` (20): faults go on after the last pipeline finished until Redis was
  restarted this often (within the window and `SOAK_MAX_FAULTS`).

Short form (about 2 minutes here): `SOAK_PIPELINES=80 SOAK_SECONDS=240 pytest -m soak tests/soak -q`
(requests are spread over 40 % of the window, so faults keep coming until the last pipeline).

Faults, every 2-4 s: SIGKILL a worker (and start a replacement), SIGSTOP a worker for longer than
the lease then SIGCONT it, restart Redis (every queued message lost; twice as often as the
others), `pg_terminate_backend` every application connection, `pg_ctl restart` (fast or
immediate) of Postgres. Redis and Postgres are the soak's own private instances, never the
shared ones. Workers that exit by themselves are restarted and counted; the report prints
worker exits and Redis restarts, and the test fails unless no worker exited. At the end the
outside world is checked, not the engine's word: the library on disk, `acq.library_item`, the
ledger, qBittorrent's torrent list, every run, the outbox and the webhook receiver.

qBittorrent's on-finish hook appends `%K` to a file and a relay thread here calls the engine's
`signal` for each line (the production hook is `proj signal download:%K`, covered by
`tests/integration/test_acquisition_e2e.py`; 200 Python start-ups would starve a small CI machine).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proj import db
from proj.acquisition import qbt, service
from proj.acquisition.models import DownloadTask
from proj.engine import runs
from proj.engine.celery_engine import CeleryTaskEngine
from proj.qbt.local import LocalQbittorrent, make_torrent
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Receiver
from tests.qbt_fixtures import *  # noqa: F403
from tests.support import services
from tests.support.private import PrivatePostgres, PrivateRedis, private_postgres, private_redis, use_broker
from tests.support.services import ProcessGroup, scalar, sql, wait_for

PIPELINES = int(os.environ.get("SOAK_PIPELINES", "200"))
SECONDS = float(os.environ.get("SOAK_SECONDS", "150"))
SETTLE_S = float(os.environ.get("SOAK_SETTLE_S", "240"))
SEED = int(os.environ.get("SOAK_SEED", "20240611"))
MAX_FAULTS = int(os.environ.get("SOAK_MAX_FAULTS", "80"))
MIN_REDIS_RESTARTS = int(os.environ.get("SOAK_MIN_REDIS_RESTARTS", "20"))
WORKERS = 3
LEASE_TTL_S = float(os.environ.get("LEASE_TTL_S", "3"))

pytestmark = [pytest.mark.soak, pytest.mark.timeout(int(240 + SECONDS + SETTLE_S + 120))]


# ------------------------------------------------------------------------------ the swarm


@dataclass(frozen=True)
class Item:
    """One pipeline's payload: a single random file and its torrent."""

    name: str
    torrent: bytes
    infohash: str
    sha256: str
    size: int
    task_id: uuid.UUID


@dataclass
class SoakSwarm:
    seeder: LocalQbittorrent
    managed: LocalQbittorrent
    items: list[Item]
    library: Path
    downloads: Path
    finished_log: Path

    def worker_env(self) -> dict[str, str]:
        return {
            "QBT_URL": self.managed.webui_url,
            "QBT_PEERS": self.seeder.peer_address,
            "LIBRARY_ROOT": str(self.library),
            "DOWNLOAD_DIR": str(self.downloads),
            "ACQ_DOWNLOAD_RECHECK_S": "10",
            "EXPECTED_WORKERS": str(WORKERS),
        }


def make_items(root: Path, n: int, rng: random.Random) -> list[Item]:
    root.mkdir(parents=True)
    items = []
    for i in range(n):
        size = rng.randint(16 * 1024, 64 * 1024)
        name = f"soak-{i:03d}-{rng.getrandbits(32):08x}.bin"
        data = rng.randbytes(size)
        (root / name).write_bytes(data)
        torrent, infohash = make_torrent(root / name, piece_size=16 * 1024)
        task_id = uuid.UUID(int=rng.getrandbits(128), version=4)
        items.append(Item(name, torrent, infohash, hashlib.sha256(data).hexdigest(), size, task_id))
    assert len({it.infohash for it in items}) == n
    return items


UNLIMITED = {"max_uploads": -1, "max_uploads_per_torrent": -1, "max_connec": -1, "max_connec_per_torrent": -1}


@pytest.fixture
def soak_swarm(
    qbt_factory: Callable[..., LocalQbittorrent], tmp_path_factory: pytest.TempPathFactory
) -> SoakSwarm:
    """One seeder sharing every payload; the managed instance our workers drive."""
    base = tmp_path_factory.mktemp("soak")
    items = make_items(base / "seed-data", PIPELINES, random.Random(SEED))
    seeder = qbt_factory("seeder")
    client = seeder.client()
    client.app_set_preferences(UNLIMITED)
    for chunk in range(0, len(items), 50):
        client.torrents_add(
            torrent_files={f"{it.infohash}.torrent": it.torrent for it in items[chunk : chunk + 50]},
            save_path=str(base / "seed-data"),
            is_skip_checking=True,
            is_paused=False,
            use_auto_torrent_management=False,
        )
    seeding = {"uploading", "stalledUP", "forcedUP", "queuedUP"}
    wait_for(
        lambda: sum(t.state in seeding for t in client.torrents_info()) == len(items),
        90,
        interval=0.5,
        what=f"the seeder to seed all {len(items)} torrents",
    )
    finished_log = base / "finished.txt"
    lenient = {"Preferences": {"WebUI/HostHeaderValidation": False, "WebUI/CSRFProtection": False}}
    managed = qbt_factory("managed", on_finished=f'sh -c "echo %K >> {finished_log}"', extra_config=lenient)
    managed.client().app_set_preferences(UNLIMITED)
    (base / "library").mkdir()
    (base / "downloads").mkdir()
    return SoakSwarm(seeder, managed, items, base / "library", base / "downloads", finished_log)


# ------------------------------------------------------------------------------ helpers


TRANSIENT_WAIT_S = 90.0


def retrying(what: str, fn: Callable[[], Any], errors: list[str]) -> Any:
    """Client side of the chaos: the test's own calls meet killed connections and a dead
    Redis too; retry them (every call here is idempotent) and remember what was seen."""
    deadline = time.monotonic() + TRANSIENT_WAIT_S
    while True:
        try:
            return fn()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise
            errors.append(f"{what}: {type(exc).__name__}")
            time.sleep(0.3)


@dataclass
class Chaos:
    """The fault driver: one thread, bounded, seeded."""

    procs: ProcessGroup
    env: dict[str, str]
    rng: random.Random
    broker: PrivateRedis
    database: PrivatePostgres
    stop: threading.Event = field(default_factory=threading.Event)
    counts: Counter[str] = field(default_factory=Counter)
    log: list[str] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)
    frozen: set[str] = field(default_factory=set)
    serial: int = 0
    exits: int = 0  # workers that exited by themselves (restarted by `supervise`)
    lock: threading.Lock = field(default_factory=threading.Lock)
    timers: list[threading.Thread] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def note(self, msg: str) -> None:
        self.log.append(f"{time.monotonic() - self.started:7.1f}s {msg}")

    def start_worker(self, wait: bool = True) -> str:
        self.serial += 1
        name = f"w{self.serial}"
        self.procs.worker(name, concurrency=2, env=self.env, wait=wait)
        self.workers.append(name)
        return name

    def alive(self) -> list[str]:
        return [w for w in self.workers if self.procs.procs[w].poll() is None]

    def supervise(self) -> None:
        """Restart workers that exited by themselves, as a process supervisor would.

        None should: kombu's Redis transport used to kill a worker on a Redis restart
        (`restore_unacked` on a closed transport, "Unrecoverable error: AttributeError ...
        'hostname'"); `proj.transport.GuardedTransport` fixed that. A deployment would restart
        an exited worker (systemd, `restart:` in compose); so does this driver, the report
        counts it and the test then fails: the expected count is 0.
        """
        for name in [w for w in self.workers if self.procs.procs[w].poll() is not None]:
            code = self.procs.procs[name].poll()
            with self.lock:
                self.frozen.discard(name)
            self.workers.remove(name)
            repl = self.start_worker(wait=False)
            self.exits += 1
            self.note(f"{name} exited by itself (code {code}), replacement {repl}")

    def kill_worker(self) -> None:
        victim = self.rng.choice(self.alive())
        with self.lock:
            self.frozen.discard(victim)
        self.procs.kill(victim)
        self.workers.remove(victim)
        repl = self.start_worker(wait=False)
        self.note(f"SIGKILL {victim}, replacement {repl}")

    def stop_worker(self) -> bool:
        with self.lock:
            awake = [w for w in self.alive() if w not in self.frozen]
            if len(awake) < 2:
                return False  # keep one worker awake
            victim = self.rng.choice(awake)
            self.frozen.add(victim)
        pause = self.rng.uniform(LEASE_TTL_S + 1.0, LEASE_TTL_S + 4.0)
        self.procs.signal(victim, signal.SIGSTOP)
        self.note(f"SIGSTOP {victim} for {pause:.1f}s")

        def wake() -> None:
            time.sleep(pause)
            with self.lock:
                if victim in self.frozen:
                    self.frozen.discard(victim)
                    with contextlib.suppress(ProcessLookupError):
                        self.procs.signal(victim, signal.SIGCONT)

        t = threading.Thread(target=wake, daemon=True)
        t.start()
        self.timers.append(t)
        return True

    def restart_redis(self) -> None:
        down = self.rng.uniform(0.5, 2.0)
        self.broker.restart(down_s=down)
        self.note(f"Redis restarted ({down:.1f}s down)")

    def restart_pg(self) -> None:
        mode = self.rng.choice(["fast", "immediate"])
        self.database.restart(mode=mode)
        self.note(f"pg_ctl restart -m {mode}")

    def kill_pg(self) -> None:
        n = services.terminate_app_connections()
        self.note(f"pg_terminate_backend x{n}")

    def enough_redis_restarts(self) -> bool:
        return self.broker.restarts >= MIN_REDIS_RESTARTS

    def run(self, until: float, done: Callable[[], bool]) -> None:
        # Redis restarts weigh double; once every pipeline finished, only Redis restarts go on,
        # a little faster, until MIN_REDIS_RESTARTS (the workers must survive each one).
        kinds = ["kill_worker", "stop_worker", "restart_redis", "restart_redis", "kill_pg", "restart_pg"]
        while not self.stop.is_set() and sum(self.counts.values()) < MAX_FAULTS:
            finished = done()
            if time.monotonic() > until or (finished and self.enough_redis_restarts()):
                break
            if self.stop.wait(self.rng.uniform(2.0, 3.0) if finished else self.rng.uniform(2.0, 4.0)):
                break
            self.supervise()
            kind = "restart_redis" if finished else self.rng.choice(kinds)
            try:
                if kind == "kill_worker":
                    self.kill_worker()
                elif kind == "stop_worker":
                    if not self.stop_worker():
                        kind = "kill_pg"
                        self.kill_pg()
                elif kind == "restart_redis":
                    self.restart_redis()
                elif kind == "restart_pg":
                    self.restart_pg()
                else:
                    self.kill_pg()
                self.counts[kind] += 1
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.counts[f"{kind} (failed to inject)"] += 1
                self.note(f"{kind} failed: {exc!r}")
                if kind == "restart_redis" and not self.broker.answers():
                    with contextlib.suppress(Exception):
                        self.broker.start()

    def thaw_all(self) -> None:
        for t in self.timers:
            t.join(15)
        with self.lock:
            for w in list(self.frozen):
                with contextlib.suppress(ProcessLookupError):
                    self.procs.signal(w, signal.SIGCONT)
            self.frozen.clear()


def relay_hook(swarm: SoakSwarm, stop: threading.Event, errors: list[str], sent: Counter[str]) -> None:
    """qBittorrent's on-finish lines → `download:<infohash>` signals (a signal is only a hint)."""
    seen = 0
    while not stop.is_set():
        text = swarm.finished_log.read_text() if swarm.finished_log.exists() else ""
        lines = text.split("\n")[:-1]  # complete lines only
        for infohash in (line.strip() for line in lines[seen:]):
            topic = service.download_topic(infohash.lower())
            retrying("hook signal", lambda t=topic: runs.signal(t), errors)
            sent[infohash] += 1
        seen = len(lines)
        stop.wait(0.5)


def submit(item: Item, webhook: Receiver, engine: CeleryTaskEngine, errors: list[str]) -> None:
    """Request, then approve and signal: each retried until it went through once."""

    def request() -> None:
        with db.sessions().begin() as s:
            if s.get(DownloadTask, item.task_id) is None:
                service.request_download(
                    s,
                    requester="soak",
                    torrent=item.torrent,
                    webhook_url=webhook.url,
                    task_id=item.task_id,
                )

    retrying("request", request, errors)

    def approve() -> None:
        try:
            service.approve_and_signal(engine, db.sessions(), item.task_id, "soak")
        except service.RequestConflict:
            # An earlier try's approval committed and its reply or its signal was lost (a killed
            # connection, Redis down): the decision stands, only the wake-up is sent again.
            assert scalar(
                "SELECT approved_by FROM acq.approval WHERE download_task_id = %s", (item.task_id,)
            ) == ("soak")
            engine.signal(service.approval_topic(item.task_id))

    retrying("approve", approve, errors)


def done_count() -> int:
    """Pipelines whose acquire, import and notify runs all succeeded (the business rows are
    checked afterwards: a run that succeeded but left its task behind is a failure too)."""
    return int(
        scalar(
            "SELECT count(*) FROM acq.download_task t WHERE ("
            "SELECT count(*) FROM engine.task_run r WHERE r.status = 'succeeded' AND r.idempotency_key "
            "IN ('acquire:' || t.id, 'import:' || t.id, 'notify:' || t.id)) = 3"
        )
    )


def failed_runs() -> list[tuple[Any, ...]]:
    return sql(
        "SELECT kind, idempotency_key, status, last_error->>'step', last_error->>'type', "
        "left(last_error->>'message', 300) FROM engine.task_run WHERE status IN ('failed', 'canceled')"
    )


def safe(fn: Callable[[], Any], default: Any = None) -> Any:
    try:
        return fn()
    except Exception:
        return default


def run_table() -> str:
    rows = sql("SELECT kind, status, count(*) FROM engine.task_run GROUP BY 1, 2 ORDER BY 1, 2")
    return ", ".join(f"{k}/{s}={n}" for k, s, n in rows)


# ------------------------------------------------------------------------------ the soak


@pytest.fixture
def soak_procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path)
    yield group
    group.stop_all()


@pytest.fixture
def soak_broker(tmp_path: Path) -> Iterator[PrivateRedis]:
    """The soak's own Redis (it restarts it): workers, beat and this process all use it."""
    with private_redis(tmp_path) as server, use_broker(server.url):
        yield server


@pytest.fixture
def soak_database() -> Iterator[PrivatePostgres]:
    """The soak's own Postgres cluster (it restarts it), migrated; this process uses it too."""
    with private_postgres() as server:
        yield server


def test_chaos_soak(
    soak_swarm: SoakSwarm,
    soak_broker: PrivateRedis,
    soak_database: PrivatePostgres,
    soak_procs: ProcessGroup,
    webhook: Receiver,
    capsys,
) -> None:
    t0 = time.monotonic()
    swarm = soak_swarm
    items = swarm.items
    client_errors: list[str] = []
    report: list[str] = []

    env = {**swarm.worker_env(), "BROKER_URL": soak_broker.url, "DATABASE_URL": soak_database.url}
    chaos = Chaos(soak_procs, env, random.Random(SEED ^ 0x5EED), soak_broker, soak_database)
    for _ in range(WORKERS):
        chaos.start_worker()
    soak_procs.beat(env=env)
    setup_s = time.monotonic() - t0

    engine = CeleryTaskEngine()
    stop = threading.Event()
    hook_sent: Counter[str] = Counter()
    relay = threading.Thread(target=relay_hook, args=(swarm, stop, client_errors, hook_sent), daemon=True)
    relay.start()

    start = time.monotonic()
    feed_s = SECONDS * 0.4
    feed_done = threading.Event()

    def feed() -> None:
        try:
            for i, item in enumerate(items):
                submit(item, webhook, engine, client_errors)
                target = start + feed_s * (i + 1) / len(items)
                if (delay := target - time.monotonic()) > 0:
                    time.sleep(delay)
        finally:
            feed_done.set()

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()

    last = [0, 0.0]

    def all_done() -> bool:
        now = time.monotonic()
        if now - last[1] < 1.0:
            return last[0] >= len(items)
        last[0], last[1] = safe(done_count, last[0]), now
        return last[0] >= len(items)

    driver = threading.Thread(target=chaos.run, args=(start + SECONDS, all_done), daemon=True)
    driver.start()

    # Progress while the chaos runs: every pipeline finished, or the window plus settle is over.
    deadline = start + SECONDS + SETTLE_S
    next_print = start
    chaos_end: float | None = None
    first_all_done: float | None = None
    try:
        while True:
            n = safe(done_count, 0)
            now = time.monotonic()
            if chaos_end is None and not driver.is_alive():
                chaos_end = now
            if first_all_done is None and n >= len(items) and feed_done.is_set():
                first_all_done = now
            if now >= next_print:
                with capsys.disabled():
                    print(
                        f"[soak {now - start:6.1f}s] done {n}/{len(items)} faults "
                        f"{sum(chaos.counts.values())} | {safe(run_table, '?')}",
                        flush=True,
                    )
                next_print = now + 15
            if n >= len(items) and feed_done.is_set() and not driver.is_alive():
                break
            bad = [r for r in safe(failed_runs, []) if r[0] in ("acquire", "import", "notify")]
            if bad or now > deadline:
                break
            time.sleep(1.0)
        all_done_at = first_all_done or time.monotonic()
        chaos.stop.set()
        driver.join(60)
        chaos_end = chaos_end or time.monotonic()
        chaos.thaw_all()
        feeder.join(TRANSIENT_WAIT_S + 30)

        def explain() -> str:
            lines = [
                f"faults: {dict(chaos.counts)}, workers exited by themselves: {chaos.exits}",
                *chaos.log,
                f"runs: {safe(run_table, '?')}",
            ]
            lines += [f"failed/canceled: {r}" for r in safe(failed_runs, [])]
            lines += [f"stuck: {r}" for r in safe(stuck_runs, [])][:40]
            for name in soak_procs.procs:
                tail = soak_procs.log(name)[-2500:]
                if "Traceback" in tail or "ERROR" in tail:
                    lines.append(f"--- {name}\n{tail}")
            return "\n".join(lines)

        n = safe(done_count, 0)
        assert n == len(items), f"{n}/{len(items)} pipelines finished\n{explain()}"

        # Hand-offs that follow `notify` (retire_seed parks until its seeding goal) and the outbox.
        drain_t = time.monotonic()
        try:
            wait_for(
                lambda: drained(len(items)),
                120,
                interval=0.5,
                what="the outbox to drain and every retire_seed to park",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{explain()}") from exc
        drain_s = time.monotonic() - drain_t

        checks_t = time.monotonic()
        checked = check_invariants(swarm, webhook, hook_sent)
        checks_s = time.monotonic() - checks_t
    finally:
        stop.set()
        chaos.stop.set()
        chaos.thaw_all()

    stats = attempt_stats()
    total = time.monotonic() - t0
    report += [
        "=" * 78,
        f"CHAOS SOAK REPORT  seed={SEED}  pipelines={len(items)}  window={SECONDS:.0f}s  "
        f"lease={LEASE_TTL_S:g}s  workers={WORKERS}x2 + beat",
        f"durations: setup(workers+beat) {setup_s:.1f}s, all {len(items)} pipelines done after "
        f"{all_done_at - start:.1f}s, chaos window {chaos_end - start:.1f}s, outbox drain "
        f"{drain_s:.1f}s, checks {checks_s:.1f}s, test body {total:.1f}s",
        f"faults injected ({sum(chaos.counts.values())}): "
        + ", ".join(f"{k}={v}" for k, v in sorted(chaos.counts.items())),
        f"worker processes started in all: {chaos.serial}; Redis restarts: {soak_broker.restarts}; "
        f"worker exits: {chaos.exits} (supervisor restarts: {chaos.exits})",
        f"invariants checked ({sum(checked.values())}): " + ", ".join(f"{k}={v}" for k, v in checked.items()),
        f"engine: {stats}",
        f"client-side retries in the test process: {len(client_errors)} "
        + str(dict(Counter(e.split(":")[0] for e in client_errors))),
        f"webhook deliveries: {len(webhook.keys())} for {len(items)} keys "
        f"(re-sends with the same Idempotency-Key: {len(webhook.keys()) - len(set(webhook.keys()))})",
        "fault log:",
        *("  " + line for line in chaos.log),
        "=" * 78,
    ]
    text = "\n".join(report)
    (soak_procs.tmp / "soak-report.txt").write_text(text + "\n")
    with capsys.disabled():
        print("\n" + text, flush=True)
    assert chaos.exits == 0, f"{chaos.exits} worker(s) exited by themselves; see the fault log above"
    # The soak tested what it says: each kind of fault happened, few failed to, and Redis was
    # restarted as often as asked (unless the fault bound came first).
    injected = sum(chaos.counts.values())
    failed = sum(n for k, n in chaos.counts.items() if "failed to inject" in k)
    assert failed <= injected // 10, f"{failed} of {injected} faults could not be injected; see the log"
    never = [k for k in ("kill_worker", "restart_redis", "kill_pg", "restart_pg") if chaos.counts[k] == 0]
    assert not never, f"never injected: {never}"
    assert soak_broker.restarts >= MIN_REDIS_RESTARTS or injected >= MAX_FAULTS, (
        f"Redis restarted {soak_broker.restarts} times, fewer than {MIN_REDIS_RESTARTS}"
    )


def drained(n: int) -> bool:
    """The outbox holds nothing undispatched and every `retire_seed` is parked on its goal."""
    left = scalar("SELECT count(*) FROM outbox.outbox_event WHERE status <> 'dispatched'")
    parked = scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'retire_seed' AND status = 'waiting'")
    return left == 0 and parked == n


def stuck_runs() -> list[tuple[Any, ...]]:
    return sql(
        "SELECT r.kind, r.idempotency_key, r.status, r.current_step, s.status, s.attempts, "
        "s.wait_topic, s.error->>'message' FROM engine.task_run r JOIN engine.step s ON s.run_id = r.id "
        "AND s.stage = r.current_stage WHERE r.status NOT IN ('succeeded') AND r.kind <> 'retire_seed' "
        "ORDER BY r.created_at LIMIT 40"
    )


def attempt_stats() -> str:
    outcomes = dict(sql("SELECT coalesce(outcome, 'open'), count(*) FROM engine.attempt GROUP BY 1"))
    retried = scalar("SELECT count(*) FROM engine.step WHERE attempts > 1")
    ops = sql(
        "SELECT count(*) FILTER (WHERE attempts > 1), count(*) FILTER (WHERE resolution = 'reconciled') "
        "FROM ledger.asset_operation"
    )[0]
    return (
        f"step attempts by outcome {outcomes}; steps needing >1 attempt {retried}; "
        f"ledger ops re-attempted {ops[0]}, resolved by reconcile {ops[1]}"
    )


# ------------------------------------------------------------------------------ invariants


def check_invariants(swarm: SoakSwarm, webhook: Receiver, hook_sent: Counter[str]) -> dict[str, int]:
    """Every assertion reads the outside world; returns how many facts of each family held."""
    items = swarm.items
    n = len(items)
    checked: Counter[str] = Counter()
    by_task = {str(it.task_id): it for it in items}

    # 1. The library: each file present once, byte-identical; nothing else; no temp files.
    on_disk = sorted(p for p in swarm.library.rglob("*") if p.is_file())
    assert not [p for p in on_disk if ".part-" in p.name], "temp files left in the library"
    assert len(on_disk) == n, f"{len(on_disk)} files in the library for {n} pipelines"
    for it in items:
        path = swarm.library / str(it.task_id) / it.name
        assert path.is_file(), f"missing {path}"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == it.sha256, f"wrong bytes in {path}"
        checked["library file present with its sha256"] += 1
    checked["library holds nothing else"] += 1

    # 2. Exactly one acq.library_item per file, with the right size and hash.
    rows = sql("SELECT download_task_id::text, rel_path, size, sha256, status FROM acq.library_item")
    assert len(rows) == n, f"{len(rows)} library rows for {n} files"
    assert Counter(r[0] for r in rows) == Counter({k: 1 for k in by_task})
    for task_id, rel, size, sha, status in rows:
        it = by_task[task_id]
        assert (rel, size, sha, status) == (it.name, it.size, it.sha256, "ok"), (task_id, rel)
        checked["library_item once and right"] += 1

    # 3. The ledger: one result per op key, every op done; one qbt-add / copy / notify per task.
    ops = sql("SELECT op_key, status, result IS NOT NULL FROM ledger.asset_operation")
    keys = Counter(k for k, _, _ in ops)
    assert all(c == 1 for c in keys.values()), [k for k, c in keys.items() if c > 1]
    assert all(st == "done" and has for _, st, has in ops), [o for o in ops if o[1] != "done" or not o[2]]
    checked["ledger op done with one result"] += len(ops)
    for it in items:
        for key in (f"qbt-add:{it.task_id}", f"copy:{it.task_id}:0:{it.name}", f"notify:{it.task_id}"):
            assert keys[key] == 1, f"ledger has {keys[key]} of {key}"
            checked["ledger op per task present once"] += 1
    assert len(ops) == 3 * n, f"unexpected ledger ops: {sorted(set(keys) - expected_ops(items))[:10]}"

    # 4. qBittorrent: every torrent added once, tagged as ours, nothing else.
    torrents = swarm.managed.client().torrents_info()
    listed = Counter(t.hash.lower() for t in torrents)
    assert listed == Counter({it.infohash: 1 for it in items}), "managed torrents differ from the requests"
    assert all(qbt.MANAGED_TAG in t.tags for t in torrents)
    checked["torrent listed once, managed tag"] += len(torrents)

    # 5. Runs: none lost, none stuck, none failed; retire_seed parks on its seeding goal by design.
    runs_by = Counter((k, s) for k, s in sql("SELECT kind, status FROM engine.task_run"))
    for kind in ("acquire", "import", "notify"):
        assert runs_by[(kind, "succeeded")] == n, (kind, runs_by)
        checked[f"{kind} run succeeded"] += n
    assert runs_by[("retire_seed", "waiting")] == n, runs_by
    checked["retire_seed run parked"] += n
    open_states = ("pending", "running", "waiting", "failed", "canceled")
    live = {ks: c for ks, c in runs_by.items() if ks[1] in open_states}
    assert live == {("retire_seed", "waiting"): n}, f"runs not finished: {live}"
    per_key = sql(
        "SELECT kind, count(*) FROM engine.task_run WHERE kind IN ('acquire', 'import', 'notify', "
        "'retire_seed') GROUP BY kind"
    )
    assert dict(per_key) == dict.fromkeys(("acquire", "import", "notify", "retire_seed"), n)
    steps = sql(
        "SELECT r.kind, s.status, count(*) FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
        "WHERE s.status NOT IN ('succeeded') GROUP BY 1, 2"
    )
    assert {(k, st): c for k, st, c in steps} == {("retire_seed", "waiting"): n}, steps
    checked["no step left open"] += 1
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'compensate'") == 0
    checked["no compensation"] += 1

    # 6. Business rows and the outbox.
    statuses = Counter(s for (s,) in sql("SELECT status FROM acq.download_task"))
    behind = sql(
        "SELECT t.id, t.status, array_agg(e.what ORDER BY e.id) FROM acq.download_task t "
        "JOIN acq.task_event e ON e.download_task_id = t.id WHERE t.status <> 'notified' "
        "GROUP BY 1, 2 LIMIT 5"
    )
    assert statuses == Counter({"notified": n}), f"{statuses}; e.g. {behind}"
    checked["download_task notified"] += n
    box = Counter((k, s) for k, s in sql("SELECT kind, status FROM outbox.outbox_event"))
    assert box == Counter({(k, "dispatched"): n for k in ("acquire", "import", "notify", "retire_seed")}), box
    checked["outbox event dispatched"] += sum(box.values())

    # 7. The requester heard once per task (re-sends carry the same Idempotency-Key).
    assert set(webhook.keys()) == {f"notify:{it.task_id}" for it in items}
    checked["webhook key received"] += n

    # 8. The on-finish hook named only our torrents, and fired for all or nearly all of them.
    #    qBittorrent 4.5 does not run it for a torrent it finds complete when checking
    #    (qbittorrent/qBittorrent#19429; once in 80 torrents in one CI run). The download wait's
    #    own recheck (`ACQ_DOWNLOAD_RECHECK_S`) finds those, and checks 1-7 show they finished.
    #    A broken hook or relay would leave most of them missing, and fail here.
    ours = {it.infohash for it in items}
    assert set(hook_sent) <= ours, f"on-finish lines for torrents not ours: {sorted(set(hook_sent) - ours)}"
    missing = sorted(ours - set(hook_sent))
    assert len(missing) <= max(1, n // 20), f"no on-finish hook for {len(missing)} of {n}: {missing[:5]}"
    checked["on-finish hook fired"] += n - len(missing)
    checked["on-finish hook skipped by qBittorrent, found by the recheck"] += len(missing)
    return dict(checked)


def expected_ops(items: list[Item]) -> set[str]:
    out = set()
    for it in items:
        out |= {f"qbt-add:{it.task_id}", f"copy:{it.task_id}:0:{it.name}", f"notify:{it.task_id}"}
    return out
