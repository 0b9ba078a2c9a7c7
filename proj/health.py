"""The containers' HEALTHCHECK (`proj-healthcheck`, also `proj healthcheck`): exit 0 when this
container's process answers.

- worker: its Celery node (`celery@<hostname>`) answers a ping over the broker;
- admin: `/admin/healthz` answers on loopback; flower: `/healthcheck` answers;
- beat: Postgres and the broker answer (beat holds no port).

Why a module of its own, importing neither the CLI, SQLAlchemy nor the Celery app of the engine:
Docker runs the check every 10 s in each of four containers. Through `proj.cli` each run paid
the CLI's imports (alembic, SQLAlchemy: 0.6 s of CPU) and the worker's ping built the whole
app with every kind (1.1 s), about 37 % of one core on an idle stack, which a small NAS feels.
Here admin and flower import only the standard library, and worker and beat a bare Celery
client on the same broker settings (`tests/unit/test_health.py`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import urllib.request

ROLES = ("worker", "beat", "admin", "flower")
DEFAULT_PORTS = {"admin": 8088, "flower": 5555}
PATHS = {"admin": "/admin/healthz", "flower": "/healthcheck"}


def http_ok(url: str, timeout: float) -> bool:
    """Whether `url` answers 200 within `timeout` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
            return bool(r.status == 200)
    except OSError:
        return False


def _broker_client() -> object:
    """A bare Celery client on the broker the engine uses (same URL and transport), without the
    engine's app: the pidbox a worker answers pings on needs nothing else."""
    from celery import Celery

    from proj.settings import get_settings
    from proj.transport import transport_for

    s = get_settings()
    client = Celery("proj-health", broker=s.broker_url, set_as_current=False)
    client.conf.broker_transport = transport_for(s.broker_url, s.broker_transport)
    client.conf.broker_connection_retry_on_startup = False
    return client


def worker_answers(timeout: float) -> bool:
    """This host's Celery node answers a ping."""
    node = f"celery@{socket.gethostname()}"
    try:
        client = _broker_client()
        return bool(client.control.ping(destination=[node], timeout=timeout))  # type: ignore[attr-defined]
    except Exception:  # the broker is down: the worker cannot be answering
        return False


def beat_services_answer(timeout: float) -> bool:
    """Postgres answers `SELECT 1` and the broker accepts a connection."""
    import psycopg

    from proj.settings import get_settings, libpq_url

    s = get_settings()
    try:
        url = libpq_url(s.require_database_url())
        with psycopg.connect(url, connect_timeout=max(1, round(timeout)), autocommit=True) as conn:
            conn.execute("SELECT 1")
        client = _broker_client()
        with client.connection_for_write() as conn:  # type: ignore[attr-defined]
            conn.ensure_connection(max_retries=1, timeout=timeout)
    except Exception:
        return False
    return True


def check(role: str, timeout: float, port: int | None = None) -> tuple[bool, str]:
    """Whether the process of `role` answers, and what was asked. ValueError: unknown role."""
    if role in PATHS:
        at = port or DEFAULT_PORTS[role]
        return http_ok(f"http://127.0.0.1:{at}{PATHS[role]}", timeout), f"{role} on :{at}"
    if role == "worker":
        return worker_answers(timeout), f"worker celery@{socket.gethostname()}"
    if role == "beat":
        return beat_services_answer(timeout), "beat's Postgres and broker"
    raise ValueError(f"unknown role {role!r}: {', '.join(ROLES)}")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="proj-healthcheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--role", default=os.environ.get("PROJ_ROLE", "worker"), choices=ROLES)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds before it counts as unhealthy")
    env_port = os.environ.get("PROJ_HEALTH_PORT")
    p.add_argument("--port", type=int, default=int(env_port) if env_port else None)
    args = p.parse_args(argv)
    if not 0.1 <= args.timeout <= 3600:
        p.error("--timeout must be between 0.1 and 3600 seconds")
    if args.port is not None and not 1 <= args.port <= 65535:
        p.error("--port must be between 1 and 65535")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    ok, what = check(args.role, args.timeout, args.port)
    print(f"{what}: {'healthy' if ok else 'not answering'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
