"""Small SVG charts drawn on the server for `/admin/overview`: no script, nothing fetched.

Why server-side: the admin's CSP allows scripts from its own origin only and the page must read
at a glance without one. Each chart is a self-contained `<svg>` with axes, a legend and the
values printed; every bar carries `data-series`, `data-label` and `data-value` so a test reads
what is drawn (`tests/integration/test_overview_browser.py`). Text is escaped here: labels come from the
database (kind names).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from markupsafe import Markup

STATUS_COLORS = {
    "succeeded": "#2da44e",
    "failed": "#cf222e",
    "canceled": "#d4a72c",
    "pending": "#8c959f",
    "dispatched": "#2da44e",
    "dead": "#cf222e",
    "waiting": "#bf8700",
    "p50": "#54aeff",
    "p95": "#0550ae",
}
FONT = 'font-family="system-ui, sans-serif" font-size="11"'
AXIS = "#8c959f"
MUTED = "#57606a"


@dataclass(frozen=True)
class Column:
    """One x position of a stacked column chart: its label and a value per series."""

    label: str
    values: dict[str, float]


def nice_max(value: float, least: float = 2.0) -> float:
    """The axis top: 1, 2, 4, 6 or 8 times a power of ten, at least `value` and `least` (2 for
    counts, so the middle tick of a count is a whole number too)."""
    if value <= least:
        return least
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 4, 6, 8):
        if value <= step * power:
            return float(step * power)
    return float(10 * power)


def fmt_number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def fmt_seconds(value: float) -> str:
    """Durations for people: 850 ms, 3.2 s, 4.5 min."""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 120:
        return f"{value:.1f} s"
    return f"{value / 60:.1f} min"


def _svg(width: int, height: int, title: str, body: list[str]) -> Markup:
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>"
    )
    return Markup(head + "".join(body) + "</svg>")


def _text(x: float, y: float, value: str, anchor: str = "start", fill: str = MUTED, extra: str = "") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill="{fill}" {FONT} {extra}>'
        f"{escape(value)}</text>"
    )


def _bar(x: float, y: float, w: float, h: float, series: str, label: str, value: float) -> str:
    color = STATUS_COLORS.get(series, "#6e7781")
    tip = f"{label} · {series}: {fmt_number(value)}"
    return (
        f'<rect class="datum" x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{max(h, 0):.1f}" '
        f'fill="{color}" data-series="{escape(series)}" data-label="{escape(label)}" '
        f'data-value="{fmt_number(value)}"><title>{escape(tip)}</title></rect>'
    )


def _legend(x: float, y: float, items: Sequence[tuple[str, str]]) -> list[str]:
    """Swatches with their text (`series`, `text`) in one row from (x, y)."""
    out = []
    for series, label in items:
        color = STATUS_COLORS.get(series, "#6e7781")
        out.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" fill="{color}"/>')
        out.append(_text(x + 14, y, label, extra='class="legend"'))
        x += 22 + 6.5 * len(label)
    return out


def _empty(width: int, height: int, title: str, message: str) -> Markup:
    return _svg(
        width, height, title, [_text(width / 2, height / 2, message, "middle", extra='class="empty"')]
    )


def stacked_columns(
    columns: Sequence[Column], series: Sequence[str], *, title: str, y_label: str, every: int = 10
) -> Markup:
    """A stacked column per x position (e.g. per minute), y axis with 3 ticks, x labels every
    `every` columns, and a legend with each series' total."""
    width, height, left, right, top, bottom = 1180, 240, 46, 12, 30, 38
    totals = {s: sum(c.values.get(s, 0) for c in columns) for s in series}
    if not columns or not any(totals.values()):
        return _empty(width, 80, title, "nothing finished in this period")
    top_value = nice_max(max(sum(c.values.get(s, 0) for s in series) for c in columns))
    plot_w, plot_h = width - left - right, height - top - bottom
    step = plot_w / len(columns)
    body = _legend(left, 14, [(s, f"{s} {fmt_number(totals[s])}") for s in series])
    for frac in (0.0, 0.5, 1.0):  # horizontal grid + y ticks
        y = top + plot_h * (1 - frac)
        body.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e7ed"/>')
        body.append(_text(left - 6, y + 4, fmt_number(top_value * frac), "end"))
    body.append(
        _text(
            12,
            top + plot_h / 2,
            y_label,
            "middle",
            extra=f'transform="rotate(-90 12 {top + plot_h / 2:.1f})"',
        )
    )
    for i, col in enumerate(columns):
        x, base = left + i * step + 1, top + plot_h
        for s in series:
            v = col.values.get(s, 0)
            if v:
                h = plot_h * v / top_value
                base -= h
                body.append(_bar(x, base, step - 2, h, s, col.label, v))
        total = sum(col.values.get(s, 0) for s in series)
        if total:  # the column's total above it
            body.append(_text(x + step / 2 - 1, base - 3, fmt_number(total), "middle", extra='class="total"'))
        if i % every == 0 or i == len(columns) - 1:
            body.append(_text(x + step / 2, height - bottom + 16, col.label, "middle"))
    body.append(
        f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="{AXIS}"/>'
    )
    return _svg(width, height, title, body)


def hbars(
    rows: Sequence[tuple[str, dict[str, float]]],
    series: Sequence[str],
    *,
    title: str,
    unit: str = "",
    seconds: bool = False,
    empty: str = "none",
) -> Markup:
    """Horizontal bars, one group per row label and one bar per series the row has, each value
    printed at its end; the scale is shared by all rows (so bars compare), from 0 to a round
    maximum. A legend is drawn when a row has more than one series."""
    if not rows:
        return _empty(520, 60, title, empty)
    per_row = max(sum(1 for s in series if s in values) for _, values in rows)
    label_w, value_w, bar_h, gap = 160, 80, 16, 10
    width = 520
    group_h = bar_h * per_row + gap
    legend_h = 22 if per_row > 1 else 6
    height = legend_h + group_h * len(rows) + 24
    top_value = nice_max(max(v for _, values in rows for v in values.values()), 0.01 if seconds else 2.0)
    plot_w = width - label_w - value_w
    body = _legend(label_w, 14, [(s, s) for s in series]) if per_row > 1 else []
    y = legend_h
    for label, values in rows:
        body.append(_text(label_w - 8, y + group_h / 2 - 1, label, "end", fill="#1d2430"))
        for j, s in enumerate(s for s in series if s in values):
            v = values[s]
            by = y + j * bar_h
            body.append(_bar(label_w, by, plot_w * v / top_value, bar_h - 2, s, label, v))
            shown = fmt_seconds(v) if seconds else f"{fmt_number(v)}{unit}"
            body.append(
                _text(label_w + plot_w * v / top_value + 4, by + bar_h - 4, shown, extra='class="value"')
            )
        y += group_h
    axis_y = y + 2
    body.append(f'<line x1="{label_w}" x2="{label_w + plot_w}" y1="{axis_y}" y2="{axis_y}" stroke="{AXIS}"/>')
    for frac in (0.0, 0.5, 1.0):
        v = top_value * frac
        shown = fmt_seconds(v) if seconds else fmt_number(v)
        body.append(_text(label_w + plot_w * frac, axis_y + 14, shown, "middle"))
    return _svg(width, height, title, body)
