"""`proj-healthcheck`, the containers' HEALTHCHECK, stays light: Docker runs it every 10 s in four
containers, and through `proj.cli` and the engine's Celery app it cost about 37 % of one core on
an idle stack. The admin and Flower probes import only the standard library; the worker and
beat probes a bare Celery client, never SQLAlchemy, alembic or the engine. No service needed:
the probes here find nothing to answer, and the modules they loaded are what is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("sqlalchemy", "alembic", "proj.cli", "proj.celery", "proj.engine", "proj.db", "fastapi")

PROBE = """
import json, sys
from proj import health
code = health.main(sys.argv[1:])
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def probe(*args: str) -> dict[str, object]:
    env = {
        **os.environ,
        "BROKER_URL": "redis://127.0.0.1:1/0",  # nothing listens on port 1
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("role", ["admin", "flower", "worker", "beat"])
def test_the_probe_of_every_role_imports_neither_the_engine_nor_the_cli(role: str) -> None:
    seen = probe(
        "--role", role, "--timeout", "0.5", *(["--port", "1"] if role in ("admin", "flower") else [])
    )
    assert seen["code"] == 1, "nothing answers here"
    modules = seen["modules"]
    assert isinstance(modules, list)
    loaded = [
        m for m in modules if m.split(".")[0] in HEAVY or any(m.startswith(h + ".") or m == h for h in HEAVY)
    ]
    assert loaded == [], loaded
    if role in ("admin", "flower"):
        assert "celery" not in modules and "pydantic" not in modules, "the standard library only"
