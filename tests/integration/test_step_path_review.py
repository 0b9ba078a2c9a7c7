"""The step execution path and its recovery, reviewed: each test here forces one interleaving
(a monkeypatched function between two statements, or a clock past a deadline) that used to
run a step body on a stale lease, leave a step without a message, or keep a run from ending.
"""

from __future__ import annotations

import time

import pytest

from proj.engine import protocol
from proj.engine.sweeper import sweep
from proj.settings import get_settings
from tests.integration.test_wake_batches import untraced, wake_batch, woken_chunk  # noqa: F401
from tests.support.services import scalar


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
