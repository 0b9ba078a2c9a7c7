"""Postgres out of disk (resource exhaustion, the database's side).

The private cluster's data directory lies on a small tmpfs of its own, which another writer
fills while runs are mid-step: every write that needs a new page fails ("could not extend file
…: No space left on device"). Nothing may be lost, no worker may exit, no run may be
dead-lettered for it; once space is freed every run finishes, each step once, each external
effect (an HTTP POST, a file line, through the ledger) once. A machine where tmpfs cannot be
mounted fails this test with the reason.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.faults.test_faults_pg_restart import effects_and_probes
from tests.integration.test_ledger import op_row
from tests.kinds_effects import Receiver, lines_for
from tests.support.disks import fill
from tests.support.private import PrivatePostgres, private_postgres
from tests.support.services import ProcessGroup, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(240)

PROBES = 12
EFFECTS = 3


@pytest.fixture
def pg_on_small_disk() -> Iterator[tuple[PrivatePostgres, Path]]:
    root = Path(tempfile.mkdtemp(prefix="proj-pgdisk-", dir="/tmp"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=192m", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for Postgres' data (root needed): {mounted.stderr.decode()}")
    try:
        with private_postgres(root=root) as server:
            yield server, root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
        root.rmdir()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def assert_postgres_cannot_write(pg: PrivatePostgres) -> None:
    """The fault is real: a write that needs new pages is refused."""
    with psycopg.connect(pg.url, autocommit=True) as conn, pytest.raises(psycopg.errors.DiskFull):
        conn.execute(
            "CREATE TABLE public.probe_disk AS SELECT repeat('x', 1000) FROM generate_series(1, 20000)"
        )


def succeeded(ids: list) -> int:
    return scalar("SELECT count(*) FROM engine.task_run WHERE id = ANY(%s) AND status = 'succeeded'", (ids,))


def test_postgres_out_of_disk_mid_step_loses_nothing_and_repeats_no_effect(
    pg_on_small_disk: tuple[PrivatePostgres, Path], procs: ProcessGroup, receiver: Receiver, tmp_path: Path
) -> None:
    """Already right: while the disk is full the steps make no progress (their writes, their
    failures' records and the sweeper's all fail alike) but spend nothing into a dead letter, and
    the worker lives; freed, everything finishes once."""
    pg, root = pg_on_small_disk
    env = {"DATABASE_URL": pg.url, "INLINE_STEPS": "0", "REPUBLISH_AFTER_S": "2"}
    procs.worker("w", concurrency=2, env=env)
    procs.beat(env=env)
    refs, inputs = effects_and_probes(
        tmp_path, receiver, effects=EFFECTS, probes=PROBES, hold_s=2.0, slow_s=1.0
    )
    wait_for(lambda: receiver.count(inputs[0]["op"]) >= 1, 30, what="an effect done, its step not committed")

    filler = fill(root)
    assert_postgres_cannot_write(pg)
    time.sleep(6)  # steps finish their bodies, commit, fail, retry, lose leases: all on a full disk
    assert procs.procs["w"].poll() is None, f"the worker exited:\n{procs.log('w')[-3000:]}"
    assert scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'") == 0

    filler.unlink()  # the operator frees space
    ids = [r.task_run_id for r in refs]
    wait_for(lambda: succeeded(ids) == len(ids), 90, what="every run to finish once space is freed")
    steps = dict(sql("SELECT name, count(*) FROM engine.step WHERE status = 'succeeded' GROUP BY 1"))
    assert steps == {"deliver": EFFECTS, **{f"s{i}": PROBES for i in range(1, 6)}}
    rerun = sql(
        "SELECT run_id, step FROM testkit.execution WHERE ended_at IS NOT NULL"
        " GROUP BY 1, 2 HAVING count(*) > 1"
    )
    assert rerun == []  # no completed probe body ran again
    for inp in inputs:  # each effect once: one POST, one line, one ledger row per op, done
        assert receiver.count(inp["op"]) == 1, inp["op"]
        assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
        for kind in ("file", "http"):
            row = op_row(f"{kind}:{inp['op']}")
            assert row is not None and row["status"] == "done", row
    assert all(p.poll() is None for p in procs.procs.values()), "a worker or beat exited"
