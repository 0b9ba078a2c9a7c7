"""Retry policies (invariant 9) and kind declarations (invariant 10), with no service at all."""

from __future__ import annotations

import random

import pytest
from pydantic import BaseModel

from proj.engine.dispatch import Dispatch, batched
from proj.engine.kind import Kind, RetryPolicy, get_kind, queue_name, register, step, task_name


class In(BaseModel):
    n: int = 0


def _noop(ctx: object) -> None:
    return None


def test_network_and_file_policies_have_the_attempts_the_design_names() -> None:
    assert RetryPolicy.network().max_attempts == 5
    assert RetryPolicy.file().max_attempts == 3
    assert (RetryPolicy.network().initial_s, RetryPolicy.network().max_s) == (1.0, 60.0)


def test_backoff_grows_exponentially_within_its_jitter_and_stops_at_the_cap() -> None:
    random.seed(7)
    policy = RetryPolicy(max_attempts=9, initial_s=1.0, max_s=60.0, multiplier=2.0, jitter=0.25)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (6, 32.0)]:
        delays = [policy.backoff(attempt) for _ in range(200)]
        assert min(delays) >= base * 0.75 and max(delays) <= base * 1.25, (attempt, min(delays), max(delays))
        assert max(delays) - min(delays) > base * 0.2, "no jitter"
    assert all(policy.backoff(a) <= 60.0 for a in range(7, 30) for _ in range(20))
    assert min(policy.backoff(20) for _ in range(200)) >= 45.0  # capped, not wrapped round


def test_backoff_stays_at_its_cap_however_many_outage_attempts_came_before() -> None:
    """An outage's attempts are not spent but are counted in `attempt` (a day of `import`'s
    library outage at its 60 s cap is some 1,440): `2.0 ** 1024` overflowed a float, so from the
    1,025th attempt the failure could not be recorded (`OverflowError` in `commit_failure`)."""
    from proj.kinds.importing import IMPORT_RETRY

    for attempt in (1025, 1441, 10**6):
        assert 45.0 <= IMPORT_RETRY.backoff(attempt) <= 60.0


def test_a_kind_version_declared_twice_with_other_steps_is_refused() -> None:
    name = "unit_twice"
    register(Kind(name=name, version=1, retry=RetryPolicy.db(), input_model=In, canvas=(step("a", _noop),)))
    same = Kind(name=name, version=1, retry=RetryPolicy.db(), input_model=In, canvas=(step("a", _noop),))
    assert register(same) is same  # the same steps again: harmless (a module imported twice)
    other = Kind(name=name, version=1, retry=RetryPolicy.db(), input_model=In, canvas=(step("b", _noop),))
    with pytest.raises(ValueError, match="declared twice with different steps"):
        register(other)
    assert get_kind(name, 1).step_names() == ["a"]


def test_steps_are_named_tasks_on_their_version_queue() -> None:
    assert task_name("acquire", 2, "add") == "acquire.v2.add"
    assert queue_name("acquire", 2) == "acquire.v2"


def test_batched_groups_by_task_queue_and_priority_in_order() -> None:
    items = [Dispatch(i, "k.v1.s", "k.v1", 0) for i in range(1, 8)]
    items += [Dispatch(20, "k.v1.s", "k.v1", 5), Dispatch(30, "k.v1.t", "k.v1", 0)]
    out = batched(items, 3)
    assert [d.step_ids for d in out] == [(1, 2, 3), (4, 5, 6), (7,), (20,), (30,)]
    assert [(d.task_name, d.priority) for d in out] == [("k.v1.s", 0)] * 3 + [("k.v1.s", 5), ("k.v1.t", 0)]
    assert batched(items, 1) == items  # one message per step
