"""An outage of a service a step needs (`errors.Unavailable`) does not spend its attempts.

qBittorrent restarting for an upgrade, a webhook receiver down for a night: before, each such
attempt counted, and a policy sized for errors (ten attempts, about eight minutes) turned the
request into a dead letter the operator had to retry by hand. Now those attempts are retried
after the same backoff without being spent, for as long as the policy's `outage_s` allows, and
the run says why it is not moving. Past the window they count again, so a service that never
comes back still ends in a dead letter.

The engine tests drive `protocol.execute` by hand (the `published` fixture records the messages
instead of sending them), so every attempt's outcome is seen. A real worker against a real
qBittorrent that is down, then back, is
`tests/integration/test_qbt_review.py::test_a_request_approved_while_qbittorrent_is_down_is_added_once_it_is_back`.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from proj.admin.app import create_app
from proj.engine import protocol, runs, sweeper
from tests.conftest import new_key
from tests.integration.test_metrics import samples, settings_for, value
from tests.support.services import scalar, sql
from tests.support.steps import first_step


def enqueue(script: str, kind: str = "outage") -> tuple[uuid.UUID, int]:
    ref = runs.enqueue(kind, {"script": script}, idempotency_key=new_key())
    return ref.task_run_id, first_step(ref.task_run_id)


def again(step: int) -> str:
    """Run the step's next attempt now (its backoff skipped)."""
    sql("UPDATE engine.step SET next_attempt_at = now() WHERE id = %s", (step,))
    return protocol.execute(step)


def step_row(step: int) -> tuple[str, int, int, object]:
    return sql("SELECT status, attempts, outages, outage_since FROM engine.step WHERE id = %s", (step,))[0]


def outcomes(step: int) -> list[str]:
    rows = sql("SELECT outcome FROM engine.step_attempt WHERE step_id = %s ORDER BY id", (step,))
    return [o for (o,) in rows]


def test_attempts_that_meet_an_outage_are_not_spent(published) -> None:
    """Five attempts meet the outage, under a policy of two: the sixth succeeds. Before, the
    second attempt failed the run."""
    run, step = enqueue("UUUUU.")

    assert protocol.execute(step, starts_run=True) == "unavailable"
    for _ in range(4):
        assert again(step) == "unavailable"
    view = runs.get(run)
    assert view is not None and view.status == "running" and view.attempts == 0
    assert view.pending_reason and "a service it needs is down" in view.pending_reason, view.pending_reason
    assert view.last_error is not None and view.last_error["type"] == "Unavailable", view.last_error
    assert view.last_error["outage_since"] and view.last_error["attempts"] == 0, view.last_error

    assert again(step) == "succeeded"
    status, attempts, outages, since = step_row(step)
    assert (status, attempts, outages) == ("succeeded", 6, 5)
    assert since is None  # the outage ended with the success: out of `step_outage_idx`
    assert outcomes(step) == ["unavailable"] * 5
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (run,)) == "succeeded"


def test_a_step_whose_postgres_session_is_terminated_waits_it_out(published) -> None:
    """Postgres restarting under a body (its session terminated, as `pg_ctl restart` or an
    administrator does) is an outage too, not the step's error. Before, the two attempts it met
    were spent and the run failed, under a policy that waits out a day of any other outage."""
    run, step = enqueue("PP.")

    assert protocol.execute(step, starts_run=True) == "unavailable"
    assert again(step) == "unavailable"
    view = runs.get(run)
    assert view is not None and view.status == "running" and view.attempts == 0
    assert view.last_error is not None and view.last_error["type"] == "OperationalError", view.last_error
    assert "terminat" in view.last_error["message"], view.last_error

    assert again(step) == "succeeded"
    assert step_row(step)[:3] == ("succeeded", 3, 2)
    assert outcomes(step) == ["unavailable"] * 2


def test_an_outage_of_more_than_a_thousand_attempts_is_still_waited_out(published) -> None:
    """A day of `import`'s library outage at its 60 s backoff cap is some 1,440 attempts. From
    the 1,025th, the backoff (`2.0 ** attempt`) overflowed and the failure was never recorded:
    each attempt ended by its lease's expiry instead, which spends it, so the run became a dead
    letter inside its outage window."""
    _, step = enqueue("U.")
    sql("UPDATE engine.step SET attempts = 1100, outages = 1100 WHERE id = %s", (step,))

    assert protocol.execute(step, starts_run=True) == "unavailable"
    assert step_row(step)[:3] == ("pending", 1101, 1101)
    assert again(step) == "succeeded"


def delay_s(step: int) -> float:
    """Seconds until the step's next attempt."""
    left = "SELECT extract(epoch FROM next_attempt_at - now()) FROM engine.step WHERE id = %s"
    return float(scalar(left, (step,)))


def test_an_error_after_an_outage_backs_off_from_the_start(published) -> None:
    """Forty attempts waited out an outage (policy: 1 s, doubling, capped at 10 min). Its own
    retries are asked at the cap; the first ordinary error after it counts as the first spent
    attempt, retried after about 1 s. Before, the backoff grew with every attempt, outages
    included, and that error waited 10 min."""
    _, step = enqueue("UF.", kind="outage_long")
    sql("UPDATE engine.step SET attempts = 40, outages = 40 WHERE id = %s", (step,))

    assert protocol.execute(step, starts_run=True) == "unavailable"
    assert delay_s(step) > 400
    assert again(step) == "retry"
    assert step_row(step)[:3] == ("pending", 42, 41)
    assert 0.5 < delay_s(step) < 1.5
    assert again(step) == "succeeded"


def test_an_outage_older_than_its_window_spends_attempts_again(published) -> None:
    """Past `outage_s`, each attempt of the same outage counts: a service that never comes back
    still ends in a dead letter, with the policy's attempts spent. The counted attempts do not
    open a fresh window (the outage keeps its start)."""
    run, step = enqueue("UUUU")
    assert protocol.execute(step, starts_run=True) == "unavailable"
    sql("UPDATE engine.step SET outage_since = now() - interval '2 hours' WHERE id = %s", (step,))

    assert again(step) == "retry"
    assert again(step) == "failed"

    status, attempts, outages, since = step_row(step)
    assert (status, attempts - outages) == ("failed", 2) and since is not None
    error = scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (run,))
    assert error["type"] == "Unavailable" and error["attempts"] == 2, error
    assert outcomes(step) == ["unavailable", "retry", "failed"]

    assert runs.retry_failed(run) == 1  # the operator's retry starts the step afresh
    assert step_row(step)[1:] == (0, 0, None)


def test_an_error_between_two_outages_ends_the_first(published) -> None:
    """The service answered (with an error): the outage is over, that attempt counts, and the
    next outage has a window of its own."""
    _, step = enqueue("UFU.")
    assert protocol.execute(step, starts_run=True) == "unavailable"
    first_since = step_row(step)[3]
    assert again(step) == "retry"
    assert step_row(step)[3] is None
    assert again(step) == "unavailable"
    assert step_row(step)[3] > first_since
    assert again(step) == "succeeded"
    assert outcomes(step) == ["unavailable", "retry", "unavailable"]


def test_under_a_policy_without_an_outage_window_an_outage_counts(published) -> None:
    """`outage_s` is the kind's choice (invariant 9): without it, `Unavailable`, or Postgres
    down under the body, is an error."""
    for script in ("UU", "PP"):
        run, step = enqueue(script, kind="outage_counted")
        assert protocol.execute(step, starts_run=True) == "retry"
        assert again(step) == "failed"
        assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (run,)) == "failed"


def test_a_lease_lost_during_an_outage_leaves_the_outage_attempts_unspent(published) -> None:
    """The sweeper counts spent attempts as `attempts - outages`: a worker killed on its third
    attempt after two outages has spent one of two, so its step goes back to `pending`. Counted
    as `attempts`, it failed the run."""
    run, step = enqueue("UU.")
    assert protocol.execute(step, starts_run=True) == "unavailable"
    assert again(step) == "unavailable"
    sql(
        "UPDATE engine.step SET status = 'running', attempts = attempts + 1, lease_owner = 'killed',"
        " lease_token = gen_random_uuid(), lease_until = now() - interval '1 second' WHERE id = %s",
        (step,),
    )

    sweeper.sweep()

    assert step_row(step)[:3] == ("pending", 3, 2)
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (run,)) == "running"
    assert again(step) == "succeeded"


def test_metrics_show_the_steps_waiting_out_an_outage_and_for_how_long(published, tmp_path: Path) -> None:
    """No dead letter comes for a day, so an operator alerts on the outage's age instead."""
    _, step = enqueue("UU.")
    assert protocol.execute(step, starts_run=True) == "unavailable"
    sql("UPDATE engine.step SET outage_since = now() - interval '10 minutes' WHERE id = %s", (step,))

    with TestClient(create_app(settings_for(tmp_path))) as c:
        got = samples(c.get("/metrics").text)
    assert value(got, "proj_steps_in_outage", kind="outage", step="call") == 1
    assert value(got, "proj_outage_oldest_seconds", kind="outage", step="call") >= 600

    assert again(step) == "unavailable"
    assert again(step) == "succeeded"
    with TestClient(create_app(settings_for(tmp_path))) as c:
        got = samples(c.get("/metrics").text)
    assert not [k for k in got if k[0] == "proj_steps_in_outage"], got


@pytest.mark.parametrize("kind", ["acquire", "retire_seed", "compensate", "notify"])
def test_the_steps_that_call_qbittorrent_or_a_webhook_wait_out_an_outage_of_a_day(kind: str) -> None:
    """Their policies say how long an outage may last (invariant 9: explicit per kind)."""
    from proj.engine.kind import get_kind

    assert get_kind(kind, 1).retry.outage_s >= 24 * 3600
