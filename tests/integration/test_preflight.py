"""Invariant 12 and the schema gate: a worker refuses to start rather than run unsafely."""

from __future__ import annotations

import pytest

from proj.engine.errors import ConnectionBudgetExceeded
from proj.engine.preflight import check_connection_budget, connection_budget
from proj.settings import Settings
from tests.support.services import sql, wait_for


def test_budget_arithmetic() -> None:
    s = Settings(
        db_pool_size=5, db_max_overflow=5, worker_concurrency=4, expected_workers=3, reserved_connections=10
    )
    b = connection_budget(s, max_connections=100, superuser_reserved=3)
    # 12 processes x (5 + 5 pooled + 1 liveness session) + 10 reserved
    assert (b.worst_case, b.max_connections, b.fits) == (142, 97, False)
    leases_only = connection_budget(s.model_copy(update={"reap_interval_s": 0}), 100, 3)
    assert leases_only.worst_case == 130


def test_budget_refused_against_the_real_server() -> None:
    with pytest.raises(ConnectionBudgetExceeded, match="max_connections"):
        check_connection_budget(Settings(db_pool_size=40, db_max_overflow=10))
    assert check_connection_budget(Settings()).fits


def test_worker_refuses_an_impossible_budget(procs) -> None:
    p = procs.worker("greedy", env={"DB_POOL_SIZE": "60"}, wait=False)
    wait_for(lambda: p.poll() is not None, 60, what="the worker to exit")
    assert p.returncode != 0
    assert "refuses to start" in procs.log("greedy")
    assert "max_connections" in procs.log("greedy")


def test_worker_refuses_a_schema_behind_the_code(procs) -> None:
    sql("UPDATE public.alembic_version SET version_num = '0000_old'")
    try:
        p = procs.worker("stale", wait=False)
        wait_for(lambda: p.poll() is not None, 60, what="the worker to exit")
        assert p.returncode != 0
        assert "proj migrate" in procs.log("stale")
    finally:
        from proj.engine.preflight import head_revision

        sql("UPDATE public.alembic_version SET version_num = %s", (head_revision(),))
