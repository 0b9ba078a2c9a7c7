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
