"""Private instances of the services, for tests that restart or break them (issue #18).

The machine's Redis (6379), Postgres (5432) and RabbitMQ are shared with other test runs, so a
fault test never restarts them: it starts its own Redis, Postgres cluster or PgBouncer on a free
port in its own directory, points the worker subprocesses (`DATABASE_URL`, `BROKER_URL`) and, with
`use_broker` / `use_database`, the test process itself at it, and stops it at teardown.
A missing binary fails the test with its name; nothing is skipped.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.services import _port_open, wait_for

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def free_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def need_binary(path: str | Path) -> str:
    """The binary's path, or fail the test loudly saying what to install."""
    found = shutil.which(str(path))
    if not found:
        pytest.fail(f"{path} is not installed (scripts/setup installs it)")
    return found


# ------------------------------------------------------------------------------ Redis


@dataclass
class PrivateRedis:
    """A throw-away `redis-server` (no persistence: a restart loses every queued message)."""

    dir: Path
    port: int = field(default_factory=free_port)
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                need_binary("redis-server"),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "yes",
                "--dir",
                str(self.dir),
                "--pidfile",
                str(self.dir / "redis.pid"),
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wait_for(self.answers, 30, what=f"private redis on {self.port}")

    def answers(self) -> bool:
        try:
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        except redis.exceptions.RedisError:
            return False

    def stop(self) -> None:
        """Shut this instance down (only ours: by its own port), dropping every message."""
        with contextlib.suppress(redis.exceptions.RedisError):
            redis.Redis(port=self.port, socket_timeout=2).shutdown(nosave=True)
        wait_for(lambda: not _port_open(self.port), 10, what=f"private redis {self.port} to stop")

    def restart(self, down_s: float = 0.5) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()
        self.restarts += 1


@contextlib.contextmanager
def private_redis(base: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(base / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def use_broker(url: str) -> Iterator[None]:
    """Point this process' Celery app (the test's own `enqueue`, `signal`) at another broker.

    kombu keeps connection and producer pools in a process-wide registry keyed by URL: the
    private broker's pools are closed and dropped from it at the end, the original ones are
    left as they were (closing them would leave a closed pool registered under their URL).
    """
    from proj.celery import app

    before = app.conf.broker_url
    _point_app_at(app, url)
    try:
        yield
    finally:
        _drop_current_pools(app)
        _point_app_at(app, before)


def _point_app_at(app: Any, url: str) -> None:
    app.conf.broker_url = url
    app._pool = None
    app.amqp._producer_pool = None


def _drop_current_pools(app: Any) -> None:
    from kombu import pools

    mine = [p for p in (app.amqp._producer_pool, app._pool) if p is not None]
    for pool in mine:
        with contextlib.suppress(Exception):
            pool.force_close_all()
    for group in (pools.producers, pools.connections):
        for key, pool in list(dict.items(group)):
            if any(pool is m for m in mine):
                dict.__delitem__(group, key)


def os_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pytest.fail(f"no OS user {name!r} (the postgresql package creates it)")


def chown_tree(path: Path, user: str) -> None:
    ent = os_user(user)
    for p in [path, *path.rglob("*")]:
        os.chown(p, ent.pw_uid, ent.pw_gid)


# ------------------------------------------------------------------------------ Postgres


@dataclass
class PrivatePostgres:
    """A throw-away Postgres 15 cluster (initdb, trust auth, loopback only) on its own port.

    It runs as the `postgres` OS user (initdb refuses root), in a directory under /tmp that user
    owns; `restart` is a real `pg_ctl restart` (fast mode by default): every session ends, the
    postmaster and its start time change.
    """

    root: Path
    port: int = field(default_factory=free_port)
    user: str = "postgres"
    database: str = "proj"
    extra: tuple[str, ...] = ()
    restarts: int = 0

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_owner(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        need_binary(PG_BIN / cmd[0])
        argv = [str(PG_BIN / cmd[0]), *cmd[1:]]
        if os.geteuid() == 0:
            argv = [need_binary("runuser"), "-u", self.user, "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.root / "postgres.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise AssertionError(f"{' '.join(cmd)} failed: {done.stdout}{done.stderr}\n{tail}")
        return done

    def _options(self) -> str:
        opts = [
            f"-p {self.port}",
            f"-k {self.root}",
            "-c listen_addresses=127.0.0.1",
            "-c fsync=off",
            "-c max_connections=100",
            *self.extra,
        ]
        return " ".join(opts)

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            chown_tree(self.root, self.user)
        self._as_owner("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    def start(self) -> None:
        self._as_owner(
            "pg_ctl", "-D", str(self.data), "-o", self._options(), "-l", str(self.root / "postgres.log"),
            "-w", "-t", "60", "start",
        )  # fmt: skip

    def restart(self, mode: str = "fast") -> None:
        """`pg_ctl restart -m <mode>`: every connection of every worker is cut."""
        self._as_owner(
            "pg_ctl", "-D", str(self.data), "-o", self._options(), "-l", str(self.root / "postgres.log"),
            "-m", mode, "-w", "-t", "60", "restart",
        )  # fmt: skip
        self.restarts += 1

    def stop(self, mode: str = "immediate") -> None:
        if (self.data / "postmaster.pid").exists():
            self._as_owner("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def clone_from(self, primary: PrivatePostgres) -> None:
        """Make this cluster a streaming replica of `primary` (`pg_basebackup -R`).

        `--checkpoint=fast`: the backup starts from an immediate checkpoint. With the default
        (spread) one, `pg_basebackup` waited about 90 s for the primary's checkpoint to pace
        itself out, most of each failover test's time."""
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            chown_tree(self.root, self.user)
        self._as_owner(
            "pg_basebackup", "-D", str(self.data), "-h", "127.0.0.1", "-p", str(primary.port),
            "-U", "postgres", "-X", "stream", "-R", "--checkpoint=fast",
        )  # fmt: skip

    def promote(self) -> None:
        """`pg_ctl promote`: the replica becomes a read-write primary."""
        self._as_owner("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def create_database(self) -> None:
        import psycopg

        with psycopg.connect(self.admin_url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')


def new_pg_root() -> Path:
    """A directory the `postgres` user can reach (pytest's tmp_path is root-only)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="proj-pg-", dir="/tmp"))


@contextlib.contextmanager
def use_database(url: str, **env: str) -> Iterator[None]:
    """Point this process (settings, the engine's pool, `services.sql`) at another database,
    with `env` (e.g. `DB_POOLER="transaction"`) set meanwhile."""
    from proj import db
    from proj.settings import get_settings

    saved = {k: os.environ.get(k) for k in ("DATABASE_URL", *env)}

    def apply(values: dict[str, str | None]) -> None:
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        get_settings.cache_clear()
        db.dispose()

    apply({"DATABASE_URL": url, **env})
    try:
        yield
    finally:
        apply(saved)


@contextlib.contextmanager
def private_postgres(root: Path | None = None, **kwargs: Any) -> Iterator[PrivatePostgres]:
    """A migrated private cluster (schema at head, the test kinds' tables), this process on it.

    `root`: an empty directory for it (e.g. a small tmpfs the test mounted); a fresh one under
    /tmp by default. Removed at the end either way."""
    from proj.cli import migrate_to_head
    from tests.support.services import create_testkit

    server = PrivatePostgres(root or new_pg_root(), **kwargs)
    server.init()
    server.start()
    try:
        server.create_database()
        with use_database(server.url):
            migrate_to_head()
            create_testkit()
            yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


# ------------------------------------------------------------------------------ PgBouncer


@dataclass
class PrivatePgBouncer:
    """Debian's `pgbouncer` on its own port, in front of one database, in one pool mode.

    Trust auth on loopback, run as the `postgres` OS user (it refuses root), its config, log and
    socket in a directory that user owns. Stopped by its own pid file, never by name.
    """

    upstream_port: int
    database: str
    mode: str = "transaction"
    pool_size: int = 40
    root: Path = field(default_factory=new_pg_root)
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    def _config(self) -> str:
        return "\n".join(
            [
                "[databases]",
                f"{self.database} = host=127.0.0.1 port={self.upstream_port} dbname={self.database}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                f"unix_socket_dir = {self.root}",
                "auth_type = trust",
                f"auth_file = {self.root / 'userlist.txt'}",
                f"pool_mode = {self.mode}",
                f"default_pool_size = {self.pool_size}",
                "max_client_conn = 1000",
                "ignore_startup_parameters = extra_float_digits",
                "idle_transaction_timeout = 60",  # as the README advises behind PgBouncer
                f"logfile = {self.root / 'pgbouncer.log'}",
                f"pidfile = {self.root / 'pgbouncer.pid'}",
                "",
            ]
        )

    def start(self) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        need_binary(binary)
        (self.root / "pgbouncer.ini").write_text(self._config())
        (self.root / "userlist.txt").write_text('"postgres" ""\n')
        argv = [binary, "-d", str(self.root / "pgbouncer.ini")]
        if os.geteuid() == 0:
            chown_tree(self.root, "postgres")
            argv = [need_binary("runuser"), "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            pytest.fail(f"pgbouncer did not start: {done.stdout}{done.stderr}")
        wait_for(lambda: _port_open(self.port), 30, what=f"pgbouncer on {self.port}")

    def stop(self) -> None:
        pidfile = self.root / "pgbouncer.pid"
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text().strip()), 15)
            wait_for(lambda: not _port_open(self.port), 15, what="pgbouncer to stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self) -> str:
        p = self.root / "pgbouncer.log"
        return p.read_text(errors="replace") if p.exists() else ""
