"""The Grafana dashboard (`deploy/grafana/proj.json`) names only metrics the collector exports,
and shows every one of them. No services: the names come from the collector's own `describe()`
(`proj.admin.metrics.exported_series`); `tests/integration/test_metrics.py` checks a real scrape has them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proj.admin.metrics import EngineCollector, exported_series

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "proj.json"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
KEYWORDS |= {"offset", "inf", "nan"}
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression reads: identifiers that are not functions, aggregations,
    keywords, label names (inside `{}` or a grouping) or parts of numbers and durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = GROUPING.sub("", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[m.end() :].lstrip().startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def exprs(node: Any) -> Iterator[str]:
    """Every `expr` anywhere in the dashboard (panels, rows, targets)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)


def test_metric_names_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, kind) (rate(a_bucket{s=~"x|y"}[5m]))) / b * 1e3 + c offset 5m'
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}
    assert metric_names("sum without (queue) (proj_queue_messages) > bool 0") == {"proj_queue_messages"}


def test_every_expression_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    found = list(exprs(dashboard))
    assert len(found) >= 10, "the dashboard has lost its panels"
    exported = exported_series()
    for expr in found:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} names {sorted(unknown)}, not exported by the collector"


def test_every_exported_metric_is_on_the_dashboard() -> None:
    used = {name for expr in exprs(json.loads(DASHBOARD.read_text())) for name in metric_names(expr)}
    for family in EngineCollector().describe():
        assert any(name == family.name or name.startswith(family.name + "_") for name in used), family.name


def test_dashboard_is_importable() -> None:
    """What Grafana needs to import it: a uid, panels with a Prometheus datasource and ids."""
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"]["type"] == "prometheus" and p["targets"], p["title"]
        assert all(t["refId"] for t in p["targets"])
    assert any(v["type"] == "datasource" for v in d["templating"]["list"])
