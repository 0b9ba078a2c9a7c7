"""Optional OpenTelemetry for the outbox: the adding transaction's trace follows its event.

`add` stores the caller's W3C trace context with the event; `dispatch` hands the event to the
engine inside an `outbox.dispatch <kind>` span parented on it, so the run the engine enqueues
joins the business request's trace. Without `opentelemetry` installed (the outbox does not
require it) both are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import propagate, trace
except ImportError:  # pragma: no cover - the outbox works without OpenTelemetry
    propagate = trace = None  # type: ignore[assignment]


def carrier() -> dict[str, str] | None:
    """The current trace context as a W3C carrier, or None outside any recording span."""
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return None
    out: dict[str, str] = {}
    propagate.inject(out)
    return out or None


@contextmanager
def dispatch_span(stored: Mapping[str, Any] | None, event_id: int, kind: str, key: str) -> Iterator[None]:
    """One span per handed-over event, child of the trace stored with it (if any)."""
    if trace is None:
        yield
        return
    parent = propagate.extract(dict(stored)) if stored else None
    tracer = trace.get_tracer("outbox")
    attrs: dict[str, str | int] = {
        "outbox.event_id": event_id,
        "outbox.kind": kind,
        "outbox.idempotency_key": key,
    }
    with tracer.start_as_current_span(
        f"outbox.dispatch {kind}", context=parent, kind=trace.SpanKind.PRODUCER, attributes=attrs
    ):
        yield
