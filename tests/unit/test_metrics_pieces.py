"""Service-free pieces of the metrics work: histogram buckets and quantiles, the SVG charts,
and the JSON log formatter."""

from __future__ import annotations

import json
import logging

import pytest

from proj import logs
from proj.admin import charts
from proj.engine.store.stats import Histogram, cumulative

INF = float("inf")


def test_width_buckets_become_cumulative_le_buckets() -> None:
    # width_bucket index k = how many bounds are <= x: 0 → le=1, 1 → le=2, 2 → +Inf
    h = cumulative([1.0, 2.0], {0: 1, 1: 2, 2: 1}, total=10.0)
    assert h.buckets == ((1.0, 1), (2.0, 3), (INF, 4)) and h.count == 4 and h.total == 10.0


def test_quantiles_interpolate_like_histogram_quantile() -> None:
    h = Histogram(buckets=((1.0, 1), (2.0, 3), (INF, 4)), total=0.0)
    assert h.quantile(0.5) == pytest.approx(1.5)  # rank 2: half way through (1, 2]
    assert h.quantile(0.25) == pytest.approx(1.0)  # rank 1: the top of the first bucket
    assert h.quantile(1.0) == 2.0  # in +Inf: the last finite bound, as PromQL answers
    assert Histogram(buckets=((1.0, 0), (INF, 0)), total=0.0).quantile(0.5) is None


def test_nice_axis_tops() -> None:
    assert [charts.nice_max(v) for v in (0, 1, 3, 7, 45, 101)] == [2, 2, 4, 8, 60, 200]
    assert charts.nice_max(0.438, 0.01) == pytest.approx(0.6)


def test_bars_carry_their_values_and_escape_labels() -> None:
    svg = str(charts.hbars([("<script>", {"failed": 3.0})], ("failed",), title="t"))
    assert 'class="datum"' in svg and 'data-value="3"' in svg and 'data-series="failed"' in svg
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    assert "none" in str(charts.hbars([], ("failed",), title="t"))


def test_stacked_columns_total_each_column() -> None:
    cols = [charts.Column("10:00", {"succeeded": 2, "failed": 1}), charts.Column("10:01", {})]
    svg = str(charts.stacked_columns(cols, ("succeeded", "failed"), title="t", y_label="runs"))
    assert svg.count('class="datum"') == 2 and 'class="total"' in svg and ">3</text>" in svg
    assert "succeeded 2" in svg and "failed 1" in svg  # the legend's totals


def test_the_formatter_fills_step_fields_only_inside_a_step() -> None:
    record = logging.LogRecord("proj.x", logging.WARNING, __file__, 1, "hello %s", ("there",), None)
    fmt = logs.JsonFormatter()
    assert json.loads(fmt.format(record))["run_id"] is None
    with logs.step_fields(logs.StepFields("r-1", "probe", "s1", 3, "host:1")):
        inside = json.loads(fmt.format(record))
    assert inside | {"ts": None} == {
        "ts": None,
        "level": "WARNING",
        "logger": "proj.x",
        "message": "hello there",
        "run_id": "r-1",
        "kind": "probe",
        "step": "s1",
        "attempt": 3,
        "worker": "host:1",
        "trace_id": None,
    }
    assert json.loads(fmt.format(record))["kind"] is None  # reset on leaving the step
