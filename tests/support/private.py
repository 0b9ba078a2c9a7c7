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
