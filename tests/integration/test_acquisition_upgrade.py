"""Invariant 10 on the real pipeline: an import in flight on v1 finishes on v1 after the workers
are replaced by a build that also serves v2; imports queued after the upgrade run v2."""

from __future__ import annotations

import os
import signal

import pytest

from proj import db
from proj.acquisition import service
from proj.engine.celery_engine import CeleryTaskEngine
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Swarm
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import sha256_tree
from tests.support.services import dump_engine_state, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(300)

SLOW_COPY = {"COPY_CHUNK_BYTES": "65536", "FAULT_CHUNK_DELAY_S": "0.05"}


def request(swarm: Swarm):
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="carol", torrent=swarm.payload.torrent)
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    return task_id


def import_run(task_id):
    rows = sql(
        "SELECT id, version, status FROM engine.task_run WHERE idempotency_key = %s",
        (f"import:{task_id}",),
    )
    return rows[0] if rows else None


def steps_of(run_id) -> list[str]:
    return [
        r[0]
        for r in sql(
            "SELECT name FROM engine.step WHERE run_id = %s AND status = 'succeeded' "
            "ORDER BY stage, item_index",
            (run_id,),
        )
    ]


def test_upgrade_while_an_import_is_in_flight(procs, swarm: Swarm) -> None:
    old_env = swarm.worker_env(**SLOW_COPY)
    procs.worker("old", concurrency=2, env=old_env)
    procs.beat(env=old_env)
    first = request(swarm)
    wait_for(
        lambda: [p for p in swarm.library.rglob("*") if ".part-" in p.name],
        90,
        what="the first import copying on the old build",
    )
    assert import_run(first)[1] == 1

    new_env = {**old_env, "ENGINE_EXTRA_KINDS": os.environ["ENGINE_EXTRA_KINDS"] + ",tests.kinds_upgrade"}
    procs.worker("new", concurrency=2, env=new_env)
    procs.signal("old", signal.SIGTERM)  # warm shutdown: the running copy step commits first
    wait_for(lambda: procs.procs["old"].poll() is not None, 60, what="the old build to drain")
    second = request(swarm)
    try:
        wait_for(
            lambda: all((r := import_run(t)) and r[2] == "succeeded" for t in (first, second)),
            150,
            what="both imports to finish",
        )
    except AssertionError:
        print(dump_engine_state(), procs.log("new")[-4000:], sep="\n")
        raise

    run1, run2 = import_run(first), import_run(second)
    assert run1[1] == 1 and steps_of(run1[0])[-1] == "record", "the v1 run kept its v1 steps"
    assert "announce" not in steps_of(run1[0])
    assert run2[1] == 2 and steps_of(run2[0])[-1] == "announce", "new imports run v2"
    for task_id in (first, second):
        root = swarm.library / str(task_id) / swarm.payload.path.name
        assert sha256_tree(root) == swarm.payload.digests
    assert scalar("SELECT count(*) FROM acq.task_event WHERE what = 'imported by v2'") == 1
    ops = sql("SELECT op_key, status FROM ledger.asset_operation")
    assert len({k for k, _ in ops}) == len(ops) and all(st == "done" for _, st in ops)
