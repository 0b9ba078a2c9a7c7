"""The step execution path and its recovery, reviewed: each test here forces one interleaving
(a monkeypatched function between two statements, or a clock past a deadline) that used to
run a step body on a stale lease, leave a step without a message, or keep a run from ending.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from proj.engine import protocol, runs
from proj.engine.sweeper import sweep
from proj.settings import get_settings
from tests.conftest import new_key
from tests.integration.test_wake_batches import untraced, wake_batch, woken_chunk  # noqa: F401
from tests.support.services import scalar, sql
from tests.support.steps import first_step


def test_next_steps_a_chunk_claimed_keep_their_lease_while_an_earlier_chain_runs(
    procs,
    wake_batch,  # noqa: F811
    untraced,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk's checks that held commit together, each claiming its run's next step for this
    process (`chain.commit_together`); those steps then run one chain after another. While the
    first chain runs longer than a lease, the next steps claimed for the others must stay
    leased: their leases used to be renewed by nobody, so a sweep taken meanwhile handed them
    back (`pending`, re-sent to any worker) while this process went on to run their bodies on
    stale tokens: each `after` body ran once for nothing, and again elsewhere."""
    ids = woken_chunk(procs)
    seen: list[int] = []
    run_chain = protocol._run_chain

    def slow_first_chain(c):  # the first carried chain runs longer than a lease, then a sweep
        outcome = run_chain(c)
        if not seen:
            time.sleep(get_settings().lease_ttl_s + 1.5)
            seen.append(
                scalar(
                    "SELECT count(*) FROM engine.step WHERE name = 'after' AND status = 'running' "
                    "AND lease_until > now()"
                )
            )
            sweep(wait=True)
        return outcome

    monkeypatch.setattr(protocol, "_run_chain", slow_first_chain)
    protocol.execute(
        ids[0], more=ids[1:], starts_run=True, task=("gated.v1.approval", "gated.v1"), limited=False
    )
    assert seen == [7], "the seven other claimed `after` steps kept their leases"
    assert scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 8
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 8


def test_a_start_message_skips_a_better_run_past_its_deadline(published) -> None:
    """A start step's delivery claims the pending run of higher priority instead of its own
    (`store.claims.CLAIM_START`). A better run past its deadline can start no step: chosen
    anyway, the claim took nothing, and the delivery's own run waited for the sweeper's re-send
    (`REPUBLISH_AFTER_S`, 30 s by default) although a worker had its message in hand. Now the
    choice skips runs past their deadline (the sweeper ends those), and the delivery starts its
    own run."""
    mine = runs.enqueue("probe", {"n": 1}, idempotency_key=new_key(), priority=0)
    late = runs.enqueue(
        "probe",
        {"n": 2},
        idempotency_key=new_key(),
        priority=5,
        deadline_at=datetime.now(UTC) + timedelta(seconds=0.5),
    )
    time.sleep(0.7)
    published.clear()

    assert protocol.execute(first_step(mine.task_run_id), starts_run=True) == "succeeded"

    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (mine.task_run_id,)) == "succeeded"
    assert sql("SELECT status, attempts FROM engine.step WHERE run_id = %s", (late.task_run_id,)) == [
        ("pending", 0)
    ], "the late run started nothing"


def _run_status(run_id) -> str:
    return str(scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)))


def test_a_fan_out_item_that_succeeds_while_its_siblings_are_parked_leaves_the_run_waiting(
    published,
) -> None:
    """Two items of a fan-out each start a child run and park until it finishes: the run is
    `waiting`. One child finishes and wakes its item, whose claim shows the run `running`; the
    item commits the child's result, and the other item is still parked. Nothing runs then, but
    the run stayed `running` (in /admin, `proj runs`, `proj_runs`) until the last child ended,
    hours for a download; now the item's commit leaves it `waiting`, as a park does."""
    ref = runs.enqueue("cfan", {"count": 2}, idempotency_key=new_key())
    items = [
        r[0]
        for r in sql("SELECT id FROM engine.step WHERE run_id = %s ORDER BY item_index", (ref.task_run_id,))
    ]
    for step_id in items:
        assert protocol.execute(step_id, starts_run=True) == "waiting"
    assert _run_status(ref.task_run_id) == "waiting"
    child = scalar(
        "SELECT id FROM engine.task_run WHERE parent_run_id = %s AND idempotency_key LIKE %s",
        (ref.task_run_id, "%:1"),
    )
    assert protocol.execute(first_step(child), starts_run=True) == "succeeded"
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (items[1],)) == "pending", "woken"

    assert protocol.execute(items[1], starts_run=True) == "succeeded"

    assert sql(
        "SELECT item_index, status FROM engine.step WHERE run_id = %s ORDER BY item_index",
        (ref.task_run_id,),
    ) == [(0, "waiting"), (1, "succeeded")]
    assert _run_status(ref.task_run_id) == "waiting"
