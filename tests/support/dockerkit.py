"""Docker for the tests: fail (never skip) with the reason when it cannot be used, and build or
reuse the images compose.ci.yaml and pytest-celery run (scripts/docker-images)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.services import ROOT


def docker_ok() -> None:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        pytest.fail("docker / docker-compose are not installed: run `bash scripts/setup`")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        reason = info.stderr[-500:]
        pytest.fail(f"the Docker daemon is not reachable (scripts/setup starts dockerd): {reason}")


@pytest.fixture(scope="session")
def images() -> None:
    """Built once per session; a warm cache builds nothing (inputs hashed into a label)."""
    docker_ok()
    built = subprocess.run(["bash", "scripts/docker-images"], cwd=ROOT, capture_output=True, text=True)
    if built.returncode != 0:
        pytest.fail(f"scripts/docker-images failed:\n{built.stdout[-2000:]}\n{built.stderr[-3000:]}")
    print(built.stdout)
