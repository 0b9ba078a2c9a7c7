"""The engine behind PgBouncer (issue #18, item 6).

Every PgBouncer here is a private one (Debian's `pgbouncer`, its own port and config) in front
of the test database. What transaction pooling breaks, and what the engine does about it:
- prepared statements: psycopg prepares a statement after 5 executions; the next transaction
  may run on another server connection, which does not know it. `DB_POOLER=transaction` turns
  preparing off (`proj.db.pooler_params`);
- session advisory locks (the liveness sessions): they stay on a server connection, not on
  our process; `LIVENESS_DATABASE_URL` keeps them on a direct connection, and a worker that
  meets a transaction pooler without these settings refuses to start, saying what to set;
- session settings: the engine issues no `SET` (a session setting would leak to other clients).
The whole engine suite through PgBouncer: `PROJ_TEST_PGBOUNCER=transaction` (scripts/test).
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from proj.engine import runs
from proj.engine.preflight import transaction_pooled
from tests.conftest import TEST_DB, new_key
from tests.support.private import PrivatePgBouncer, use_database
from tests.support.services import ProcessGroup, scalar, wait_for

pytestmark = pytest.mark.timeout(240)

DIRECT = f"postgresql://postgres@127.0.0.1:5432/{TEST_DB}"


def _bouncer(mode: str) -> Iterator[PrivatePgBouncer]:
    bouncer = PrivatePgBouncer(upstream_port=5432, database=TEST_DB, mode=mode)
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture
def transaction_bouncer() -> Iterator[PrivatePgBouncer]:
    yield from _bouncer("transaction")


@pytest.fixture
def session_bouncer() -> Iterator[PrivatePgBouncer]:
    yield from _bouncer("session")


def test_a_transaction_pooler_is_detected_and_a_session_pooler_is_not(
    transaction_bouncer: PrivatePgBouncer, session_bouncer: PrivatePgBouncer
) -> None:
    assert transaction_pooled(transaction_bouncer.url)
    assert not transaction_pooled(session_bouncer.url)
    assert not transaction_pooled(DIRECT)


def _run_prepared_across_servers(url: str, **params: object) -> None:
    """Execute one statement 8 times (psycopg prepares it at the 5th) while another client
    holds the server connection it was prepared on, inside a transaction, in between."""
    with psycopg.connect(url, autocommit=True, **params) as a, psycopg.connect(url, autocommit=True) as b:
        for i in range(8):
            a.execute("SELECT %s::int + 1", (i,)).fetchone()
            with b.transaction():  # takes the server connection `a` just released
                b.execute("SELECT 1").fetchone()
                a.execute("SELECT %s::int + 1", (i,)).fetchone()  # so `a` runs on another


def test_prepared_statements_break_behind_a_transaction_pooler_unless_turned_off(
    transaction_bouncer: PrivatePgBouncer,
) -> None:
    with pytest.raises(psycopg.errors.InvalidSqlStatementName, match="does not exist"):
        _run_prepared_across_servers(transaction_bouncer.url)  # psycopg's default: prepare at 5
    _run_prepared_across_servers(transaction_bouncer.url, prepare_threshold=None)


def _refusal(env: dict[str, str], tmp_path) -> str:
    """Start a real worker and return what it printed when it refused to start."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(tmp_path)
    try:
        proc = group.worker("refused", concurrency=1, env=env, wait=False)
        proc.wait(90)
        return group.log("refused")
    finally:
        group.stop_all()


def test_a_worker_refuses_a_transaction_pooler_it_was_not_configured_for(
    transaction_bouncer: PrivatePgBouncer, tmp_path
) -> None:
    base = {"DATABASE_URL": transaction_bouncer.url, "LIVENESS_DATABASE_URL": "", "DB_POOLER": "none"}
    log = _refusal(base, tmp_path / "a")
    assert "worker refuses to start" in log and "set DB_POOLER=transaction" in log, log[-2000:]
    log = _refusal({**base, "DB_POOLER": "transaction"}, tmp_path / "b")
    assert "worker refuses to start" in log and "LIVENESS_DATABASE_URL" in log, log[-2000:]
    through = {**base, "DB_POOLER": "transaction", "LIVENESS_DATABASE_URL": transaction_bouncer.url}
    log = _refusal(through, tmp_path / "c")
    assert "worker refuses to start" in log and "LIVENESS_DATABASE_URL" in log, log[-2000:]


def _executions(run_id: object, step: str) -> int:
    return scalar("SELECT count(*) FROM testkit.execution WHERE run_id = %s AND step = %s", (run_id, step))


def _succeeded(ids: list) -> int:
    return scalar("SELECT count(*) FROM engine.task_run WHERE id = ANY(%s) AND status = 'succeeded'", (ids,))


def test_the_engine_runs_behind_transaction_pooling_with_direct_liveness(
    transaction_bouncer: PrivatePgBouncer, procs: ProcessGroup
) -> None:
    """Workers and beat on PgBouncer (transaction mode), liveness direct: runs of five steps
    (each statement far more than 5 times: prepared statements would fail), a kill -9 of a
    worker recovered in seconds through the direct liveness sessions, not by its 15 s lease."""
    env = {
        "DATABASE_URL": transaction_bouncer.url,
        "DB_POOLER": "transaction",
        "LIVENESS_DATABASE_URL": DIRECT,
        "LEASE_TTL_S": "15",
    }
    with use_database(transaction_bouncer.url, DB_POOLER="transaction"):
        procs.worker("victim", concurrency=1, env=env)
        refs = [runs.enqueue("probe", {"n": i}, idempotency_key=new_key()) for i in range(10)]
        slow = runs.enqueue("probe", {"slow_step": "s2", "slow_s": 60.0}, idempotency_key=new_key())
        wait_for(lambda: _executions(slow.task_run_id, "s2"), 60, what="the slow step to start")
        procs.worker("rescuer", concurrency=2, env=env)
        procs.beat(env=env)
        procs.kill("victim")
        wait_for(lambda: _executions(slow.task_run_id, "s2") == 2, 10, what="s2 again within seconds")
        ids = [r.task_run_id for r in refs]
        wait_for(lambda: _succeeded(ids) == 10, 90, what="the runs to finish behind PgBouncer")
    assert "prepared statement" not in procs.log("rescuer")
