"""The plan a prepared statement of the engine gets, for tests that pin a statement's index use
(statistics taken before a backlog or a crowd of waiting runs built up must not change it)."""

from __future__ import annotations

import os
from typing import Any


def generic_plan(statement: Any, values: dict[str, str], types: dict[str, str]) -> str:
    """EXPLAIN ANALYZE of the plan a prepared statement gets once the driver has prepared it
    (psycopg does after 5 runs), rolled back. `values` are SQL literals per bind name."""
    import re

    import psycopg

    from tests.support.services import pg_url

    names: list[str] = []

    def bind(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    body = re.sub(r"(?<!:):(\w+)", bind, statement.text)
    # A session of its own (PREPARE and SET outlive a transaction pooler's transaction): the
    # direct URL when the suite runs through PgBouncer (`PROJ_TEST_PGBOUNCER`).
    direct = os.environ.get("LIVENESS_DATABASE_URL") or pg_url()
    with psycopg.connect(direct.replace("postgresql+psycopg://", "postgresql://")) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"PREPARE probe ({', '.join(types[n] for n in names)}) AS " + body)
        rows = conn.execute(
            f"EXPLAIN (ANALYZE, COSTS OFF) EXECUTE probe({', '.join(values[n] for n in names)})"
        )
        plan = "\n".join(r[0] for r in rows)
        conn.rollback()
    return plan
