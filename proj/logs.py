"""Log lines as JSON (`LOG_FORMAT=json`), each naming the step it came from.

Why: a log shipper (Loki, Elasticsearch) must be able to find every line of one run or one
attempt without parsing prose. With `LOG_FORMAT=json` every line is one JSON object with `ts`,
`level`, `logger`, `message` and the step's `run_id`, `kind`, `step`, `attempt`, plus `worker`
and `trace_id` (null when unknown, e.g. outside a step or with tracing off). The default
(`text`) leaves Celery's and uvicorn's human-readable formats as they are.

The step fields come from a context variable set around each attempt by the step protocol
(`proj.engine.protocol._run_claimed`, the one place a step body runs); a context variable is
per thread and per task, so concurrent steps of a thread pool never mix. Wired for workers and
beat by Celery's `after_setup_logger` / `after_setup_task_logger` signals (`proj.celery`), for
`proj admin` through uvicorn's `log_config`, and for the other CLI commands by `configure()`.

Proof: `tests/integration/test_json_logs.py` (a real worker subprocess, a step that logs, every line parsed).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class StepFields:
    """What a log line says about the step attempt it was written in."""

    run_id: str
    kind: str
    step: str
    attempt: int
    worker: str


CURRENT_STEP: ContextVar[StepFields | None] = ContextVar("proj_current_step", default=None)


@contextmanager
def step_fields(fields: StepFields) -> Iterator[None]:
    """Lines logged inside carry `fields` (the protocol wraps each attempt in it)."""
    token = CURRENT_STEP.set(fields)
    try:
        yield
    finally:
        CURRENT_STEP.reset(token)


def this_worker() -> str:
    """host:pid, for lines logged outside a step."""
    return f"{socket.gethostname()}:{os.getpid()}"


def trace_id() -> str | None:
    """The current OpenTelemetry trace id (32 hex digits), or None without a valid span."""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line that encodes to UTF-8 whatever the message holds
    (`tests/unit/test_observability_review.py`); the step fields are null outside a step."""

    def format(self, record: logging.LogRecord) -> str:
        step = CURRENT_STEP.get()
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "run_id": step.run_id if step else None,
            "kind": step.kind if step else None,
            "step": step.step if step else None,
            "attempt": step.attempt if step else None,
            "worker": step.worker if step else this_worker(),
            "trace_id": trace_id(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        line = json.dumps(out, default=str, ensure_ascii=False)
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (a file name decoded with surrogateescape): escaped as \udcXX,
            # the line stays valid JSON that any UTF-8 stream can write.
            line = json.dumps(out, default=str, ensure_ascii=True)
        return line


def json_enabled() -> bool:
    from proj.settings import get_settings

    return get_settings().log_format == "json"


def use_json(logger: logging.Logger) -> None:
    """Give every handler of `logger` the JSON formatter (Celery's signal hands us the loggers
    it has just set up; their handlers stay, only the format changes)."""
    for handler in logger.handlers:
        handler.setFormatter(JsonFormatter())


def configure(level: int = logging.INFO) -> None:
    """For CLI commands: with `LOG_FORMAT=json`, a root handler on stderr that writes JSON.
    Without it nothing changes (the CLI prints for people through rich)."""
    if not json_enabled():
        return
    root = logging.getLogger()
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
    root.setLevel(level)


def uvicorn_log_config() -> dict[str, Any] | None:
    """uvicorn's `log_config` for `proj admin`: JSON for its own loggers and the root (engine
    lines logged by the admin's requests), or None to keep uvicorn's default."""
    if not json_enabled():
        return None
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "proj.logs.JsonFormatter"}},
        "handlers": {"default": handler},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["default"], "level": "INFO", "propagate": False},
        },
        "root": {"handlers": ["default"], "level": "INFO"},
    }
