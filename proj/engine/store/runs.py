"""Reading runs by what business code knows of them: their kind and idempotency key.

Business code (acquisition, admin, CLI) names its runs by key (`acquire:<request id>`), never
by reading `engine.task_run` itself; this is that read, in the caller's transaction when it has
one. `(kind, idempotency_key)` is unique for all time (invariant 5), so a pair names one run.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.status import RunStatus


class RunByKey(NamedTuple):
    id: uuid.UUID
    kind: str
    idempotency_key: str
    version: int
    status: RunStatus
    created_at: datetime


FIND_BY_KEYS = text(
    """
    SELECT r.id, r.kind, r.idempotency_key, r.version, r.status, r.created_at
      FROM engine.task_run r
      JOIN unnest(CAST(:kinds AS text[]), CAST(:keys AS text[])) AS k(kind, key)
        ON r.kind = k.kind AND r.idempotency_key = k.key
     ORDER BY r.created_at, r.id
    """
)


def find_by_keys(s: Session, pairs: Sequence[tuple[str, str]]) -> list[RunByKey]:
    """The runs named by `(kind, idempotency_key)` pairs that exist, oldest first."""
    if not pairs:
        return []
    rows = s.execute(FIND_BY_KEYS, {"kinds": [k for k, _ in pairs], "keys": [key for _, key in pairs]})
    return [
        RunByKey(r.id, r.kind, r.idempotency_key, r.version, RunStatus(r.status), r.created_at) for r in rows
    ]
