"""`LOG_FORMAT=json`: a real worker subprocess writes every log line as JSON, and a line logged
inside a step names its run, kind, step, attempt and worker."""

from __future__ import annotations

import json
import re
import socket

from proj.engine import runs
from tests.conftest import new_key
from tests.support.services import scalar, wait_for

CELERY_TEXT_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+: [A-Z]+/")
FIELDS = {"ts", "level", "logger", "message", "run_id", "kind", "step", "attempt", "worker", "trace_id"}


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_worker_logs_are_json_with_the_step_fields(procs) -> None:
    procs.worker("jsonw", concurrency=1, env={"LOG_FORMAT": "json"})
    procs.beat("jsonbeat", env={"LOG_FORMAT": "json"})  # the sweeper re-sends the retries
    run_id = runs.enqueue("flaky", {"message": "disk on fire"}, idempotency_key=new_key()).task_run_id
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)) == "failed",
        30,
        what="flaky to fail",
    )
    wait_for(lambda: "failed, retry in" in procs.log("jsonw"), 10, what="the retry line")
    text = procs.log("jsonw")

    assert not [line for line in text.splitlines() if CELERY_TEXT_LINE.match(line)], "a line in text format"
    beat = procs.log("jsonbeat")
    assert not [line for line in beat.splitlines() if CELERY_TEXT_LINE.match(line)], beat[-2000:]
    assert any(line["logger"].startswith("celery.beat") for line in json_lines(beat)), beat[-2000:]
    lines = json_lines(text)
    assert any(line["message"].endswith(" ready.") for line in lines), "Celery's own lines are JSON too"
    assert all(set(line) >= FIELDS for line in lines)
    retries = [line for line in lines if "failed, retry in" in line["message"]]
    assert retries, text[-3000:]
    first = retries[0]
    assert first["run_id"] == str(run_id) and first["kind"] == "flaky" and first["step"] == "fails"
    assert first["attempt"] == 1 and first["level"] == "INFO" and first["logger"] == "proj.engine.commits"
    assert first["worker"].startswith(socket.gethostname() + ":")
    # No tracer in this worker: the line carries the trace the run was enqueued in, if any (a
    # test before this one may have installed a tracer in this process), and never an invented one.
    traceparent = scalar("SELECT trace->>'traceparent' FROM engine.task_run WHERE id = %s", (run_id,))
    assert first["trace_id"] == (traceparent.split("-")[1] if traceparent else None)
    assert [line["attempt"] for line in retries] == sorted(line["attempt"] for line in retries)
    outside = [line for line in lines if line["message"].endswith(" ready.")][0]
    assert outside["run_id"] is None and outside["step"] is None  # not in a step
