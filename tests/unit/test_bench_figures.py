"""`bench.throughput`'s figures from what a round recorded (no services): the ratio of each round
to the plain round beside it, and what a child's delivery log (`--deliveries`) says."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.throughput import delivery_stats, read_deliveries, round_ratios


def test_deliveries_are_counted_timed_and_spaced_within_the_round_only() -> None:
    child_a = [(0.5, 0.9), (10.0, 10.004), (10.006, 10.010), (10.011, 10.013), (30.0, 30.1)]
    child_b = [(10.001, 10.003), (10.009, 10.019)]
    stats = delivery_stats([child_a, child_b], (10.0, 10.02), concurrency=2)

    assert stats["deliveries"] == 5  # the warm-up (0.5) and a later round (30.0) are left out
    # spans: a 4, 4, 2 ms; b 2, 10 ms
    assert stats["ms_per_delivery"] == pytest.approx(4.0)
    # waits within a child: a 2, 1 ms; b 6 ms
    assert stats["ms_between"] == pytest.approx(2.0)
    # 22 ms in deliveries over 2 children x 20 ms
    assert stats["children_busy_pct"] == pytest.approx(55.0)


def test_a_round_without_deliveries_reports_zeros() -> None:
    stats = delivery_stats([[(1.0, 2.0)]], (5.0, 6.0), concurrency=2)
    assert stats == {"deliveries": 0, "ms_per_delivery": 0.0, "ms_between": 0.0, "children_busy_pct": 0.0}


def test_each_round_is_compared_with_the_plain_round_beside_it() -> None:
    rounds = {
        "plain": [{"steps_per_s": 500.0}, {"steps_per_s": 800.0}],
        "ours": [{"steps_per_s": 1000.0}, {"steps_per_s": 1200.0}],
    }
    assert round_ratios(rounds, "ours") == [2.0, 1.5]


def test_each_child_s_log_is_read_in_order(tmp_path: Path) -> None:
    (tmp_path / "101").write_text("2.5 2.75\n1.0 1.5\n")
    (tmp_path / "102").write_text("3.0 4.0\n")
    assert sorted(read_deliveries(tmp_path)) == [[(1.0, 1.5), (2.5, 2.75)], [(3.0, 4.0)]]
