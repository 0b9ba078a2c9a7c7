"""Migration 0011 moves the running attempt onto its step row, and `engine.attempt` shows every
attempt once, whether it was recorded before the upgrade or after it (and back down again).

Run on a scratch database of its own: the suite's database stays at head."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.schema import migrate, rows, scratch_database

BEFORE, AFTER = "0010_result_awaited", "0011_attempt_on_step"


@pytest.fixture
def scratch() -> Iterator[str]:
    with scratch_database("attempts") as url:
        yield url


def _old_style_run(url: str) -> dict[str, Any]:
    """At 0010: a run whose s1 succeeded on its second attempt (an orphan before it), and whose s2
    is running, each attempt recorded as 0010 did (a row per claim, closed at the end)."""
    run, t1, t2, t3 = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    rows(
        url,
        "INSERT INTO engine.task_run (id, kind, version, idempotency_key, input, input_hash, status) "
        "VALUES (%s, 'probe', 1, 'k', '{}', 'h', 'running')",
        (run,),
    )
    s1 = rows(
        url,
        "INSERT INTO engine.step (run_id, stage, name, max_attempts, status, attempts, lease_owner, "
        "finished_at) VALUES (%s, 0, 's1', 5, 'succeeded', 2, 'w2', now()) RETURNING id",
        (run,),
    )[0][0]
    s2 = rows(
        url,
        "INSERT INTO engine.step (run_id, stage, name, max_attempts, status, attempts, lease_token, "
        "lease_owner, lease_until) VALUES (%s, 1, 's2', 5, 'running', 1, %s, 'w3', "
        "now() + interval '1 minute') RETURNING id",
        (run, t3),
    )[0][0]
    rows(
        url,
        "INSERT INTO engine.step_attempt "
        "(step_id, attempt, lease_token, worker, outcome, started_at, ended_at) "
        "VALUES (%s, 1, %s, 'w1', NULL, now() - interval '3 minutes', NULL), "
        "(%s, 2, %s, 'w2', 'succeeded', now() - interval '2 minutes', now() - interval '90 seconds'), "
        "(%s, 1, %s, 'w3', NULL, now() - interval '1 minute', NULL)",
        (s1, t1, s1, t2, s2, t3),
    )
    return {"run": run, "s1": s1, "s2": s2, "tokens": (t1, t2, t3)}


def _history(url: str, view: str) -> list[tuple[Any, ...]]:
    return rows(
        url,
        f"SELECT s.name, a.attempt, a.worker, a.outcome, a.lease_token FROM {view} a "
        "JOIN engine.step s ON s.id = a.step_id ORDER BY s.stage, a.attempt",
    )


def test_the_upgrade_keeps_each_attempt_once_and_the_downgrade_restores_the_log(scratch: str) -> None:
    migrate(scratch, BEFORE)
    run = _old_style_run(scratch)
    t1, t2, t3 = run["tokens"]
    before = _history(scratch, "engine.step_attempt")
    assert before == [("s1", 1, "w1", None, t1), ("s1", 2, "w2", "succeeded", t2), ("s2", 1, "w3", None, t3)]

    migrate(scratch, AFTER)

    assert _history(scratch, "engine.attempt") == before
    # The running attempt now lives on its step row: no log row of its own is left.
    assert rows(scratch, "SELECT count(*) FROM engine.step_attempt WHERE step_id = %s", (run["s2"],)) == [
        (0,)
    ]
    claimed = rows(scratch, "SELECT claimed_at IS NOT NULL FROM engine.step WHERE id = %s", (run["s2"],))
    assert claimed == [(True,)]

    migrate(scratch, BEFORE, down=True)

    assert _history(scratch, "engine.step_attempt") == before
