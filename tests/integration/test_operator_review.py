"""An operator's review of the README's commands outside the test suite: each test names what an
operator saw before its fix. `proj` runs as the operator runs it (a subprocess, stdout piped),
against the test database and broker."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.services import ROOT


def proj_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "COLUMNS": "250", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "proj.cli", *args], env=full, capture_output=True, text=True, timeout=120
    )


def test_a_database_url_that_is_not_postgres_says_so() -> None:
    """Before: `DATABASE_URL=mysql://…` answered `ModuleNotFoundError: No module named 'MySQLdb'`,
    a URL without a scheme `ArgumentError: Could not parse SQLAlchemy URL`, `sqlite:///…` a
    `TypeError`, and `proj doctor` itself ended on them instead of reporting its postgres check.
    Now every command says DATABASE_URL must be a Postgres URL, without the URL's password, and
    doctor reports it as the failed postgres check."""
    for url in ("mysql://root:hunter2@127.0.0.1/test", "notaurl", "sqlite:///x.db"):
        done = proj_run("runs", env={"DATABASE_URL": url})
        assert done.returncode == 1, (url, done.stdout, done.stderr)
        assert "DATABASE_URL must be a Postgres URL" in done.stderr, (url, done.stderr)
        assert "Traceback" not in done.stderr and "hunter2" not in done.stderr, done.stderr

        doctor = proj_run("doctor", env={"DATABASE_URL": url})
        assert doctor.returncode == 1, (url, doctor.stdout, doctor.stderr)
        out = doctor.stdout + doctor.stderr
        assert "DATABASE_URL must be a Postgres URL" in out and "check(s) failed: postgres" in out, out
        assert "hunter2" not in out, out
