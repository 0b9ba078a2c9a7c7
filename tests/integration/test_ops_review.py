"""Operator paths of the engine under review: dead letters (retry, abandon), cancel, the sweeper
and retention, with real in-process workers and the sweeper on real Postgres and Redis.

Each test here failed on the code before its fix (see the commit naming it)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel

from proj.engine.context import StepContext
from proj.engine.errors import NonRetryable
from proj.engine.kind import Kind, RetryPolicy, child, register, step
from tests.conftest import new_key
from tests.kinds import mark_cancel
from tests.kinds_admin import ADMIN_DDL
from tests.support.services import scalar, sql, wait_for


class FamilyInput(BaseModel):
    key: str


def _mend_input(ctx: StepContext) -> dict[str, object]:
    # Slow enough (2 s of chunks) that the sweeper ticks several times while the child runs.
    return {"key": ctx.input.key, "chunks": 8, "chunk_s": 0.25}


# A parent whose child (`mendable`, tests/kinds_admin.py) fails until its business row is fixed.
MEND_PARENT = register(
    Kind(
        name="opsreview_parent",
        version=1,
        retry=RetryPolicy(max_attempts=2, initial_s=0.1, max_s=0.2),
        input_model=FamilyInput,
        canvas=(child("fetch_child", kind="mendable", input=_mend_input), step("after", lambda c: "done")),
    )
)


class DeafInput(BaseModel):
    slow_s: float = 1.5


def deaf_then_fails(ctx: StepContext) -> None:
    """Ignores a cancel request (no checkpoint), then fails for good."""
    time.sleep(ctx.input.slow_s)
    raise NonRetryable("gave up")


DEAF = register(
    Kind(
        name="opsreview_deaf",
        version=1,
        retry=RetryPolicy(max_attempts=2, initial_s=0.1, max_s=0.2),
        input_model=DeafInput,
        canvas=(step("work", deaf_then_fails), step("after", lambda c: "after")),
        on_cancel=mark_cancel,
        compensation="undo",
    )
)


def _status(run_id) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def _child_of(run_id):
    return scalar("SELECT id FROM engine.task_run WHERE parent_run_id = %s", (run_id,))


def test_a_failed_child_retried_under_a_dead_letter_parent_is_not_canceled_by_the_sweeper(inproc) -> None:
    """README: after a failed child, `proj resolve <child> --retry`, then the parent re-runs its
    step and finds the same, now succeeded, child. Once the parent has become a dead letter
    (its child step failed), the retried child must live on: the sweeper's orphan backstop
    canceled it (with its compensation) at its next tick, so the family could never recover."""
    from proj.engine import runs

    sql(ADMIN_DDL)
    key = new_key()
    ref = inproc.enqueue("opsreview_parent", {"key": key}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "failed", 30, what="the parent to become a dead letter")
    kid = _child_of(ref.task_run_id)
    assert _status(kid) == "failed"

    sql("INSERT INTO testkit_admin.fix (key, fixed) VALUES (%s, true)", (key,))
    assert runs.retry_failed(kid) == 1
    time.sleep(1.5)  # three sweeper ticks while the child copies
    assert scalar("SELECT cancel_requested_at FROM engine.task_run WHERE id = %s", (kid,)) is None
    wait_for(lambda: _status(kid) in ("succeeded", "canceled"), 20, what="the retried child to end")
    assert _status(kid) == "succeeded"
    assert runs.retry_failed(ref.task_run_id) == 1
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 20, what="the parent to go on")
    after = "SELECT result FROM engine.step WHERE run_id = %s AND name = 'after'"
    assert scalar(after, (ref.task_run_id,)) == "done"


def _undo_runs() -> int:
    return scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'undo'")


def _finished_at(run_id):
    return scalar("SELECT finished_at FROM engine.task_run WHERE id = %s", (run_id,))


def test_retry_of_a_run_past_its_deadline_writes_nothing(inproc) -> None:
    """A run that passed its deadline ended `failed` (DeadlineExceeded) and was compensated; no
    step of it may start again. A retry reopened it anyway: with its step canceled (parked when
    the deadline came) it returned 0, "nothing retried", yet wrote the run back to `running`
    with nothing to run; with its step failed (stopped at a checkpoint) it returned 1, "sent
    back to work", and the sweeper failed it again. Now: 0 and nothing written, both ways."""
    from proj.engine import runs

    parked = inproc.enqueue(
        "parked", {}, idempotency_key=new_key(), deadline_at=datetime.now(UTC) + timedelta(seconds=1.5)
    )
    slow = inproc.enqueue("deadlined", {"slow_s": 30}, idempotency_key=new_key())
    for ref in (parked, slow):
        wait_for(lambda r=ref: _status(r.task_run_id) == "failed", 20, what="the deadline to fail the run")
    wait_for(lambda: _undo_runs() == 2, 15, what="both compensations")
    for ref in (parked, slow):
        ended = _finished_at(ref.task_run_id)
        assert runs.retry_failed(ref.task_run_id) == 0
        assert (_status(ref.task_run_id), _finished_at(ref.task_run_id)) == ("failed", ended)
        assert (
            scalar(
                "SELECT count(*) FROM engine.step WHERE run_id = %s AND status = 'pending'",
                (ref.task_run_id,),
            )
            == 0
        )


def test_a_step_failing_after_a_cancel_request_ends_the_run_canceled(inproc) -> None:
    """A cancel asked while a step ran that ignored it (no checkpoint) and then failed for good:
    the run became a dead letter with its cancel request and no compensation (the torrent and
    temp files left behind). Invariant 8 says a cancel stops the run and compensates it: it now
    ends `canceled`, compensated once, and a retry has nothing to send back."""
    from proj.engine import runs

    ref = inproc.enqueue("opsreview_deaf", {}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "running", 10, what="the step to start")
    time.sleep(0.3)
    inproc.cancel(ref.task_run_id, "withdrawn")
    wait_for(lambda: _status(ref.task_run_id) in ("failed", "canceled"), 20, what="the step to give up")
    assert _status(ref.task_run_id) == "canceled"
    assert scalar(
        "SELECT status FROM engine.step WHERE run_id = %s AND name = 'work'", (ref.task_run_id,)
    ) == ("failed")
    assert (
        scalar("SELECT count(*) FROM engine.step WHERE run_id = %s AND name = 'after'", (ref.task_run_id,))
        == 0
    )
    wait_for(lambda: _undo_runs() == 1, 10, what="the compensation")
    assert runs.retry_failed(ref.task_run_id) == 0
    time.sleep(1.0)  # two sweeper ticks: still one compensation
    assert _undo_runs() == 1 and _status(ref.task_run_id) == "canceled"


def test_retry_of_a_dead_letter_asked_to_cancel_writes_nothing(inproc) -> None:
    """A dead letter that carries a cancel request (left by the code before the test above, or
    asked just as it failed) cannot have the request withdrawn by a retry: the retry returned 1
    ("sent back to work") and the run was then canceled and compensated by the sweeper. Now the
    retry writes nothing (abandon is the decision left), and abandon compensates it."""
    from proj.engine import runs

    ref = inproc.enqueue("opsreview_deaf", {"slow_s": 0.0}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "failed", 20, what="the dead letter")
    sql(
        "UPDATE engine.task_run SET cancel_requested_at = now(), cancel_reason = 'withdrawn' WHERE id = %s",
        (ref.task_run_id,),
    )
    ended = _finished_at(ref.task_run_id)
    assert runs.retry_failed(ref.task_run_id) == 0
    time.sleep(1.0)  # two sweeper ticks: what a reopened run with a cancel request comes to
    assert (_status(ref.task_run_id), _finished_at(ref.task_run_id)) == ("failed", ended)
    assert _undo_runs() == 0
    assert runs.abandon(ref.task_run_id, "operator") is True
    wait_for(lambda: _status(ref.task_run_id) == "canceled", 10, what="the abandon")
    wait_for(lambda: _undo_runs() == 1, 10, what="the compensation")


def test_a_run_of_a_version_this_process_does_not_know_does_not_stop_the_sweeper(published) -> None:
    """During a rollout an older beat meets runs of a newer version (or a newer beat one of a
    retired version). A cancel asked of such a run, with no step running, was finalized by the
    sweep, whose compensation needs the kind: `UnknownKind` rolled the whole sweep back, on
    every tick, so no expired lease was taken back and nothing was re-sent for any run. The
    run of the unknown version is left, untouched, to a process that serves it."""
    from proj.engine import sweeper

    alien = published_run("probe", idempotency_key=new_key())
    sql(
        "UPDATE engine.task_run SET version = 99, cancel_requested_at = now(), cancel_reason = 'x' "
        "WHERE id = %s",
        (alien,),
    )
    expired = published_run("probe", idempotency_key=new_key())
    sql(
        "UPDATE engine.step SET status = 'running', attempts = 1, lease_token = gen_random_uuid(), "
        "lease_owner = 'gone', lease_until = now() - interval '1 second' WHERE run_id = %s",
        (expired,),
    )
    report = sweeper.sweep()
    assert report.expired == 1
    assert scalar("SELECT status FROM engine.step WHERE run_id = %s", (expired,)) == "pending"
    assert (_status(alien), scalar("SELECT status FROM engine.step WHERE run_id = %s", (alien,))) == (
        "pending",
        "pending",
    )
    assert scalar("SELECT cancel_requested_at IS NOT NULL FROM engine.task_run WHERE id = %s", (alien,))


def test_a_parent_cancels_with_a_child_of_an_unknown_version(published) -> None:
    """A parent whose live child is of a version this process does not know (a rollout): the
    cascade asks the child's kind for its cancel hook, and `UnknownKind` refused the operator's
    cancel of the parent as a whole (and rolled back any sweep that failed or expired such a
    parent). Now the parent is canceled and the child is left, untouched, to a process serving
    its version (the orphan backstop of its sweep); this process' sweep goes on."""
    from proj.engine import runs, sweeper

    parent = published_run("probe", idempotency_key=new_key())
    child = published_run("probe", idempotency_key=new_key())
    sql("UPDATE engine.task_run SET version = 99, parent_run_id = %s WHERE id = %s", (parent, child))

    runs.cancel(parent, "operator")
    assert _status(parent) == "canceled"
    assert _status(child) == "pending"
    assert not scalar("SELECT cancel_requested_at IS NOT NULL FROM engine.task_run WHERE id = %s", (child,))
    sweeper.sweep()  # the orphan backstop meets the child: left, and the sweep commits
    assert _status(child) == "pending"


def published_run(kind: str, *, idempotency_key: str):
    from proj.engine import runs

    return runs.enqueue(kind, {}, idempotency_key=idempotency_key).task_run_id


def test_proj_resolve_and_cancel_say_why_a_dead_letter_was_not_retried(inproc) -> None:
    """`proj resolve --retry` of a dead letter that may not run again said "is not a failed
    run" of a run `proj show` lists as failed; it now says why, and that abandon is left.
    `proj cancel` of a dead letter points to abandon too."""
    from typer.testing import CliRunner

    import proj.cli as cli_mod

    ref = inproc.enqueue(
        "parked", {}, idempotency_key=new_key(), deadline_at=datetime.now(UTC) + timedelta(seconds=1)
    )
    rid = str(ref.task_run_id)
    wait_for(lambda: _status(ref.task_run_id) == "failed", 20, what="the deadline to fail the run")
    runner = CliRunner()
    out = runner.invoke(cli_mod.cli, ["resolve", rid, "--retry"], env={"COLUMNS": "250"})
    assert out.exit_code == 1
    assert "passed its deadline" in out.output and f"proj resolve {rid} --abandon" in out.output, out.output
    out = runner.invoke(cli_mod.cli, ["cancel", rid], env={"COLUMNS": "250"})
    assert out.exit_code == 1 and f"a dead letter: proj resolve {rid} --abandon" in out.output, out.output
    out = runner.invoke(cli_mod.cli, ["resolve", rid, "--abandon"], env={"COLUMNS": "250"})
    assert out.exit_code == 0 and "abandoned" in out.output, out.output
    wait_for(lambda: _status(ref.task_run_id) == "canceled", 10, what="the abandon")
    out = runner.invoke(cli_mod.cli, ["resolve", rid, "--retry"], env={"COLUMNS": "250"})
    assert out.exit_code == 1 and "is not a failed run (canceled)" in out.output, out.output
