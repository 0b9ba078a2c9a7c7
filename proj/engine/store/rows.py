"""What the store modules share: how a guarded write says whether it landed, and a step named
for its message."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

from sqlalchemy import CursorResult, Result


def changed(result: Result[Any]) -> int:
    """The rows an UPDATE or DELETE changed: its guard sits in its WHERE clause, so 0 means the
    transition did not apply (the row was not where the caller expected it)."""
    return cast(CursorResult[Any], result).rowcount


class StepRef(NamedTuple):
    """A step row named for its message: id and step name."""

    id: int
    name: str
