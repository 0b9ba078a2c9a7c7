"""OpenTelemetry: one trace per run (enqueue span, one span per step attempt, the run span),
collected in-process with the SDK's in-memory exporter (the `inproc` worker runs here)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from proj.engine import tracing
from tests.conftest import new_key
from tests.support.services import ROOT, scalar, wait_for


class Collector(InMemorySpanExporter):
    """Keeps spans only while a test of this module runs (the provider is process-wide)."""

    active = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return super().export(spans) if self.active else SpanExportResult.SUCCESS


COLLECTOR = Collector()


@pytest.fixture
def spans() -> Iterator[Collector]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    if not getattr(provider, "_proj_test_collector", False):
        provider.add_span_processor(SimpleSpanProcessor(COLLECTOR))
        provider._proj_test_collector = True  # type: ignore[attr-defined]
    COLLECTOR.clear()
    COLLECTOR.active = True
    yield COLLECTOR
    COLLECTOR.active = False
    COLLECTOR.clear()


def _status(run_id) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def _by_trace(collected: Collector) -> dict[int, list[ReadableSpan]]:
    out: dict[int, list[ReadableSpan]] = defaultdict(list)
    for span in collected.get_finished_spans():
        out[span.context.trace_id].append(span)
    return out


def _named(spans: list[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def _enqueue(engine, how: str, kind: str, inputs: list[dict]) -> list:
    """Runs enqueued one by one, or as one batch (`enqueue_many`: sibling enqueue spans)."""
    if how == "batch":
        return engine.enqueue_many(kind, [(new_key(), inp) for inp in inputs])
    return [engine.enqueue(kind, inp, idempotency_key=new_key()) for inp in inputs]


@pytest.mark.parametrize("how", ["single", "batch"])
def test_each_run_is_one_trace_with_a_span_per_step_attempt(inproc, spans, how: str) -> None:
    refs = _enqueue(inproc, how, "probe", [{"n": i} for i in range(3)])
    for ref in refs:
        wait_for(lambda ref=ref: _status(ref.task_run_id) == "succeeded", 30, what="run to finish")
    # enqueue + 5 steps + the run span, per run
    wait_for(lambda: len(spans.get_finished_spans()) >= 21, 10, what="all spans")

    traces = _by_trace(spans)
    assert len(traces) == 3, "one trace per run"
    by_run = {}
    for group in traces.values():
        run_ids = {s.attributes["engine.run_id"] for s in group}
        assert len(run_ids) == 1, "a trace holds exactly one run"
        by_run[run_ids.pop()] = group
    assert set(by_run) == {str(r.task_run_id) for r in refs}

    for run_id, group in by_run.items():
        (enq,) = _named(group, "enqueue probe")
        (run,) = _named(group, "run probe")
        steps = sorted(_named(group, "probe.v1."), key=lambda s: s.start_time)
        assert len(group) == 7
        assert [s.name for s in steps] == [f"probe.v1.s{i}" for i in range(1, 6)]
        assert enq.parent is None, "no caller span: the enqueue span is the root"
        assert enq.kind == trace.SpanKind.PRODUCER and enq.attributes["engine.created"] is True
        for s in steps:
            assert s.parent.span_id == enq.context.span_id
            assert s.kind == trace.SpanKind.CONSUMER
            assert s.attributes["engine.kind"] == "probe"
            assert s.attributes["engine.version"] == 1
            assert s.attributes["engine.run_id"] == run_id
            assert s.attributes["engine.attempt"] == 1
            assert s.attributes["engine.outcome"] == "succeeded"
            assert s.status.status_code != StatusCode.ERROR
        assert run.parent.span_id == enq.context.span_id
        assert run.attributes["engine.outcome"] == "succeeded"
        # The run spans created_at .. finished_at (database clock, set in the last commit).
        assert run.start_time <= enq.end_time <= steps[0].start_time <= steps[-1].start_time <= run.end_time


def test_failed_attempts_and_the_dead_letter_are_error_spans(inproc, spans) -> None:
    ref = inproc.enqueue("flaky", {"message": "tracker down"}, idempotency_key=new_key())
    wait_for(lambda: _status(ref.task_run_id) == "failed", 30, what="run to fail")
    wait_for(lambda: _named(list(spans.get_finished_spans()), "run flaky"), 10, what="the run span")

    (group,) = _by_trace(spans).values()
    fails = sorted(_named(group, "flaky.v1.fails"), key=lambda s: s.start_time)
    assert [s.attributes["engine.attempt"] for s in fails] == [1, 2, 3]
    assert [s.attributes["engine.outcome"] for s in fails] == ["retry", "retry", "failed"]
    assert all(s.status.status_code == StatusCode.ERROR for s in fails)
    assert any(e.name == "exception" for e in fails[-1].events)
    (run,) = _named(group, "run flaky")
    assert run.attributes["engine.outcome"] == "failed" and run.status.status_code == StatusCode.ERROR


@pytest.mark.parametrize("how", ["single", "batch"])
def test_the_callers_span_is_the_parent_of_the_run(inproc, spans, how: str) -> None:
    """Enqueue inside a span (a request, an outbox dispatch): the run joins that trace."""
    with tracing.tracer().start_as_current_span("outbox.dispatch") as caller:
        (ref,) = _enqueue(inproc, how, "fan", [{"items": 3}])
    wait_for(lambda: _status(ref.task_run_id) == "succeeded", 30, what="run to finish")
    wait_for(lambda: _named(list(spans.get_finished_spans()), "run fan"), 10, what="the run span")

    (group,) = _by_trace(spans).values()
    assert {s.context.trace_id for s in group} == {caller.get_span_context().trace_id}
    (enq,) = _named(group, "enqueue fan")
    assert enq.parent.span_id == caller.get_span_context().span_id
    each = _named(group, "fan.v1.each")
    assert sorted(s.attributes["engine.item_index"] for s in each) == [0, 1, 2]
    assert all(s.parent.span_id == enq.context.span_id for s in _named(group, "fan.v1."))


def test_no_exporter_unless_configured_and_otlp_when_it_is() -> None:
    """No endpoint: the API's no-op provider stays. An endpoint: the SDK with the OTLP exporter."""
    code = (
        "from opentelemetry import trace\n"
        "from proj.engine import tracing\n"
        "installed = tracing.configure()\n"
        "p = trace.get_tracer_provider()\n"
        "procs = getattr(getattr(p, '_active_span_processor', None), '_span_processors', ())\n"
        "exporters = [type(getattr(x, '_exporter', getattr(x, 'span_exporter', None))).__name__ "
        "for x in procs]\n"
        "rec = tracing.tracer().start_span('x').is_recording()\n"
        "print(installed, type(p).__name__, exporters, rec)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT)
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split()[0] == "False" and "TracerProvider" in off.stdout
    assert off.stdout.strip().endswith("False"), f"spans must not record: {off.stdout}"
    assert not off.stdout.split()[1].startswith("TracerProvider")

    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
    env["OTEL_BSP_EXPORT_TIMEOUT"] = "500"
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split()[:2] == ["True", "TracerProvider"], on.stdout
    assert "OTLPSpanExporter" in on.stdout and on.stdout.strip().endswith("True")


def test_an_outbox_event_carries_the_business_trace_to_its_run(inproc, spans) -> None:
    """The request span that added an outbox event is the root of the run's trace: the event
    stores the context, its dispatch span is the request's child, the enqueue the dispatch's."""
    import outbox
    from proj import db

    with tracing.tracer().start_as_current_span("POST /requests") as request, db.transaction() as s:
        event_id = outbox.add(s, "fan", new_key(), {"items": 2})
    stored = scalar("SELECT trace FROM outbox.outbox_event WHERE id = %s", (event_id,))
    assert stored and "traceparent" in stored, stored
    # Outside the request span, as beat would be. The post-commit nudge may have the worker
    # dispatch it first (this call then skips the locked row): wait for whichever committed.
    outbox.dispatch(db.sessions(), inproc)
    run_id = wait_for(
        lambda: scalar("SELECT run_ref FROM outbox.outbox_event WHERE id = %s", (event_id,)),
        10,
        what="the event to be dispatched",
    )
    wait_for(lambda: _status(run_id) == "succeeded", 30, what="run to finish")
    wait_for(lambda: _named(list(spans.get_finished_spans()), "run fan"), 10, what="the run span")

    group = _by_trace(spans)[request.get_span_context().trace_id]
    (dispatched,) = _named(group, "outbox.dispatch fan")
    assert dispatched.parent.span_id == request.get_span_context().span_id
    assert dispatched.attributes["outbox.event_id"] == event_id
    (enq,) = _named(group, "enqueue fan")
    assert enq.parent.span_id == dispatched.context.span_id
    assert len(_named(group, "fan.v1.")) >= 3 and _named(group, "run fan"), "the run's spans joined"


def test_an_outbox_event_added_outside_any_span_stores_no_trace(inproc) -> None:
    import outbox
    from proj import db

    with db.transaction() as s:
        event_id = outbox.add(s, "fan", new_key(), {"items": 1})
    assert scalar("SELECT trace FROM outbox.outbox_event WHERE id = %s", (event_id,)) is None
