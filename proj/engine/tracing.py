"""OpenTelemetry for runs and step attempts.

A run crosses processes (the enqueuer, any number of workers, the sweeper), so its trace context
travels through Postgres, not through Celery headers: `enqueue` records an `enqueue <kind>` span
(a child of the caller's current span, e.g. an outbox dispatch or a web request) and stores its
W3C `traceparent` in `task_run.trace`. Every delivery of every step, including a republish by
the sweeper, extracts it and records a `<kind>.v<version>.<step>` span per attempt, and the run's
end records a `run <kind>` span from `created_at` to `finished_at`. All of a run's spans therefore
share one trace id.

Nothing is exported unless configured: with `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) set, the first use in a process installs the SDK with the
standard OTLP/HTTP exporter (`pip install proj[otel]`); otherwise the API's no-op tracer is used
and the cost is a few function calls. An application (or a test) that installs its own SDK
provider first keeps it.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from sqlalchemy import event
from sqlalchemy.orm import Session

from proj.engine.status import Outcome, RunStatus

log = logging.getLogger(__name__)

TRACER_NAME = "proj.engine"
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
# Step outcomes that mean the attempt did not do its work.
ERROR_OUTCOMES = frozenset({Outcome.FAILED, Outcome.RETRY, Outcome.UNAVAILABLE, Outcome.LEASE_LOST})

_lock = threading.Lock()
_configured_pid: int | None = None


def configure() -> bool:
    """Install the SDK + OTLP exporter once per process when an endpoint is configured.

    Returns whether this call installed a provider. A provider already installed (by the
    application or a test) is left alone; so is everything when no endpoint is set.
    """
    global _configured_pid
    if _configured_pid == os.getpid():
        return False
    with _lock:
        if _configured_pid == os.getpid():
            return False
        _configured_pid = os.getpid()
        if not any(os.environ.get(v) for v in ENDPOINT_VARS):
            return False
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if isinstance(trace.get_tracer_provider(), TracerProvider):
            return False
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set but the OTLP exporter is not installed "
                "(pip install 'proj[otel]'); traces are not exported"
            )
            return False
        service = os.environ.get("OTEL_SERVICE_NAME", "proj")
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        return True


def tracer() -> trace.Tracer:
    """The engine's tracer (configuring the exporter on first use in this process)."""
    configure()
    return trace.get_tracer(TRACER_NAME)


def _off() -> bool:
    """No tracer provider is installed in this process: every span would be a no-op."""
    configure()
    return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered (a prefork child about to exit)."""
    provider = trace.get_tracer_provider()
    force = getattr(provider, "force_flush", None)
    if force is not None:
        try:
            force(timeout_ms)
        except Exception as exc:  # telemetry never breaks the engine
            log.debug("trace flush failed: %s", exc)


def _attrs(kind: str, version: int, run_id: uuid.UUID | str) -> dict[str, Any]:
    return {"engine.kind": kind, "engine.version": version, "engine.run_id": str(run_id)}


def _nanos(at: datetime | None) -> int | None:
    return int(at.timestamp() * 1_000_000_000) if at is not None else None


@contextmanager
def enqueue_span(
    kind: str, version: int, run_id: uuid.UUID, parent: Mapping[str, Any] | None = None
) -> Iterator[tuple[Span, dict[str, str] | None]]:
    """The `enqueue <kind>` span and the carrier to store in `task_run.trace`.

    Its parent is `parent` (a carrier the caller saved, e.g. with a business event) or else the
    current context. The carrier is None when tracing is off (nothing to propagate).
    """
    ctx = propagate.extract(dict(parent)) if parent else None
    with tracer().start_as_current_span(
        f"enqueue {kind}", context=ctx, kind=SpanKind.PRODUCER, attributes=_attrs(kind, version, run_id)
    ) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        yield span, (carrier or None)


@contextmanager
def enqueue_spans(
    kind: str, version: int, run_ids: list[uuid.UUID], parent: Mapping[str, Any] | None = None
) -> Iterator[list[tuple[Span, dict[str, str] | None]]]:
    """`enqueue_span` for each run of a batch (`chain.insert_runs`): sibling spans, each the
    parent of its own run's trace, all open until the batch is written."""
    ctx = propagate.extract(dict(parent)) if parent else None
    spans: list[tuple[Span, dict[str, str] | None]] = []
    try:
        for run_id in run_ids:
            span = tracer().start_span(
                f"enqueue {kind}",
                context=ctx,
                kind=SpanKind.PRODUCER,
                attributes=_attrs(kind, version, run_id),
            )
            carrier: dict[str, str] = {}
            propagate.inject(carrier, context=trace.set_span_in_context(span, ctx))
            spans.append((span, carrier or None))
        yield spans
    except BaseException as exc:
        for span, _ in spans:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
        raise
    finally:
        for span, _ in spans:
            span.end()


def skipped(carrier: Mapping[str, Any] | None) -> bool:
    """Whether `step_span` would skip this attempt's span (no trace to join, no tracer set)."""
    return not carrier and _off()


@contextmanager
def step_span(
    carrier: Mapping[str, Any] | None,
    *,
    kind: str,
    version: int,
    run_id: uuid.UUID,
    step: str,
    attempt: int,
    item_index: int | None = None,
) -> Iterator[Span]:
    """One step attempt, a child of the run's enqueue span. The caller sets `engine.outcome`.

    `item_index` is the position of a fan-out item (None for a plain step).
    """
    if skipped(carrier):
        yield trace.INVALID_SPAN  # nothing to join and nowhere to send it: skip the span's cost
        return
    ctx = propagate.extract(dict(carrier)) if carrier else None
    attrs = {**_attrs(kind, version, run_id), "engine.step": step, "engine.attempt": attempt}
    if item_index is not None:
        attrs["engine.item_index"] = item_index
    with tracer().start_as_current_span(
        f"{kind}.v{version}.{step}",
        context=ctx,
        kind=SpanKind.CONSUMER,
        attributes=attrs,
        record_exception=True,
        set_status_on_exception=True,
    ) as span:
        yield span


def set_outcome(span: Span, outcome: str, exc: BaseException | None = None) -> None:
    """Record how a step attempt ended; failures mark the span as an error."""
    span.set_attribute("engine.outcome", outcome)
    if exc is not None:
        span.record_exception(exc)
    if outcome in ERROR_OUTCOMES:
        span.set_status(Status(StatusCode.ERROR, str(exc)[:200] if exc else outcome))


def run_finished(s: Session, run: Any, status: RunStatus, finished_at: datetime | None) -> None:
    """Emit the `run <kind>` span once the transaction that finished the run commits.

    `run` needs id, kind, version, trace and created_at. Nothing happens on rollback.
    """
    if run.trace:  # tracing was off at enqueue: there is no trace to join
        event.listen(s, "after_commit", lambda _s: run_span(run, status, finished_at), once=True)


def run_span(run: Any, status: RunStatus, finished_at: datetime | None) -> None:
    """Emit the `run <kind>` span now: the run's end is committed already."""
    if not run.trace:
        return
    try:
        ctx = propagate.extract(dict(run.trace))
        span = tracer().start_span(
            f"run {run.kind}",
            context=ctx,
            kind=SpanKind.INTERNAL,
            attributes={**_attrs(run.kind, run.version, run.id), "engine.outcome": status},
            start_time=_nanos(run.created_at),
        )
        if status != RunStatus.SUCCEEDED:
            span.set_status(Status(StatusCode.ERROR, status))
        span.end(end_time=_nanos(finished_at))
    except Exception as exc:  # telemetry never breaks the engine
        log.debug("run span failed: %s", exc)
