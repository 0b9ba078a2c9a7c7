"""The reaper's grace (`proj.engine.liveness.Suspects`): a liveness key is taken as dead only
once it stayed free for the grace, seen by this reaper."""

from __future__ import annotations

import pytest

from proj.engine.liveness import Suspects


def test_a_key_is_dead_only_once_free_for_the_grace() -> None:
    s = Suspects()
    assert s.dead({1, 2}, now=10.0, grace=0.4) == []
    due = s.due_in(10.1, 0.4)
    assert due is not None and abs(due - 0.3) < 1e-9
    assert s.dead({1, 2}, now=10.39, grace=0.4) == []
    assert s.dead({1, 2}, now=10.4, grace=0.4) == [1, 2]


def test_a_key_taken_again_starts_its_grace_over() -> None:
    s = Suspects()
    s.dead({1}, now=0.0, grace=0.4)
    assert s.dead(set(), now=0.2, grace=0.4) == []  # its process took it again
    assert s.due_in(0.2, 0.4) is None
    assert s.dead({1}, now=0.5, grace=0.4) == []  # free again: a new grace from here
    assert s.dead({1}, now=0.9, grace=0.4) == [1]


def test_no_grace_is_the_first_sighting() -> None:
    assert Suspects().dead({7}, now=0.0, grace=0.0) == [7]


def test_a_suspect_past_its_grace_does_not_hurry_the_next_tick() -> None:
    """A key past its grace was handed to the ending statement at that tick; should the
    statement fail (Postgres out of disk, a statement timeout) the key stays free, and before
    it kept the reaper ticking every 5 ms, a warning each time, until Postgres recovered. The
    next try is at the reap interval; only a grace still running shortens the wait."""
    s = Suspects()
    s.dead({1}, now=0.0, grace=0.4)
    assert s.dead({1}, now=0.5, grace=0.4) == [1]  # its leases' end failed: still free
    assert s.due_in(0.5, 0.4) is None
    s.dead({1, 2}, now=0.6, grace=0.4)  # 2 first seen now
    due = s.due_in(0.7, 0.4)
    assert due is not None and abs(due - 0.3) < 1e-9


def test_the_reaper_waits_its_interval_when_only_suspects_past_grace_remain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proj.engine import liveness
    from proj.settings import Settings

    monkeypatch.setattr(liveness, "get_settings", lambda: Settings(reap_interval_s=0.25, reap_grace_s=0.4))
    live = liveness.Liveness()
    now = liveness.time.monotonic()
    live._suspects.dead({9}, now=now - 10.0, grace=0.4)
    assert live._next_tick() == 0.25
