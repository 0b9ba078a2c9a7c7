"""Observability review against real Postgres and Redis: histograms that must only grow (a
Prometheus histogram's buckets and count are counters)."""

from __future__ import annotations

import pytest

from proj import db
from proj.engine.store import stats, waits
from tests.conftest import new_key
from tests.support.services import scalar, wait_for


def _wake_count() -> int:
    with db.transaction() as s:
        return stats.signal_wakes(s).count


def test_a_second_signal_to_a_step_does_not_take_its_wake_out_of_the_histogram(inproc) -> None:
    """A wait with a `check` parks again when a signal wakes it and the check does not hold yet
    (a download signalled at each progress). Before: the second wake overwrote `signalled_at`,
    so until the step was claimed again it had no attempt since and left
    `proj_signal_wake_seconds` (count 1 -> 0, a counter reset to Prometheus: a false spike in
    `rate()`), and its first observation was lost for good."""
    key = new_key()
    run_id = inproc.enqueue("gated", {"key": key, "timeout_s": 300}, idempotency_key=new_key()).task_run_id

    def parked(wakeups: int) -> bool:
        row = scalar(
            "SELECT status || ':' || wakeups FROM engine.step WHERE run_id = %s AND name = 'approval'",
            (run_id,),
        )
        return bool(row == f"waiting:{wakeups}")

    wait_for(lambda: parked(1), 20, what="gated run to park")
    assert inproc.signal(f"approval:{key}", {"n": 1}) == 1  # not approved: it parks again
    wait_for(lambda: parked(2), 20, what="gated run to park again")
    assert _wake_count() == 1

    # The second wake, seen from inside its own transaction (before any worker claims the step).
    with db.sessions()() as s, s.begin():
        assert len(waits.wake_topic(s, f"approval:{key}")) == 1
        during = stats.signal_wakes(s).count
        s.rollback()
    assert during >= 1, "the step's wake left the histogram: its count went down"


def _history() -> tuple[dict[tuple[str, str], stats.Histogram], stats.Histogram]:
    from proj.admin.metrics import metrics_engine, read_history
    from proj.settings import get_settings

    engine = metrics_engine(get_settings())
    try:
        h = read_history(engine)
    finally:
        engine.dispose()
    return h.step_durations, h.signal_wakes


def test_purge_does_not_take_observations_out_of_the_histograms(inproc) -> None:
    """`purge` deletes the steps of runs finished over `RETENTION_DAYS` ago. Before: both
    histograms were read from the steps still present, so every purge made their buckets, count
    and sum go down: to Prometheus a counter reset, and `rate()`/`increase()` then count the
    whole remaining history as new (a spike in every p95 and rate panel after each purge). Now
    the purge folds what it deletes into `engine.counter` in the same statement."""
    from proj.engine.store import retention

    probe = inproc.enqueue("probe", {}, idempotency_key=new_key()).task_run_id
    topic = f"go:{new_key()[:12]}"
    woken = inproc.enqueue("signalled", {"topic": topic, "timeout_s": 300}, idempotency_key=new_key())
    status = "SELECT status FROM engine.task_run WHERE id = %s"
    wait_for(lambda: scalar(status, (woken.task_run_id,)) == "waiting", 20, what="signalled run to park")
    assert inproc.signal(topic, {"ok": True}) == 1
    for run in (probe, woken.task_run_id):
        wait_for(lambda run=run: scalar(status, (run,)) == "succeeded", 20, what="runs to end")

    durations, wakes = _history()
    assert durations[("probe", "s1")].count == 1 and wakes.count == 1

    with db.transaction() as s:  # probe s1, signalled go + after (and the beat's periodic runs)
        assert retention.purge_finished_steps(s, 0.0) >= 3
    with db.transaction() as s:  # finds none of them again: nothing folded twice
        retention.purge_finished_steps(s, 0.0)
    assert scalar("SELECT count(*) FROM engine.step WHERE run_id = %s", (probe,)) == 0

    after, wakes_after = _history()
    assert after[("probe", "s1")].buckets == durations[("probe", "s1")].buckets
    assert after[("probe", "s1")].total == pytest.approx(durations[("probe", "s1")].total, abs=1e-5)
    assert after[("signalled", "after")].count == durations[("signalled", "after")].count
    assert wakes_after.buckets == wakes.buckets
    assert wakes_after.total == pytest.approx(wakes.total, abs=1e-5)

    # New observations still add on top of what the purge kept.
    again = inproc.enqueue("probe", {}, idempotency_key=new_key()).task_run_id
    wait_for(lambda: scalar(status, (again,)) == "succeeded", 20, what="another probe")
    assert _history()[0][("probe", "s1")].count == 2
