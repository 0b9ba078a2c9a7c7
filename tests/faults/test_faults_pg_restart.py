"""A full Postgres restart while runs are mid-step (issue #18, item 1).

Not killed connections: `pg_ctl restart -m fast` (and `-m immediate`) of the workers' own
private cluster, so every session ends, the postmaster changes (its start time, so every
liveness lock) and for a few seconds nothing answers. Nothing is lost, each external effect
happens once (the HTTP receiver, the file, the ledger), and every run finishes without an
operator.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proj.engine import runs
from tests.conftest import new_key
from tests.integration.test_ledger import _effects_input, op_row
from tests.kinds_effects import Receiver, lines_for, read_journal
from tests.support.private import PrivatePostgres, private_postgres
from tests.support.services import ProcessGroup, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(400)

EFFECT_RUNS = 4
PROBE_RUNS = 12


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    with private_postgres() as server:
        yield server


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _start(procs: ProcessGroup, pg: PrivatePostgres) -> None:
    env = {"DATABASE_URL": pg.url}
    procs.worker("w1", concurrency=2, env=env)
    procs.worker("w2", concurrency=2, env=env)
    procs.beat(env=env)


def effects_and_probes(
    tmp_path: Path, receiver: Receiver, *, effects: int, probes: int, hold_s: float, slow_s: float
) -> tuple[list, list[dict]]:
    """Enqueue `effects` runs that hold `hold_s` after their POST (the effect done, its step not
    committed) and `probes` probe runs whose s2 takes `slow_s`: (the refs, the effects' inputs)."""
    inputs = [
        _effects_input(tmp_path / f"e{i}", receiver, hold_in="http", hold_when="after", hold_s=hold_s)
        for i in range(effects)
    ]
    for inp in inputs:
        Path(inp["path"]).parent.mkdir(parents=True, exist_ok=True)
    refs = [runs.enqueue("effects", inp, idempotency_key=new_key()) for inp in inputs]
    refs += [
        runs.enqueue("probe", {"n": i, "slow_step": "s2", "slow_s": slow_s}, idempotency_key=new_key())
        for i in range(probes)
    ]
    return refs, inputs


def _mid_step(tmp_path: Path, receiver: Receiver) -> tuple[list, list[dict]]:
    """Effects runs holding after their POST (done, not committed) and probe runs mid-step."""
    refs, inputs = effects_and_probes(
        tmp_path, receiver, effects=EFFECT_RUNS, probes=PROBE_RUNS, hold_s=3.0, slow_s=1.5
    )
    wait_for(
        lambda: (
            sum(bool(read_journal(inp["journal"])) for inp in inputs) >= 2
            and scalar("SELECT count(*) FROM engine.step WHERE status = 'running'") >= 3
        ),
        60,
        what="effects held after their POST and steps running",
    )
    return refs, inputs


def _finished(refs: list) -> bool:
    ids = [r.task_run_id for r in refs]
    return scalar(
        "SELECT count(*) FROM engine.task_run WHERE id = ANY(%s) AND status = 'succeeded'", (ids,)
    ) == len(ids)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_pg_ctl_restart_mid_step_loses_nothing_and_repeats_no_effect(
    pg: PrivatePostgres, procs: ProcessGroup, tmp_path: Path, receiver: Receiver, mode: str
) -> None:
    """`fast`: a clean shutdown (sessions terminated, a checkpoint); `immediate`: a crash of the
    server (no checkpoint, WAL recovery at start): the same outcome for both."""
    _start(procs, pg)
    refs, inputs = _mid_step(tmp_path, receiver)
    started_before = scalar("SELECT pg_postmaster_start_time()")
    running = scalar("SELECT count(*) FROM engine.step WHERE status = 'running'")
    pg.restart(mode=mode)
    restarted_at = time.monotonic()
    assert scalar("SELECT pg_postmaster_start_time()") > started_before
    wait_for(lambda: _finished(refs), 240, what="every run to finish after the restart")
    print(f"pg_ctl restart -m {mode} with {running} steps running: all {len(refs)} runs done after "
          f"{time.monotonic() - restarted_at:.1f}s")  # fmt: skip

    # Nothing lost: every run and every step of it, each committed once.
    assert scalar("SELECT count(*) FROM engine.task_run") == len(refs)
    steps = dict(sql("SELECT name, count(*) FROM engine.step WHERE status = 'succeeded' GROUP BY 1"))
    assert steps == {"deliver": EFFECT_RUNS, **{f"s{i}": PROBE_RUNS for i in range(1, 6)}}
    # Each effect once: one POST per op at the receiver, one line per op in its file, one ledger
    # row per op, done (a redo would show as a second POST or line).
    for inp in inputs:
        assert receiver.count(inp["op"]) == 1, inp["op"]
        assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
        for kind in ("file", "http"):
            row = op_row(f"{kind}:{inp['op']}")
            assert row is not None and row["status"] == "done", row
    assert scalar("SELECT count(*) FROM ledger.asset_operation") == 2 * EFFECT_RUNS
    # Completed probe steps never re-ran: an extra execution only where one was interrupted.
    extra = sql(
        "SELECT run_id, step FROM testkit.execution WHERE ended_at IS NOT NULL "
        "GROUP BY 1, 2 HAVING count(*) > 1"
    )
    assert extra == []
    # No operator: no worker exited, nothing dead-lettered.
    assert all(p.poll() is None for p in procs.procs.values()), "a process exited"
    assert scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'") == 0
