"""Flower shows our steps as what they are: `<kind>.v<version>.<step>` tasks, with the worker
that ran them and the version queue they travelled on (task events are on in our config).

Real processes: a `celery -A proj worker` and `celery -A proj flower`; the test reads Flower's
HTTP API (`/api/tasks`) with Basic auth, as an operator's script would.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proj.engine import runs
from tests.conftest import new_key
from tests.support.services import ROOT, VENV_BIN, scalar, sql, wait_for

FLOWER_USER = "ops"
FLOWER_PASSWORD = "fl-" + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def flower(tmp_path: Path) -> Iterator[str]:
    """`celery -A proj flower` on a free loopback port; killed (whole session) at teardown."""
    port = free_port()
    log = tmp_path / "flower.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [
            str(VENV_BIN / "celery"),
            "-A",
            "proj",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            "--persistent=False",
            f"--basic-auth={FLOWER_USER}:{FLOWER_PASSWORD}",
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"flower exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(url + "/healthcheck", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 60, interval=0.3, what="flower to answer /healthcheck")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        assert FLOWER_PASSWORD not in log.read_text(errors="replace"), "flower logged its password"


def flower_tasks(url: str, **params: Any) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/api/tasks", params=params, auth=(FLOWER_USER, FLOWER_PASSWORD), timeout=5)
    r.raise_for_status()
    return r.json()


def _status(run_id: uuid.UUID) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def test_flower_shows_a_runs_steps_with_workers_and_queues(procs, flower: str) -> None:
    # Every step as a message of its own: with inline continuation (the default), Flower shows
    # one task per inline batch instead; /admin's timeline shows every step either way.
    procs.worker("fw1", concurrency=2, env={"INLINE_STEPS": "0"})
    assert httpx.get(flower + "/api/tasks", timeout=5).status_code == 401  # the API needs auth

    # Flower's event receiver starts after its HTTP server: warm up until it sees a task.
    def sees_events() -> bool:
        ref = runs.enqueue("probe", {"n": -1}, idempotency_key="warmup-" + new_key())
        wait_for(lambda: _status(ref.task_run_id) == "succeeded", 30, what="warm-up run")
        return any(t["name"].startswith("probe.v1.") for t in flower_tasks(flower).values())

    wait_for(sees_events, 60, interval=0.5, what="flower to receive task events")

    ref = runs.enqueue("probe", {"n": 7}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 30, what="probe run")
    rows = sql("SELECT id, name FROM engine.step WHERE run_id = %s", (ref.task_run_id,))
    step_ids = {name: sid for sid, name in rows}
    assert sorted(step_ids) == ["s1", "s2", "s3", "s4", "s5"]

    def run_tasks() -> dict[str, dict[str, Any]] | None:
        mine = {}
        for task in flower_tasks(flower).values():
            name = task.get("name") or ""
            step = name.rsplit(".", 1)[-1]
            # A step message carries its step row id: that ties Flower's task to our run.
            if (
                name.startswith("probe.v1.")
                and re.findall(r"\d+", str(task.get("args"))) == [str(step_ids.get(step))]
                and task.get("state") == "SUCCESS"
            ):
                mine[name] = task
        return mine if len(mine) == 5 else None

    tasks = wait_for(run_tasks, 30, interval=0.5, what="flower to show all five steps of the run")
    assert sorted(tasks) == [f"probe.v1.s{i}" for i in range(1, 6)]
    for name, task in tasks.items():
        assert str(task["worker"]).startswith("fw1@"), (name, task["worker"])
        # `task-sent` events (task_send_sent_event) carry the routing: the version queue.
        if task.get("routing_key") is not None:
            assert task["routing_key"] == "probe.v1", (name, task["routing_key"])
    assert any(t.get("routing_key") == "probe.v1" for t in tasks.values()), "no routing key seen"

    by_name = flower_tasks(flower, taskname="probe.v1.s3")
    assert by_name and all(t["name"] == "probe.v1.s3" for t in by_name.values())


@pytest.mark.parametrize("count", [1, 3])
def test_every_published_step_is_reported_sent_with_its_queue(count: int) -> None:
    """A batch of step messages reports its `task-sent` events as one `task.multi` message
    (`dispatch._sent_events`); monitors (Flower, `celery events`) still get one event per
    message, with the version queue. Read here with Celery's own event receiver."""
    from proj.celery import app
    from proj.engine import dispatch

    items = [dispatch.step_dispatch(10_000 + i, "probe", 1, "s1") for i in range(count)]
    seen: list[dict[str, Any]] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"task-sent": seen.append})
        with receiver.consumer_context() as (connection, _channel, _consumers):
            # On Redis, events travel by pub/sub: the subscription is made on the first drain.
            with contextlib.suppress(socket.timeout, TimeoutError):
                connection.drain_events(timeout=0.3)
            assert dispatch.publish(items) == []
            deadline = time.monotonic() + 10
            while len(seen) < count and time.monotonic() < deadline:
                with contextlib.suppress(socket.timeout, TimeoutError):
                    connection.drain_events(timeout=0.5)
    assert sorted(e["args"] for e in seen) == sorted(repr((d.step_id,)) for d in items), seen
    assert {(e["name"], e["routing_key"], e["queue"]) for e in seen} == {
        ("probe.v1.s1", "probe.v1", "probe.v1")
    }
