"""What the store modules share: how a guarded write says whether it landed, and a step named
for its message."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

from sqlalchemy import CursorResult, Result


def changed(result: Result[Any]) -> int:
    """The rows an UPDATE or DELETE changed: its guard sits in its WHERE clause, so 0 means the
    transition did not apply (the row was not where the caller expected it)."""
    return cast(CursorResult[Any], result).rowcount


class Known(NamedTuple):
    """The (kind, version) pairs this process knows, as two parallel arrays (see below).

    Why: the sweeper's statements that pick runs to end (a cancel to finish, a deadline passed,
    an orphaned child, a step whose attempts ran out) take only runs whose kind this process
    can load. Filtered only after the LIMIT, runs of a version nobody here knows took every
    place of the batch on every tick and starved the rest
    (`tests/integration/test_unserved_versions.py`)."""

    kinds: list[str]
    versions: list[int]

    def params(self) -> dict[str, list[str] | list[int]]:
        return {"known_kinds": self.kinds, "known_versions": self.versions}


# Each statement that takes a `Known` writes its test out whole (never spliced):
#   (kind, version) IN (SELECT * FROM unnest(CAST(:known_kinds AS text[]),
#                                            CAST(:known_versions AS int[])))


class StepRef(NamedTuple):
    """A step row named for its message: id and step name."""

    id: int
    name: str
