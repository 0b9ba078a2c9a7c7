"""`proj demo --engine-only`: the small `demo` kind (a fan-out of parts), drawn as a timeline of
its steps until the run ends (no qBittorrent needed)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from datetime import datetime
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from proj.demo.screen import console
from proj.demo.services import Servers, check_broker, configure, guarded
from proj.engine.store import views

TIMEOUT_S = 60.0

POLL_S = 0.2

TITLE = "proj demo"

BAR_WIDTH = 20

STATUS_STYLE = {
    "pending": "dim",
    "running": "yellow",
    "waiting": "cyan",
    "succeeded": "green",
    "failed": "red",
    "canceled": "magenta",
}


def expected_digests(title: str, parts: int) -> list[str]:
    """What `proj.kinds.demo` must produce; lets the demo (and tests) check the result."""
    return [hashlib.sha256(f"{title}#{i}".encode()).hexdigest()[:12] for i in range(parts)]


def step_rows(run_id: uuid.UUID) -> tuple[views.RunWithClock, list[views.StepLine]]:
    """The run row and its step rows, with the database's clock for consistent offsets."""

    from proj import db

    with db.transaction() as s:
        run = views.run_with_clock(s, run_id)
        steps = views.steps_of_run(s, run_id)
    return run, steps


def offset(t0: datetime, t: datetime | None) -> float | None:
    """Seconds since the run was created: a timeline reads better than wall-clock times."""
    return None if t is None else (t - t0).total_seconds()


def bar(start: float | None, end: float, total: float, style: str) -> Text:
    """A Gantt-style bar: where in the run's lifetime this step ran."""
    if start is None:
        return Text("·" * BAR_WIDTH, style="dim")
    scale = BAR_WIDTH / max(total, 1e-3)
    left = min(BAR_WIDTH - 1, int(start * scale))
    width = max(1, min(BAR_WIDTH - left, round((end - start) * scale)))
    return (
        Text("·" * left, style="dim")
        + Text("█" * width, style=style)
        + Text("·" * (BAR_WIDTH - left - width), style="dim")
    )


def render(run_id: uuid.UUID, run: views.RunWithClock, steps: list[views.StepLine]) -> Group:
    """The timeline table: one row per step, offsets relative to the run's creation."""
    t0 = run.created_at
    now = offset(t0, run.finished_at or run.now) or 0.0
    table = Table(box=None, pad_edge=False)
    for name in ("stage", "step", "status", "tries", "start", "end"):
        table.add_column(name, no_wrap=True)
    table.add_column("timeline", no_wrap=True, width=BAR_WIDTH)
    for st in steps:
        style = STATUS_STYLE.get(st.status, "")
        start, end = offset(t0, st.started_at), offset(t0, st.finished_at)
        table.add_row(
            str(st.stage),
            st.name if st.item is None else f"{st.name}[{st.item_index}]",
            Text(st.status, style=style),
            str(st.attempts),
            "" if start is None else f"+{start:.2f}s",
            "" if end is None else f"+{end:.2f}s",
            bar(start, end if end is not None else now, now, style),
        )
    head = Text(f"run {run_id}  ")
    head.append(run.status, style=STATUS_STYLE.get(run.status, "bold"))
    head.append(f"  {now:.2f}s  {len(steps)} step(s)")
    return Group(head, table)


def watch(run_id: uuid.UUID, deadline: float) -> views.RunWithClock:
    """Show the run until it is terminal or the deadline passes; return the last run row.

    On a terminal the table redraws in place; in a pipe or log, each step's status changes are
    printed as timeline lines (Live cannot redraw there), then the table once at the end.
    """
    from proj.engine.status import TERMINAL

    run, steps = step_rows(run_id)
    if console.is_terminal:
        with Live(render(run_id, run, steps), console=console, refresh_per_second=10) as live:
            while run.status not in TERMINAL and time.monotonic() < deadline:
                time.sleep(POLL_S)
                run, steps = step_rows(run_id)
                live.update(render(run_id, run, steps))
        return run
    seen: dict[tuple[int, int], str] = {}
    while True:
        for st in steps:
            key = (st.stage, st.item_index)
            if seen.get(key) != st.status:
                seen[key] = st.status
                at = offset(run.created_at, st.finished_at or st.started_at or run.now) or 0.0
                line = Text(f"  +{at:.2f}s  {st.name}[{st.item_index}] ")
                line.append(st.status, style=STATUS_STYLE.get(st.status, ""))
                console.print(line + Text(f" (try {st.attempts})" if st.attempts else ""))
        if run.status in TERMINAL or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
        run, steps = step_rows(run_id)
    console.print(render(run_id, run, steps))
    return run


def run_engine_demo(parts: int = 4) -> int:
    """Run one `demo` run on an in-process worker; 0 if it succeeded within TIMEOUT_S, else 1."""

    def body(servers: Servers, engines: list[Any], began: float) -> tuple[int, Text]:
        configure(servers)
        from proj.engine.celery_engine import CeleryTaskEngine
        from proj.engine.preflight import migrate_to_head

        check_broker()
        head = migrate_to_head()
        engine = CeleryTaskEngine()
        engines.append(engine)
        engine.start(roles=("worker", "beat"), concurrency=2)
        console.print(f"schema {head}; worker and sweeper up after {time.monotonic() - began:.1f}s")
        ref = engine.enqueue(
            "demo",
            {"title": TITLE, "parts": parts},
            idempotency_key=f"proj-demo-{uuid.uuid4().hex}",
        )
        run = watch(ref.task_run_id, time.monotonic() + TIMEOUT_S)
        return outcome(ref.task_run_id, run, parts)

    return guarded(body)


def outcome(run_id: uuid.UUID, run: views.RunWithClock, parts: int) -> tuple[int, Text]:
    """The exit code and the one greppable final line, from the run's status and result."""
    if run.status == "succeeded":
        result = run.result or {}
        took = offset(run.created_at, run.finished_at) or 0.0
        line = f"demo run {run_id} succeeded in {took:.2f}s: {json.dumps(result)}"
        if result.get("digests") != expected_digests(TITLE, parts):
            return 1, Text(line + " (but not the expected digests)", style="red")
        return 0, Text(line, style="green")
    why = json.dumps(run.last_error) if run.last_error else f"not finished after {TIMEOUT_S:.0f}s"
    return 1, Text(f"demo run {run_id} {run.status}: {why}", style="red")
