"""The reaper's grace (`proj.engine.liveness.Suspects`): a liveness key is taken as dead only
once it stayed free for the grace, seen by this reaper."""

from __future__ import annotations

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
