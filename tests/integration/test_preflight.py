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


def test_a_threads_worker_is_budgeted_as_one_process() -> None:
    """A worker's threads share its one pool and liveness session: `-P threads -c 16` needs one
    process' connections per worker. Before, it was counted as 16 processes and refused. A
    prefork worker counts its own `-c`, not `WORKER_CONCURRENCY`: before, `-c 16` beside the
    default `WORKER_CONCURRENCY=2` was counted as 2 processes and let through."""
    s = Settings(
        db_pool_size=3, db_max_overflow=2, worker_concurrency=16, expected_workers=2, reserved_connections=10
    )
    threads = connection_budget(s, 100, 3, concurrency=16, one_process=True)
    # 2 processes x (17 pooled: one per thread and the heartbeat's, + 2 overflow + 1 liveness)
    assert (threads.processes, threads.per_process, threads.worst_case, threads.fits) == (2, 20, 50, True)
    prefork = connection_budget(s.model_copy(update={"worker_concurrency": 2}), 100, 3, concurrency=16)
    assert (prefork.processes, prefork.worst_case, prefork.fits) == (32, 32 * 6 + 10, False)
    assert connection_budget(s.model_copy(update={"worker_concurrency": 2}), 100, 3).processes == 4


def test_a_threads_worker_sizes_its_pool_to_its_threads() -> None:
    """`-P threads -c 8`: eight step threads and the lease heartbeat share the process' pool, so
    it holds 9, not `DB_POOL_SIZE` (3), where they queued for a connection before (a heartbeat
    queued past the lease loses it). The worker's start-up (`worker_init`) sizes it; a prefork
    child keeps `DB_POOL_SIZE`."""
    from types import SimpleNamespace

    from proj import db
    from proj.celery import _preflight

    try:
        _preflight(sender=SimpleNamespace(pool_cls="threads", concurrency=8))
        assert db.get_engine().pool.size() == 9  # type: ignore[attr-defined]
        db.serve_threads(1)
        _preflight(sender=SimpleNamespace(pool_cls="prefork", concurrency=4))
        assert db.get_engine().pool.size() == 3  # type: ignore[attr-defined]
    finally:
        db.serve_threads(1)


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


def test_a_worker_budgets_its_own_pool_and_concurrency(procs) -> None:
    """The real worker passes its `-P` and `-c` to the budget: `-P threads -c 16` starts with
    `WORKER_CONCURRENCY=16` (one process, 2 x 20 + 10 connections), and runs a step; `-P prefork
    -c 16` is refused with the default `WORKER_CONCURRENCY` (32 processes x 6 + 10 > 97)."""
    from proj.engine import runs
    from tests.conftest import new_key

    procs.worker("threads", pool="threads", concurrency=16, env={"WORKER_CONCURRENCY": "16"})
    ref = runs.enqueue("probe", {"n": 1}, idempotency_key=new_key())
    status = "SELECT status FROM engine.task_run WHERE id = %s"
    wait_for(lambda: sql(status, (ref.task_run_id,)) == [("succeeded",)], 60, what="the run on -P threads")
    p = procs.worker("wide", concurrency=16, wait=False)
    wait_for(lambda: p.poll() is not None, 60, what="the prefork worker to exit")
    assert p.returncode != 0
    assert "this worker's -c" in procs.log("wide") and "max_connections" in procs.log("wide")


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
