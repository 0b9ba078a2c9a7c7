"""The Docker operator's path, reviewed: what the README's Docker section tells an operator to do
works as written on the images CI builds (scripts/docker-images), and what could go wrong
around it does not.

- `proj migrate` started by several containers at once (the `migrate` service beside a
  `docker compose run migrate`, or one replica per host): one migrates, the others wait and
  find the schema at head; none fails halfway (it used to: duplicate types and columns).

Docker that cannot run fails these tests with the reason (`tests/support/dockerkit.py`).
"""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from proj.engine.preflight import head_revision
from tests.support.dockerkit import images  # noqa: F401 - the session fixture
from tests.support.services import wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600), pytest.mark.usefixtures("images")]


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {r.stdout[-1000:]}{r.stderr[-2000:]}")
    return r


def test_migrate_started_by_several_containers_at_once_migrates_once() -> None:
    tag = f"projrace{uuid.uuid4().hex[:8]}"
    net, pg = tag, f"{tag}_pg"
    migrators = [f"{tag}_m{i}" for i in range(4)]
    try:
        docker("network", "create", net)
        docker(
            "run", "-d", "--name", pg, "--network", net,
            "-e", "POSTGRES_USER=proj", "-e", "POSTGRES_PASSWORD=pw", "-e", "POSTGRES_DB=proj",
            "proj/postgres:ci",
        )  # fmt: skip
        wait_for(
            lambda: docker("exec", pg, "pg_isready", "-q", "-h", "127.0.0.1", check=False).returncode == 0,
            60,
            interval=0.3,
            what="postgres",
        )
        # Each imports `proj` first, then runs `proj migrate` at the same wall-clock instant.
        at = time.time() + 8
        barrier = (
            "import sys, time; from proj.cli import main; sys.argv = ['proj', 'migrate']; "
            f"time.sleep(max(0.0, {at} - time.time())); main()"
        )
        for name in migrators:
            docker(
                "create", "--name", name, "--network", net,
                "-e", f"DATABASE_URL=postgresql://proj:pw@{pg}:5432/proj",
                "proj/app:ci", "python", "-c", barrier,
            )  # fmt: skip
        docker("start", *migrators)
        outcomes = {}
        for name in migrators:
            code = docker("wait", name, timeout=180).stdout.strip()
            logs = docker("logs", name)
            outcomes[name] = (code, (logs.stdout + logs.stderr).strip().splitlines()[-1:])
        head = head_revision()
        assert all(code == "0" for code, _ in outcomes.values()), outcomes
        assert all(last == [f"schema at {head}"] for _, last in outcomes.values()), outcomes
        version = docker("exec", pg, "psql", "-U", "proj", "-d", "proj", "-Atc", "TABLE alembic_version")
        assert version.stdout.split() == [head]
    finally:
        docker("rm", "-f", pg, *migrators, check=False)
        docker("network", "rm", net, check=False)
