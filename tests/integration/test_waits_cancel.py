"""Invariants 7 and 8: waits read the database and park; signals are stored and wake at once;
timers live in Postgres; cancel is business first and stops long steps within one chunk."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for


def _status(run_id) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def test_early_signal_is_not_lost(inproc) -> None:
    """A signal sent before anyone waits is stored; the wait sees it without any delay."""
    topic = f"go:{new_key()}"
    assert inproc.signal(topic, {"ok": 1}) == 0
    started = time.monotonic()
    ref = inproc.enqueue("signalled", {"topic": topic, "timeout_s": 120}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 10, what="run to pass the wait")
    assert time.monotonic() - started < 5, "the early signal must not wait for the timeout"
    assert inproc.get(ref.task_run_id).result == {"signal": {"ok": 1}}


def test_early_business_write_passes_the_check_at_once(inproc) -> None:
    key = new_key()
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))
    ref = inproc.enqueue("gated", {"key": key, "timeout_s": 120}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 10, what="run to pass")
    assert scalar("SELECT wakeups FROM engine.step WHERE name = 'approval'") == 0


def test_lost_signal_timeout_rechecks_the_database(inproc) -> None:
    """No signal at all: the Postgres timer wakes the run, the re-check reads the truth."""
    key = new_key()
    ref = inproc.enqueue("gated", {"key": key, "timeout_s": 1.0}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "waiting", 10, what="run to park")
    view = inproc.get(ref.task_run_id)
    assert view.wait_topic == f"approval:{key}" and view.wait_until is not None
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))  # no signal
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 15, what="timer re-check")
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 1


def test_waiting_does_not_consume_attempts(inproc) -> None:
    key = new_key()
    ref = inproc.enqueue("gated", {"key": key, "timeout_s": 0.2}, idempotency_key=new_key())
    wait_for(
        lambda: scalar("SELECT wakeups FROM engine.step WHERE name = 'approval'") >= 6,
        20,
        what="several timer wake-ups",
    )
    assert _status(ref.task_run_id) in ("waiting", "running")
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 15, what="run to pass")
    attempts, max_attempts = sql("SELECT attempts, max_attempts FROM engine.step WHERE name = 'approval'")[0]
    assert attempts == 1 <= max_attempts


def test_one_signal_wakes_a_hundred_parked_runs(inproc) -> None:
    key = new_key()
    refs = [
        inproc.enqueue("gated", {"key": key, "timeout_s": 600}, idempotency_key=new_key()) for _ in range(100)
    ]
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'waiting'") == 100,
        60,
        what="100 parked runs",
    )
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))
    assert inproc.signal(f"approval:{key}") == 100
    wait_for(
        lambda: scalar("SELECT count(*) FROM engine.task_run WHERE status = 'succeeded'") == 100,
        60,
        what="all 100 to wake and finish",
    )
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == len(refs)


def test_available_at_is_held_in_postgres(inproc) -> None:
    at = datetime.now(UTC) + timedelta(seconds=2)
    ref = inproc.enqueue("probe", {}, idempotency_key=new_key(), available_at=at)
    time.sleep(1.0)
    assert _status(ref.task_run_id) == "pending"
    assert inproc.get(ref.task_run_id).pending_reason.startswith("scheduled for")
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 15, what="delayed run")
    first = scalar("SELECT min(started_at) FROM testkit.execution")
    assert first >= at - timedelta(milliseconds=50)


def test_cancel_while_queued(engine) -> None:
    ref = engine.enqueue("probe", {}, idempotency_key=new_key())  # no worker yet
    engine.cancel(ref.task_run_id, "changed my mind")
    assert _status(ref.task_run_id) == "canceled"
    engine.start(roles=("worker", "beat"), concurrency=2)
    time.sleep(1.5)
    assert scalar("SELECT count(*) FROM testkit.execution") == 0
    assert scalar("SELECT count(*) FROM engine.step WHERE status = 'canceled'") == 1


def test_cancel_while_waiting(inproc) -> None:
    key = new_key()
    ref = inproc.enqueue("gated", {"key": key, "timeout_s": 600}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "waiting", 10, what="run to park")
    inproc.cancel(ref.task_run_id, "no longer wanted")
    assert _status(ref.task_run_id) == "canceled"
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))
    assert inproc.signal(f"approval:{key}") == 0
    time.sleep(1.0)
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 0


def test_cancel_during_a_long_chunked_step_stops_within_one_chunk(inproc) -> None:
    ref = inproc.enqueue("chunky", {"chunks": 100, "chunk_s": 0.3}, idempotency_key=new_key())
    wait_for(lambda: scalar("SELECT count(*) FROM testkit.chunk") >= 3, 15, what="copy underway")
    inproc.cancel(ref.task_run_id, "user canceled the download")
    flagged_at = scalar("SELECT at FROM testkit.cancel_flag WHERE run_id = %s", (ref.task_run_id,))
    assert flagged_at is not None, "business row written first"
    wait_for(lambda: _status(ref.task_run_id) == "canceled", 10, what="run to stop")
    late_chunks = scalar("SELECT count(*) FROM testkit.chunk WHERE at > %s", (flagged_at,))
    assert late_chunks <= 1, f"{late_chunks} chunks started after the cancel"
    assert scalar("SELECT count(*) FROM testkit.execution WHERE step = 'after'") == 0
    # Compensation is an explicit kind, enqueued once.
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE kind = 'undo'") == "succeeded",
        15,
        what="compensation run",
    )
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'undo'") == 1
    assert scalar("SELECT result FROM engine.task_run WHERE kind = 'undo'") == str(ref.task_run_id)


def test_abandon_touches_only_a_dead_letter(inproc) -> None:
    """Abandon on a run that is not `failed` (a stale page after another operator's retry) writes
    nothing and cancels nothing: no cancel request, no canceled step, no compensation."""
    from proj.engine import runs

    topic = f"abandon:{new_key()}"
    ref = inproc.enqueue("signalled", {"topic": topic, "timeout_s": 600}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "waiting", 20, what="the run to park")
    assert runs.abandon(ref.task_run_id, "stale page") is False
    time.sleep(0.5)  # what a wrongly finished cancel would have written by now
    assert _status(ref.task_run_id) == "waiting"
    assert scalar("SELECT cancel_requested_at FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) is None
    assert (
        scalar(
            "SELECT count(*) FROM engine.step WHERE run_id = %s AND status = 'canceled'", (ref.task_run_id,)
        )
        == 0
    )
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'compensate'") == 0
    assert runs.signal(topic) == 1
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 20, what="the run to go on")


def test_a_cancel_counts_a_claim_that_raced_it(published) -> None:
    """A claim that read the run before the cancel request committed, and commits while the
    cancel runs: the cancel waits for it and counts its live lease, so it does not cancel a
    step whose body has just started (`store.cancels.LIVE_LEASES` locks before it counts)."""
    import threading

    import psycopg

    from proj.engine import runs
    from tests.support.services import pg_url

    ref = runs.enqueue("probe", {"n": 1}, idempotency_key=new_key())
    step = scalar("SELECT id FROM engine.step WHERE run_id = %s", (ref.task_run_id,))
    sql("UPDATE engine.task_run SET status = 'running' WHERE id = %s", (ref.task_run_id,))  # past its start
    with psycopg.connect(pg_url()) as claim:  # a worker's claim, not committed yet
        claim.execute(
            "UPDATE engine.step SET status = 'running', lease_token = gen_random_uuid(), attempts = 1, "
            "lease_until = now() + interval '15 seconds' WHERE id = %s",
            (step,),
        )
        canceling = threading.Thread(target=runs.cancel, args=(ref.task_run_id, "raced"))
        canceling.start()
        time.sleep(0.5)  # the cancel is past its request, at the steps
        claim.commit()
        canceling.join(10)
        assert not canceling.is_alive()
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (step,)) == "running"
    run = sql(
        "SELECT status, cancel_requested_at IS NOT NULL FROM engine.task_run WHERE id = %s",
        (ref.task_run_id,),
    )
    assert run == [("running", True)], "canceled under a step that had just been claimed"


def test_a_cancel_does_not_deadlock_with_a_claim_of_a_waiting_run(published) -> None:
    """The claim of a waiting run's step locks the step, then the run (`claims.CLAIM`: `started`);
    a cancel locks the run, then the run's open steps. A cancel that waited for the claim's step
    lock deadlocked with it (Postgres aborted one of the two after `deadlock_timeout`): the cancel
    now skips a step another transaction holds, counts it as live, and returns; the claim then
    takes the run's lock. The sweeper finalizes the cancel once the step's lease is gone."""
    import threading

    import psycopg

    from proj.engine import runs, sweeper
    from tests.support.services import pg_url

    ref = runs.enqueue("probe", {"n": 1}, idempotency_key=new_key())
    run_id = ref.task_run_id
    step = scalar("SELECT id FROM engine.step WHERE run_id = %s", (run_id,))
    sql("UPDATE engine.task_run SET status = 'waiting', started_at = now() WHERE id = %s", (run_id,))
    errors: list[BaseException] = []

    def cancel() -> None:
        try:
            runs.cancel(run_id, "raced a wake-up")
        except BaseException as e:  # noqa: BLE001 -- the test reports it
            errors.append(e)

    with psycopg.connect(pg_url()) as claim:  # a worker's claim of the woken step, in flight
        claim.execute(
            "UPDATE engine.step SET status = 'running', lease_token = gen_random_uuid(), attempts = 1, "
            "lease_until = now() + interval '15 seconds' WHERE id = %s",
            (step,),
        )
        canceling = threading.Thread(target=cancel)
        canceling.start()
        # the cancel either returns, or stops at a lock the claim holds (the old order)
        wait_for(
            lambda: (
                not canceling.is_alive()
                or scalar("SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'transactionid'")
                > 0
            ),
            timeout=10,
        )
        # the claim's second lock: the run row (`started`); deadlock_timeout is 1 s
        claim.execute("UPDATE engine.task_run SET status = 'running' WHERE id = %s", (run_id,))
        claim.commit()
        canceling.join(10)
        assert not canceling.is_alive()
    assert errors == [], f"the cancel failed: {errors!r}"
    run = sql("SELECT status, cancel_requested_at IS NOT NULL FROM engine.task_run WHERE id = %s", (run_id,))
    assert run == [("running", True)]
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (step,)) == "running"
    sql("UPDATE engine.step SET lease_until = now() - interval '1 second' WHERE id = %s", (step,))
    sweeper.sweep()
    assert _status(run_id) == "canceled"
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (step,)) == "canceled"


def test_a_signal_whose_transaction_began_before_the_claim_wakes_a_bare_wait(published, monkeypatch) -> None:
    """A wait without a check is satisfied by any stored signal. A signal whose transaction
    began before the wait step was claimed, and committed after the step read the topic (it
    waited for the topic lock, or its wake was slow), is stored with that earlier `created_at`
    (`now()` is the transaction's start). The park looked only for signals stored since the
    claim, so it parked the step with the signal stored and nobody left to wake it: the run
    sat until its timer (here 10 minutes). Now the park of a bare wait looks, under the topic
    lock, for any stored signal, and the step goes straight back to work."""
    import threading

    from proj.engine import protocol, runs
    from proj.engine.store import waits

    topic = f"go:{new_key()}"
    ref = runs.enqueue("signalled", {"topic": topic, "timeout_s": 600}, idempotency_key=new_key())
    step = scalar("SELECT id FROM engine.step WHERE run_id = %s", (ref.task_run_id,))
    stored, go = threading.Event(), threading.Event()
    real_wake = waits.wake_topic

    def wake_late(s, t):  # noqa: ANN001, ANN202 - the signal's transaction: stored, not committed
        stored.set()
        assert go.wait(20)
        return real_wake(s, t)

    monkeypatch.setattr(waits, "wake_topic", wake_late)
    woke: list[int] = []
    signalling = threading.Thread(target=lambda: woke.append(runs.signal(topic, {"ok": 1})))
    signalling.start()
    assert stored.wait(10), "the signal is stored, its transaction open"
    outcome: list[str] = []
    waiting = threading.Thread(target=lambda: outcome.append(protocol.execute(step, starts_run=True)))
    waiting.start()  # claimed after the signal's transaction began; reads no signal yet
    wait_for(
        lambda: scalar("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted") > 0,
        10,
        what="the wait's park to queue behind the signal's topic lock",
    )
    go.set()
    signalling.join(20)
    waiting.join(20)
    assert woke == [0], "the step was running when the signal looked for parked steps"
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (step,)) != "waiting", (
        f"parked with a stored signal and nobody to wake it ({outcome})"
    )
    assert outcome == ["rechecking"]
    assert [d.step_id for d in published if d.step_id == step], "sent straight back to work"
    assert protocol.execute(step) == "succeeded"
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 10, what="the run to go on")
    assert runs.get(ref.task_run_id).result == {"signal": {"ok": 1}}


def test_a_wait_on_a_topic_no_signal_can_reach_fails_at_once(published) -> None:
    """A wait whose topic `signal` refuses (a space, over 512 characters) can never be woken by
    a signal: it parked anyway, and a wait without a check then parked again at every timeout,
    forever, one attempt row per wake-up. Now the wait refuses such a topic: the run fails at
    once, a dead letter naming the topic, and nothing is parked."""
    from proj.engine import protocol, runs
    from proj.engine.errors import BadTopic

    for topic in ("needs approval", "t:" + "x" * 600):
        with pytest.raises(BadTopic):
            runs.signal(topic)
        ref = runs.enqueue("signalled", {"topic": topic, "timeout_s": 1}, idempotency_key=new_key())
        step = scalar("SELECT id FROM engine.step WHERE run_id = %s", (ref.task_run_id,))
        assert protocol.execute(step, starts_run=True) == "failed"
        view = runs.get(ref.task_run_id)
        assert view.status == "failed", view
        assert "bad signal topic" in view.last_error["message"], view.last_error
        assert view.last_error["attempts"] == 1
        assert scalar("SELECT count(*) FROM engine.step WHERE status = 'waiting'") == 0
