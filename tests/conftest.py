"""Real services for the tests: a fresh Postgres database, a Redis database, real workers.

The environment is set before `proj` is imported, because settings are read once per process
and worker subprocesses inherit it. Services are started by the `database` fixture, not at
import, and tests under `tests/unit/` never ask for it: `pytest tests/unit` runs on a machine
with neither Postgres nor Redis (scripts/test runs it against unreachable URLs to prove it).
"""

from __future__ import annotations

import os
import uuid

import pytest

TEST_DB = os.environ.get("PROJ_TEST_DB", "proj_test")
PG_ADMIN_URL = os.environ.get("PROJ_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BROKER = os.environ.get("PROJ_TEST_BROKER", "redis://127.0.0.1:6379/5")

os.environ.setdefault("DATABASE_URL", PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + TEST_DB)
# `PROJ_TEST_PGBOUNCER=transaction|session`: the engine (workers and this process) reaches the
# test database through a private PgBouncer in that pool mode (scripts/test runs the engine's
# core tests so); the liveness sessions and the test's admin statements stay direct.
PGBOUNCER_MODE = os.environ.get("PROJ_TEST_PGBOUNCER", "")
os.environ.setdefault("BROKER_URL", BROKER)
os.environ.setdefault("LEASE_TTL_S", "3")
os.environ.setdefault("SWEEP_INTERVAL_S", "0.5")
os.environ.setdefault("REPUBLISH_AFTER_S", "5")
os.environ.setdefault(
    "ENGINE_EXTRA_KINDS",
    "tests.kinds,tests.kinds_effects,tests.kinds_admin,tests.kinds_limits,tests.kinds_children",
)
os.environ.setdefault("DB_POOL_SIZE", "3")
os.environ.setdefault("DB_MAX_OVERFLOW", "2")

# Subprocesses (workers, qBittorrent's on-finish hook) must import `tests.*` kinds too.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))

from tests.support import services  # noqa: E402

UNIT = os.path.join(_ROOT, "tests", "unit") + os.sep


def _through_pgbouncer(mode: str) -> None:
    import atexit

    from tests.support.private import PrivatePgBouncer

    bouncer = PrivatePgBouncer(upstream_port=5432, database=TEST_DB, mode=mode)
    bouncer.start()
    atexit.register(bouncer.stop)
    os.environ["LIVENESS_DATABASE_URL"] = os.environ["DATABASE_URL"]
    os.environ["DATABASE_URL"] = bouncer.url
    os.environ["DB_POOLER"] = mode
    services.recreate_database(PG_ADMIN_URL, TEST_DB)  # PgBouncer connects to it lazily

    from proj.engine.preflight import transaction_pooled  # imports `proj`: the env is set now

    if transaction_pooled(bouncer.url) != (mode == "transaction"):
        raise RuntimeError(f"PgBouncer on {bouncer.port} does not pool in {mode} mode")


if PGBOUNCER_MODE:
    _through_pgbouncer(PGBOUNCER_MODE)


import proj.celery  # noqa: E402,F401  the wiring (after the environment is final): every kind the tests name


@pytest.fixture(scope="session")
def database() -> str:
    """Start Postgres and Redis where they are not running, recreate the test database once per
    session and migrate it with `proj migrate`'s code."""
    services.ensure_postgres()
    services.ensure_redis()
    services.recreate_database(PG_ADMIN_URL, TEST_DB)
    from proj.cli import migrate_to_head

    migrate_to_head()
    services.create_testkit()
    return os.environ["DATABASE_URL"]


@pytest.fixture(autouse=True)
def clean_state(request: pytest.FixtureRequest) -> None:
    """Each test starts with empty engine, ledger, outbox and business tables and queues
    (a unit test asks for no service at all)."""
    if str(request.path).startswith(UNIT):
        return
    request.getfixturevalue("database")
    services.truncate_all()
    services.flush_broker()


@pytest.fixture
def engine():
    """The port, as business code sees it."""
    from proj.engine.celery_engine import CeleryTaskEngine

    eng = CeleryTaskEngine()
    yield eng
    eng.stop()


@pytest.fixture
def inproc(engine):
    """An in-process worker (thread pool) plus the sweeper loop: fast tests that kill nothing."""
    engine.start(roles=("worker", "beat"), concurrency=4)
    return engine


@pytest.fixture
def published(monkeypatch):
    """Messages the engine would send, recorded instead of sent (tests that call
    `protocol.execute` themselves and see which steps travelled as messages). A recorder, not a
    broker stand-in: the publish path itself runs on the real broker in every test that starts a
    worker (`procs`, `inproc`), and the RabbitMQ matrix runs the core ones again there."""
    from proj.engine import dispatch

    sent: list[dispatch.Dispatch] = []
    monkeypatch.setattr(dispatch, "publish_after_commit", lambda items: sent.extend(items))
    return sent


@pytest.fixture
def procs(tmp_path):
    """Real `celery -A proj worker|beat` subprocesses; all are killed at teardown."""
    group = services.ProcessGroup(tmp_path)
    yield group
    group.stop_all()


def new_key() -> str:
    return uuid.uuid4().hex
