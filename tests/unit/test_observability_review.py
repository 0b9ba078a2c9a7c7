"""Observability review, no services: JSON log lines stay valid UTF-8 JSON for any input."""

from __future__ import annotations

import json
import logging
import sys

from proj.logs import JsonFormatter


def _record(
    msg: str, *args: object, exc_info: object = None, stack_info: str | None = None
) -> logging.LogRecord:
    r = logging.LogRecord("proj.test", logging.WARNING, __file__, 1, msg, args, exc_info)  # type: ignore[arg-type]
    r.stack_info = stack_info
    return r


def test_a_lone_surrogate_still_makes_one_utf8_json_line() -> None:
    """A file name read from a non-UTF-8 disk (`os.listdir` decodes it with surrogateescape) in a
    message: the line must encode to UTF-8 (a FileHandler, Celery's --logfile, a pipe with strict
    errors) and parse back as JSON. Before: the formatter returned a str with a lone surrogate;
    the handler's write raised UnicodeEncodeError and the line was lost ('--- Logging error ---')."""
    name = b"Am\xe9lie.mkv".decode("utf-8", "surrogateescape")
    line = JsonFormatter().format(_record("file %s gone", name))
    raw = line.encode("utf-8")  # strict, as a FileHandler writes
    assert b"\n" not in raw
    got = json.loads(raw)
    assert got["message"].startswith("file Am") and got["message"].endswith(".mkv gone")


def test_newlines_nul_and_non_ascii_stay_on_one_json_line() -> None:
    line = JsonFormatter().format(_record("a\nb\x00c \u00e9t\u00e9 \u2603 %r", b"\xff\x00"))
    assert "\n" not in line and "\u00e9t\u00e9" in line  # readable, not \u-escaped
    assert json.loads(line)["message"] == "a\nb\x00c \u00e9t\u00e9 \u2603 b'\\xff\\x00'"


def test_an_exception_and_a_stack_are_in_the_json_line() -> None:
    try:
        raise ValueError("bad\nthing \udcff")
    except ValueError:
        exc_info = sys.exc_info()
    line = JsonFormatter().format(
        _record("boom", exc_info=exc_info, stack_info="Stack (most recent call last):\n  x")
    )
    got = json.loads(line.encode("utf-8"))
    assert "ValueError: bad" in got["exc"]
    assert got["stack"].startswith("Stack (most recent call last)")  # before: stack_info was dropped
