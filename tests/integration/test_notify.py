"""`notify`, the requester's webhook: retried across an outage of the receiver, not across a
refusal. Each test runs the kind's step in this process against a real local HTTP endpoint."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from proj import db
from proj.acquisition import service
from proj.engine import protocol, runs
from proj.engine.kind import get_kind
from tests.conftest import new_key
from tests.support.services import scalar, sql
from tests.support.steps import first_step
from tests.support.torrents import multi_file


class Endpoint:
    """A webhook receiver answering the statuses it is given, one per call (then 200)."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.keys: list[str | None] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                endpoint.keys.append(self.headers.get("Idempotency-Key"))
                self.send_response(endpoint.statuses.pop(0) if endpoint.statuses else 200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def endpoint(request: pytest.FixtureRequest) -> Iterator[Endpoint]:
    e = Endpoint(list(request.param))
    yield e
    e.server.shutdown()


def notify_run(url: str):
    with db.sessions().begin() as s:
        task = service.request_download(s, requester="alice", torrent=multi_file(["a.bin"]), webhook_url=url)
    return runs.enqueue("notify", {"download_task_id": str(task)}, idempotency_key=new_key())


@pytest.mark.parametrize("endpoint", [[404]], indirect=True)
def test_a_webhook_that_refuses_the_call_is_not_sent_again(published, endpoint: Endpoint) -> None:
    """A 404 (or 401, 410, …) will not change by sending again: the run fails at once, saying
    what the receiver answered, instead of spending its retries on it."""
    ref = notify_run(endpoint.url)

    assert protocol.execute(first_step(ref.task_run_id), starts_run=True) == "failed"

    assert len(endpoint.keys) == 1
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == "failed"
    error = str(scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (ref.task_run_id,)))
    assert "answered 404" in error, error


@pytest.mark.parametrize("endpoint", [[503, 429]], indirect=True)
def test_a_webhook_that_is_down_is_sent_again_with_the_same_key(published, endpoint: Endpoint) -> None:
    """A 503 is an outage (the attempt is not spent), a 429 an error worth retrying: the step
    retries both, and the receiver sees one key."""
    ref = notify_run(endpoint.url)
    step = first_step(ref.task_run_id)

    assert protocol.execute(step, starts_run=True) == "unavailable"
    sql("UPDATE engine.step SET next_attempt_at = now() WHERE id = %s", (step,))
    assert protocol.execute(step) == "retry"
    sql("UPDATE engine.step SET next_attempt_at = now() WHERE id = %s", (step,))
    assert protocol.execute(step) == "succeeded"

    assert len(endpoint.keys) == 3 and len(set(endpoint.keys)) == 1, endpoint.keys


def test_the_webhook_is_retried_for_more_than_half_an_hour() -> None:
    """The network policy's five attempts spent about 15 s: a receiver restarting for a minute
    lost its notice (a dead letter for the operator). The kind's retries now span over half an
    hour (the backoff without its jitter)."""
    policy = get_kind("notify", 1).retry
    span = sum(
        min(policy.max_s, policy.initial_s * policy.multiplier ** (n - 1))
        for n in range(1, policy.max_attempts)
    )
    assert span >= 30 * 60, span


def test_a_receiver_that_is_not_there_is_an_outage_that_spends_no_attempt(published) -> None:
    """Nothing listens on the webhook's port (the requester's home server is off): the attempt
    is not spent, and the run says it waits for the receiver. Before, twelve such attempts
    (about 40 min) made the notice a dead letter."""
    e = Endpoint([])
    url = e.url
    e.server.shutdown()
    e.server.server_close()
    ref = notify_run(url)
    step = first_step(ref.task_run_id)

    assert protocol.execute(step, starts_run=True) == "unavailable"

    assert scalar("SELECT attempts - outages FROM engine.step WHERE id = %s", (step,)) == 0
    error = scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (ref.task_run_id,))
    assert error["type"] == "ReceiverDown" and "did not answer" in error["message"], error
    task = scalar("SELECT input->>'download_task_id' FROM engine.task_run WHERE id = %s", (ref.task_run_id,))
    assert protocol.execute(step) == "noop"  # not due yet: its backoff
    sql("UPDATE engine.step SET next_attempt_at = now() WHERE id = %s", (step,))
    assert protocol.execute(step) == "unavailable"
    # The request's timeline says why it does not move, once for the outage.
    notes = "SELECT count(*) FROM acq.task_event WHERE download_task_id = %s AND what = %s"
    assert scalar(notes, (task, "webhook unreachable")) == 1
