"""Postgres failover (issue #18, item 2): a streaming replica, the primary killed, the replica
promoted, workers reconnecting through a multi-host DATABASE_URL
(`postgresql://u@primary,replica/db?target_session_attrs=read-write`).

- Synchronous replication (`synchronous_standby_names = '*'`): every commit a worker or the
  test saw is on the replica, so nothing is lost and each effect happens once.
- Asynchronous replication: a commit acknowledged by the primary but not yet replicated is lost
  at failover. Here the step that POSTed and committed its result on the old primary is, on the
  promoted replica, still running with its ledger attempt open: its lease runs out, it runs
  again, and the ledger reconciles the POST with the receiver instead of sending it twice.
Recommended: synchronous replication (README: Postgres failover).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from proj.engine import runs
from tests.conftest import new_key
from tests.faults.test_faults_pg_restart import EFFECT_RUNS, _finished, _mid_step
from tests.integration.test_ledger import _effects_input, op_row
from tests.kinds_effects import Receiver, lines_for, read_journal
from tests.support.private import PrivatePostgres, new_pg_root, private_postgres, use_database
from tests.support.services import ProcessGroup, scalar, wait_for

pytestmark = pytest.mark.timeout(400)

PRIMARY = ("-c wal_level=replica", "-c max_wal_senders=5", "-c hot_standby=on")


def _one(url: str, query: str) -> object:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(query)
        row = cur.fetchone() if cur.description else None
        return row[0] if row else None


@contextlib.contextmanager
def _pair(sync: bool) -> Iterator[tuple[PrivatePostgres, PrivatePostgres, str]]:
    """A migrated primary and its streaming replica; this process on the multi-host URL.

    Synchronous replication is switched on once the replica streams (before, every commit,
    the migration's too, would wait for a standby that does not exist yet).
    """
    with private_postgres(extra=PRIMARY) as primary:
        replica = PrivatePostgres(new_pg_root(), extra=("-c hot_standby=on",))
        replica.clone_from(primary)
        replica.start()
        try:
            streaming = "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'"
            wait_for(lambda: _one(primary.url, streaming), 60, what="the replica to stream")
            if sync:
                _one(primary.url, "ALTER SYSTEM SET synchronous_standby_names = '*'")
                _one(primary.url, "SELECT pg_reload_conf()")
                sync_state = "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
                wait_for(lambda: _one(primary.url, sync_state), 30, what="synchronous replication")
            url = (
                f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{replica.port}/"
                f"{primary.database}?target_session_attrs=read-write"
            )
            with use_database(url):
                yield primary, replica, url
        finally:
            replica.stop()
            shutil.rmtree(replica.root, ignore_errors=True)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _start(procs: ProcessGroup, url: str) -> None:
    env = {"DATABASE_URL": url}
    procs.worker("w1", concurrency=2, env=env)
    procs.worker("w2", concurrency=2, env=env)
    procs.beat(env=env)


def _fail_over(primary: PrivatePostgres, replica: PrivatePostgres) -> None:
    primary.stop(mode="immediate")  # the primary host is lost
    replica.promote()


def test_sync_replication_failover_loses_nothing(
    procs: ProcessGroup, tmp_path: Path, receiver: Receiver
) -> None:
    with _pair(sync=True) as (primary, replica, url):
        _start(procs, url)
        # Commits the old primary acknowledged before the faults (the runs below hold every
        # worker process mid-step, so nothing else may have committed by then).
        before = [runs.enqueue("probe", {"n": 100 + i}, idempotency_key=new_key()) for i in range(4)]
        wait_for(lambda: _finished(before), 60, what="runs committed before the failover")
        refs, inputs = _mid_step(tmp_path, receiver)
        done = "SELECT array_agg(id) FROM engine.step WHERE status = 'succeeded'"
        committed = _one(primary.url, done)
        assert committed, "no step had committed before the failover: nothing would be checked"
        _fail_over(primary, replica)
        assert _one(replica.url, "SELECT pg_is_in_recovery()") is False
        # Every commit the old primary acknowledged is on the new one.
        kept = "SELECT count(*) FROM engine.step WHERE id = ANY(%s) AND status = 'succeeded'"
        assert scalar(kept, (committed,)) == len(committed)
        wait_for(lambda: _finished(refs), 240, what="every run to finish on the promoted replica")
        for inp in inputs:
            assert receiver.count(inp["op"]) == 1, inp["op"]
            assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
        assert scalar("SELECT count(*) FROM ledger.asset_operation WHERE status = 'done'") == 2 * EFFECT_RUNS
        assert all(p.poll() is None for p in procs.procs.values()), "a process exited"


def test_async_replication_failover_loses_a_commit_and_the_ledger_keeps_the_post_once(
    procs: ProcessGroup, tmp_path: Path, receiver: Receiver
) -> None:
    with _pair(sync=False) as (primary, replica, url):
        _start(procs, url)
        inp = _effects_input(tmp_path, receiver, hold_in="http", hold_when="after", hold_s=6.0)
        ref = runs.enqueue("effects", inp, idempotency_key=new_key())
        wait_for(lambda: read_journal(inp["journal"]), 60, what="the POST (its ledger attempt committed)")
        lsn = _one(primary.url, "SELECT pg_current_wal_lsn()::text")
        wait_for(
            lambda: _one(replica.url, f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn"),
            30,
            what="the replica to replay the attempt",
        )
        replica.stop(mode="fast")  # from now on the primary's commits reach no replica
        run_on_primary = f"SELECT status FROM engine.task_run WHERE id = '{ref.task_run_id}'"
        wait_for(lambda: _one(primary.url, run_on_primary) == "succeeded", 60, what="the old primary commit")
        primary.stop(mode="immediate")
        replica.start()
        replica.promote()
        # The lost commit: the run the old primary had finished is running again here, its POST
        # attempt open in the ledger.
        assert scalar(run_on_primary) == "running"
        assert op_row(f"http:{inp['op']}")["status"] != "done"
        wait_for(lambda: scalar(run_on_primary) == "succeeded", 120, what="the run to finish again")
        http = op_row(f"http:{inp['op']}")
        assert http["status"] == "done" and http["resolution"] == "reconciled", http
        assert receiver.count(inp["op"]) == 1  # reconciled with the receiver, not sent again
        assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
