"""`/admin/overview`: the numbers of `/metrics` as five small charts an operator reads at a glance.

The page reads the same `Snapshot` as a scrape (`proj.admin.metrics`), so the charts and the
Grafana dashboard never disagree; the charts are SVG from `proj.admin.charts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from markupsafe import Markup

from proj.admin import charts
from proj.admin.metrics import Snapshot
from proj.engine.store import stats

FINISHED = ("succeeded", "failed", "canceled")
MINUTES = 60


@dataclass(frozen=True)
class Overview:
    """The page's charts and the headline numbers printed beside them."""

    finished: Markup
    durations: Markup
    outbox: Markup
    parked: Markup
    dead: Markup
    outbox_oldest_s: float
    outbox_present: bool
    parked_total: int
    dead_total: int
    workers_alive: int
    queues: dict[str, int] | None


def build(snap: Snapshot) -> Overview:
    """Charts from one snapshot read with `overview=True` (it carries the minutes and `now`)."""
    parked, dead = snap.runs_by("waiting"), snap.runs_by("failed")
    return Overview(
        finished=finished_chart(snap.minutes, snap.now or datetime.now().astimezone()),
        durations=durations_chart(snap.step_durations),
        outbox=outbox_chart(snap.outbox),
        parked=counts_chart(parked, "waiting", "Parked runs by kind", "no run is parked"),
        dead=counts_chart(dead, "failed", "Dead letters by kind", "no dead letters"),
        outbox_oldest_s=snap.outbox_oldest_pending_s,
        outbox_present=snap.outbox is not None,
        parked_total=sum(parked.values()),
        dead_total=sum(dead.values()),
        workers_alive=snap.workers_alive,
        queues=snap.queues,
    )


def minute_columns(rows: list[stats.MinuteCount], now: datetime) -> list[charts.Column]:
    """The last `MINUTES` minutes up to `now`'s, oldest first, empty minutes included."""
    end = now.astimezone(UTC).replace(second=0, microsecond=0)
    by_minute: dict[datetime, dict[str, float]] = {}
    for r in rows:
        by_minute.setdefault(r.minute, {})[r.status] = float(r.n)
    cols = []
    for back in range(MINUTES - 1, -1, -1):
        minute = end - timedelta(minutes=back)
        cols.append(charts.Column(minute.strftime("%H:%M"), by_minute.get(minute, {})))
    return cols


def finished_chart(rows: list[stats.MinuteCount], now: datetime) -> Markup:
    return charts.stacked_columns(
        minute_columns(rows, now),
        FINISHED,
        title="Runs finished per minute, last hour (UTC)",
        y_label="runs / min",
    )


def durations_chart(hists: dict[tuple[str, str], stats.Histogram]) -> Markup:
    """p50 and p95 per kind (all its steps merged), estimated from the histogram's buckets like
    Grafana's `histogram_quantile` (same buckets, same interpolation)."""
    per_kind: dict[str, dict[float, int]] = {}
    for (kind, _step), h in hists.items():
        merged = per_kind.setdefault(kind, {})
        for le, cum in h.buckets:
            merged[le] = merged.get(le, 0) + cum
    rows = []
    for kind, merged in sorted(per_kind.items()):
        h = stats.Histogram(buckets=tuple(sorted(merged.items())), total=0.0)
        rows.append((kind, {"p50": h.quantile(0.5) or 0.0, "p95": h.quantile(0.95) or 0.0}))
    return charts.hbars(
        rows, ("p50", "p95"), title="Step duration by kind", seconds=True, empty="no step has finished yet"
    )


def outbox_chart(counts: dict[str, int] | None) -> Markup:
    if counts is None:
        return charts.hbars([], ("pending",), title="Outbox backlog", empty="outbox table not migrated")
    rows = [(status, {status: float(counts.get(status, 0))}) for status in ("pending", "dead")]
    return charts.hbars(rows, ("pending", "dead"), title="Outbox backlog", empty="empty")


def counts_chart(by_kind: dict[str, int], series: str, title: str, empty: str) -> Markup:
    rows = [(kind, {series: float(n)}) for kind, n in sorted(by_kind.items(), key=lambda kv: (-kv[1], kv[0]))]
    return charts.hbars(rows, (series,), title=title, empty=empty)
