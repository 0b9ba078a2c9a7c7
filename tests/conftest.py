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

# Under pytest-xdist (`scripts/test` runs the suite on two processes, `-n 2`), each process
# (`gw0`, `gw1`, …) has a database and a Redis database of its own: `proj_test_gw1`, db 5 + 1.
# Nothing else is shared between them that a test changes: the tests that restart or fill a
# service do it to a private one (`tests/support/private.py`), those that terminate connections
# do it in their own database, and the Docker tests run on one process (`SERIAL_GROUPS`).
XDIST = os.environ.get("PYTEST_XDIST_WORKER", "")
_XDIST_INDEX = int(XDIST[2:]) if XDIST.startswith("gw") and XDIST[2:].isdigit() else 0


def _per_process(db: str, broker: str) -> tuple[str, str]:
    """This process' database and broker when the suite runs on several (else unchanged)."""
    if not XDIST:
        return db, broker
    head, _, number = broker.rpartition("/")
    if broker.startswith("redis://") and number.isdigit():
        broker = f"{head}/{int(number) + _XDIST_INDEX}"
    else:
        raise RuntimeError(f"tests on several processes need a Redis broker with a database number: {broker}")
    return f"{db}_{XDIST}", broker


TEST_DB, BROKER = _per_process(
    os.environ.get("PROJ_TEST_DB", "proj_test"),
    os.environ.get("PROJ_TEST_BROKER", "redis://127.0.0.1:6379/5"),
)
PG_ADMIN_URL = os.environ.get("PROJ_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

# Set here unless the caller set them. The xdist controller runs this file too, and its workers
# inherit what it set: a worker takes its own over those (`PROJ_TEST_DEFAULTED` names them).
_DEFAULTS = {"DATABASE_URL": PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + TEST_DB, "BROKER_URL": BROKER}
_defaulted = set(filter(None, os.environ.get("PROJ_TEST_DEFAULTED", "").split(",")))
for _name, _value in _DEFAULTS.items():
    if _name not in os.environ or (XDIST and _name in _defaulted):
        os.environ[_name] = _value
        _defaulted.add(_name)
os.environ["PROJ_TEST_DEFAULTED"] = ",".join(sorted(_defaulted))
# `PROJ_TEST_PGBOUNCER=transaction|session`: the engine (workers and this process) reaches the
# test database through a private PgBouncer in that pool mode (scripts/test runs the engine's
# core tests so); the liveness sessions and the test's admin statements stay direct.
PGBOUNCER_MODE = os.environ.get("PROJ_TEST_PGBOUNCER", "")
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

# Under xdist, the tests of each group run on one process, in turn. "docker": the modules that
# build images and run Compose stacks (one image build, one shared stack, no two stacks' ports
# or names at once). "demo": the README's demo, whose embedded services live in fixed places.
SERIAL_GROUPS = {
    "test_compose.py": "docker",
    "test_compose_review.py": "docker",
    "test_pytest_celery.py": "docker",
    "test_demo.py": "demo",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if group := SERIAL_GROUPS.get(item.path.name):
            item.add_marker(pytest.mark.xdist_group(group))


def _utf8(text: str) -> str:
    """`text` with unpaired surrogates (a file name decoded with surrogateescape) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # noqa: ANN201
    """A report travels from an xdist process as UTF-8: a log line or an error holding such a
    surrogate (tests of bad file names log them) crashed the process that ran the test."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(name, _utf8(text)) for name, text in report.sections]
    if report.longrepr is not None and _utf8(str(report.longrepr)) != str(report.longrepr):
        report.longrepr = _utf8(str(report.longrepr))


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
