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


def test_a_cancel_asked_while_a_fan_out_item_runs_ends_the_run_at_that_items_commit(
    published, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel asked while one item of a fan-out runs cannot end the run yet (a lease is live);
    the item's commit is the moment it can. With a sibling still `pending` (its message not yet
    delivered) the commit saw the stage open and returned, so the run stayed `running`, cancel
    requested, until the sweeper's next pass finished it. Now the commit finishes the cancel:
    the run is `canceled` and the pending sibling with it, with no sweep."""
    from tests import kinds

    ref = runs.enqueue("fanfirst", {"items": 2}, idempotency_key=new_key())
    items = [
        r[0]
        for r in sql("SELECT id FROM engine.step WHERE run_id = %s ORDER BY item_index", (ref.task_run_id,))
    ]
    record = kinds.record

    def cancel_then_record(ctx):  # the operator's cancel lands while the item's body runs
        assert runs.cancel(ref.task_run_id, "changed my mind").landed
        return record(ctx)

    monkeypatch.setattr(kinds, "record", cancel_then_record)
    protocol.execute(items[0], starts_run=True)

    assert _run_status(ref.task_run_id) == "canceled"
    assert sql(
        "SELECT item_index, status FROM engine.step WHERE run_id = %s ORDER BY item_index",
        (ref.task_run_id,),
    ) == [(0, "succeeded"), (1, "canceled")]


def _after_steps_running() -> list[tuple[int, object]]:
    return [
        (r[0], r[1])
        for r in sql(
            "SELECT id, run_id FROM engine.step WHERE name = 'after' AND status = 'running' ORDER BY id"
        )
    ]


def _interfere_after_first_chain(monkeypatch: pytest.MonkeyPatch, interfere) -> list[int]:
    """Run the chunk's first carried chain, then `interfere` with one of the claimed `after`
    steps still waiting their turn, then let the heartbeat renew once (as its thread does)."""
    from proj.engine.heartbeat import HEARTBEAT

    chosen: list[int] = []
    run_chain = protocol._run_chain

    def first_then_interfere(c):
        outcome = run_chain(c)
        if not chosen:
            waiting = [(i, r) for i, r in _after_steps_running() if i != c.step_id]
            step_id, run_id = waiting[-1]
            interfere(step_id, run_id)
            chosen.append(step_id)
            with HEARTBEAT._lock:
                leases = list(HEARTBEAT._leases.values())
            HEARTBEAT.renew(leases)
        return outcome

    monkeypatch.setattr(protocol, "_run_chain", first_then_interfere)
    return chosen


def test_a_claimed_step_whose_lease_was_taken_while_it_waited_its_turn_does_not_run(
    procs,
    wake_batch,  # noqa: F811
    untraced,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next steps a chunk's commit claimed wait their turn, kept alive by the heartbeat
    (`HEARTBEAT.track_many`), which also learns when one of those leases was taken over. Its
    body's own `track` used to start a fresh lease record and drop that signal, so the body ran
    on a lease another worker held; now it does not start (`lease_lost`, nothing written)."""
    ids = woken_chunk(procs)

    def take_over(step_id, _run_id):  # as a sweep and another worker's claim would
        sql("UPDATE engine.step SET lease_token = gen_random_uuid() WHERE id = %s", (step_id,))

    chosen = _interfere_after_first_chain(monkeypatch, take_over)
    protocol.execute(
        ids[0], more=ids[1:], starts_run=True, task=("gated.v1.approval", "gated.v1"), limited=False
    )
    assert len(chosen) == 1
    run_of_chosen = scalar("SELECT run_id FROM engine.step WHERE id = %s", (chosen[0],))
    assert (
        scalar(
            "SELECT count(*) FROM testkit.execution WHERE step = 'after' AND run_id = %s", (run_of_chosen,)
        )
        == 0
    ), "the body of the step whose lease was taken did not run"
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 7
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (chosen[0],)) == "running"


def test_a_claimed_step_whose_run_was_canceled_while_it_waited_its_turn_does_not_run(
    procs,
    wake_batch,  # noqa: F811
    untraced,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As above, with a cancel asked of the run of a step waiting its turn: the heartbeat saw
    it, and the step used to run its body all the same; now the run ends `canceled` without it."""
    ids = woken_chunk(procs)

    def cancel(_step_id, run_id):
        assert runs.cancel(run_id, "no longer wanted").landed

    chosen = _interfere_after_first_chain(monkeypatch, cancel)
    protocol.execute(
        ids[0], more=ids[1:], starts_run=True, task=("gated.v1.approval", "gated.v1"), limited=False
    )
    run_of_chosen = scalar("SELECT run_id FROM engine.step WHERE id = %s", (chosen[0],))
    assert (
        scalar(
            "SELECT count(*) FROM testkit.execution WHERE step = 'after' AND run_id = %s", (run_of_chosen,)
        )
        == 0
    ), "the canceled run's body did not run"
    assert _run_status(run_of_chosen) == "canceled"
    assert scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 7


def test_a_finish_whose_transaction_did_not_commit_is_not_taken_as_committed(
    published, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ctx.finish(result)` joins the step's success to the body's transaction. The ladder used
    to take that success as committed once the statements ran, before the COMMIT: a COMMIT that
    failed (here a deferred unique constraint), swallowed by the body, left the step `running`
    while the ladder went on to run the next step on a claim that had rolled back with it. Now
    the success counts only once its transaction committed, and a body that returns after a
    `finish` that did not is a failed attempt (retried by its policy)."""
    monkeypatch.setenv("INLINE_STEPS", "4")
    get_settings.cache_clear()
    ref = runs.enqueue("finisher", {"fail_at_commit_swallowed": True}, idempotency_key=new_key())

    outcome = protocol.execute(first_step(ref.task_run_id), starts_run=True)

    assert outcome == "retry"
    after = "SELECT count(*) FROM testkit.execution WHERE run_id = %s AND step = 'after'"
    assert scalar(after, (ref.task_run_id,)) == 0
    assert sql("SELECT name, status, attempts FROM engine.step WHERE run_id = %s", (ref.task_run_id,)) == [
        ("write", "pending", 1)
    ]
    assert scalar("SELECT count(*) FROM testkit.deferred WHERE k = %s", (str(ref.task_run_id),)) == 0
