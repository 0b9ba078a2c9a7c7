"""Checking what callers hand the engine before anything is written (DESIGN §5: bad input
gets a clear, typed error and nothing is half-written): inputs against their kind's model,
idempotency keys, signal topics, reasons, and any JSON bound for a jsonb column.
Proof: `tests/integration/test_bad_input.py`."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import to_jsonable_python

from proj.engine.errors import BadIdempotencyKey, BadTopic, InvalidInput, PayloadTooLarge
from proj.engine.kind import Kind
from proj.settings import get_settings

TOPIC_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}(:[A-Za-z0-9_.\-/@+=]{1,200})*")  # whole topic: fullmatch
MAX_TOPIC_LEN = 512
MAX_KEY_LEN = 512


def unstorable(value: Any) -> str | None:
    """Why Postgres could not store this JSON-shaped value as text/jsonb (a NUL, a lone
    surrogate), or None. Checked before writing, so the error is typed and nothing is written."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if "\x00" in v:
                return "a NUL character"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return "an unpaired surrogate"
        elif isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return None


def to_json_text(value: Any, what: str) -> str:
    """Strict JSON for a jsonb column: no NaN/Infinity, nothing Postgres refuses; typed errors."""
    try:
        jsonable = to_jsonable_python(value)
        encoded = json.dumps(jsonable, allow_nan=False)
    except (ValueError, TypeError) as exc:  # PydanticSerializationError is a ValueError
        raise InvalidInput(f"{what} is not JSON-serialisable: {exc}") from exc
    if reason := unstorable(jsonable):
        raise InvalidInput(f"{what} contains {reason}")
    return encoded


def canonical_input(kind: Kind, input: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Validate against the kind's model; return the stored JSON and its hash.

    The hash covers only what the caller set (`exclude_unset`), so adding a defaulted field in a
    later version does not turn an honest retry into a conflict.
    """
    if not isinstance(input, Mapping):
        raise InvalidInput(f"input of {kind.name} must be a mapping, not {type(input).__name__}")
    try:
        model = kind.input_model.model_validate(dict(input))
    except ValidationError as exc:
        raise InvalidInput(f"invalid input for {kind.name}@{kind.version}: {exc}") from exc
    try:
        stored = model.model_dump(mode="json")
        given = to_jsonable_python(model.model_dump(mode="json", exclude_unset=True))
        encoded = json.dumps(stored, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, TypeError) as exc:  # unserialisable values in `Any` fields, NaN, ±inf
        raise InvalidInput(f"input of {kind.name} is not JSON-serialisable: {exc}") from exc
    if reason := unstorable(stored):
        raise InvalidInput(f"input of {kind.name} contains {reason}")
    limit = get_settings().max_input_bytes
    if len(encoded.encode()) > limit:
        raise PayloadTooLarge(f"input of {kind.name} is {len(encoded)} bytes, limit {limit}")
    digest = hashlib.sha256(json.dumps(given, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return stored, digest


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY_LEN or unstorable(key):
        raise BadIdempotencyKey(f"idempotency key must be 1..{MAX_KEY_LEN} characters, no NUL")


def check_reason(reason: str) -> None:
    if not isinstance(reason, str) or unstorable(reason):
        raise InvalidInput("a cancel/abandon reason must be text without NUL characters")


def check_topic(topic: str) -> None:
    if not isinstance(topic, str) or len(topic) > MAX_TOPIC_LEN or not TOPIC_RE.fullmatch(topic):
        raise BadTopic(
            f"bad signal topic {str(topic)[:100]!r}: expected 'name' or 'name:part' (at most "
            f"{MAX_TOPIC_LEN} characters), no spaces"
        )
