"""Postgres at `max_connections` (resource exhaustion, the database's side).

A private cluster with a small `max_connections`; the workers connect as an ordinary role, as
in production, and "other clients" of that role hold every slot left, so a new connection gets
"remaining connection slots are reserved" (a superuser, the test here, still gets in through
`superuser_reserved_connections`, as an operator's psql would). A worker starting then, and a
worker whose pooled connections were cut and must open new ones, must wait: not exit, not lose a
step, not spend attempts into a dead letter; once slots free up every run finishes once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from proj.engine import runs
from tests.conftest import new_key
from tests.support.private import PrivatePostgres, private_postgres
from tests.support.services import ProcessGroup, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(180)

ROLE = "app"


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    # 40 slots, 6 kept for superusers: the default worker budget (2 x 2 processes x 6 + 10
    # reserved = 34) fits exactly, so the preflight's arithmetic passes and only the slots run out.
    extra = ("-c max_connections=40", "-c superuser_reserved_connections=6")
    with private_postgres(extra=extra) as server:
        grant_role(server)
        yield server


def grant_role(server: PrivatePostgres) -> None:
    """An ordinary login role with the rights the workers use on every schema."""
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {ROLE} LOGIN")
        schemas = conn.execute(
            "SELECT nspname FROM pg_namespace"
            " WHERE nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'"
        ).fetchall()
        for (schema,) in schemas:
            for what in (
                "SCHEMA",
                "ALL TABLES IN SCHEMA",
                "ALL SEQUENCES IN SCHEMA",
                "ALL FUNCTIONS IN SCHEMA",
            ):
                conn.execute(f'GRANT ALL ON {what} "{schema}" TO {ROLE}')


def role_url(server: PrivatePostgres) -> str:
    return server.url.replace("postgres@", f"{ROLE}@")


class Hog:
    """Other clients of the workers' role, holding every slot they can get."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.held: list[psycopg.Connection] = []

    def fill(self) -> int:
        while True:
            try:
                self.held.append(psycopg.connect(self.url, autocommit=True, application_name="hog"))
            except psycopg.OperationalError as exc:
                assert "connection slots are reserved" in str(exc) or "too many clients" in str(exc), exc
                return len(self.held)

    def release(self) -> None:
        for conn in self.held:
            conn.close()
        self.held.clear()


def workers_sessions() -> int:
    return scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = %s AND application_name <> 'hog'", (ROLE,)
    )


def starve_workers(hog: Hog) -> None:
    """End the workers' sessions and let the hog take each slot as it frees (the terminated
    backends leave over a few milliseconds, and a worker's reaper reconnects every 0.25 s), until
    the workers hold none: their pools and liveness sessions must reconnect, and cannot."""
    for _ in range(20):
        sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s"
            " AND application_name <> 'hog'",
            (ROLE,),
        )
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            hog.fill()
            time.sleep(0.01)
        if workers_sessions() == 0:
            return
    raise AssertionError("the workers kept a connection through 20 cuts")


def succeeded(ids: list) -> int:
    return scalar("SELECT count(*) FROM engine.task_run WHERE id = ANY(%s) AND status = 'succeeded'", (ids,))


def test_workers_wait_for_a_connection_slot_and_spend_no_attempt(
    pg: PrivatePostgres, procs: ProcessGroup
) -> None:
    """Before: a worker started while the slots were taken exited at once ("worker refuses to
    start: … remaining connection slots are reserved"), and stayed down once they were free.
    Now it waits in its start-up checks and comes up when a slot frees; a running worker whose
    connections were cut claims nothing meanwhile (a claim that cannot connect spends no
    attempt, its message is re-sent by the sweeper), and every run finishes, each step once."""
    env = {"DATABASE_URL": role_url(pg), "INLINE_STEPS": "0", "REPUBLISH_AFTER_S": "2"}
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    warm = [runs.enqueue("probe", {"n": i}, idempotency_key=new_key()).task_run_id for i in range(2)]
    wait_for(lambda: succeeded(warm) == len(warm), 30, what="the warm-up runs")

    hog = Hog(role_url(pg))
    try:
        assert hog.fill() > 0 and workers_sessions() > 0
        starve_workers(hog)
        procs.worker("w2", concurrency=1, env=env, wait=False)  # starts on a full Postgres
        ids = [runs.enqueue("probe", {"n": i}, idempotency_key=new_key()).task_run_id for i in range(4)]
        time.sleep(6)  # several sweeps and re-sends, each turned away
        assert procs.procs["w2"].poll() is None, f"w2 exited:\n{procs.log('w2')[-3000:]}"
        assert procs.procs["w1"].poll() is None, f"w1 exited:\n{procs.log('w1')[-3000:]}"
        assert " ready." not in procs.log("w2")  # still in its start-up checks
        assert scalar("SELECT count(*) FROM engine.step WHERE run_id = ANY(%s) AND attempts > 0", (ids,)) == 0
        assert scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'") == 0
    finally:
        hog.release()

    wait_for(lambda: " ready." in procs.log("w2"), 30, what="w2 to start once a slot is free")
    wait_for(lambda: succeeded(ids) == len(ids), 60, what="every run to finish once slots are free")
    everything = warm + ids
    per_step = sql(
        "SELECT name, count(*), max(attempts) FROM engine.step"
        " WHERE run_id = ANY(%s) AND status = 'succeeded'"
        " GROUP BY 1 ORDER BY 1",
        (everything,),
    )
    assert per_step == [(f"s{i}", len(everything), 1) for i in range(1, 6)]  # each once, first attempt
    rerun = sql(
        "SELECT run_id, step FROM testkit.execution WHERE ended_at IS NOT NULL"
        " GROUP BY 1, 2 HAVING count(*) > 1"
    )
    assert rerun == []
    assert all(p.poll() is None for p in procs.procs.values()), "a worker or beat exited"
