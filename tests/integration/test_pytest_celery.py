"""Our worker image under pytest-celery's Docker setup (issue #15).

pytest-celery starts the containers; its image fixtures are pointed at images built here from
Debian packages (scripts/docker-images): our worker image (`proj/app:ci`) and a Redis broker
(`proj/redis:ci`). Postgres (`proj/postgres:ci`) joins the same network and is migrated by a
one-shot container before the worker starts. No result backend: results live in Postgres.
Runs are enqueued and read inside the worker container, where the configuration is.

- our kinds are served (every step task of every kind is registered on the worker);
- a durable run completes;
- the worker container killed mid-step: a new worker container resumes the step, through the
  sweeper, and the run completes.
Docker that cannot run fails these tests with the reason (`tests/integration/test_compose.py::docker_ok`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from pytest_celery import CeleryBrokerCluster, CeleryTestWorker, CeleryWorkerCluster, RedisTestBroker
from pytest_celery.vendors.worker.container import CeleryWorkerContainer
from pytest_docker_tools import container, fxtr

from tests.support.dockerkit import images  # noqa: F401 - the session fixture
from tests.support.services import wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600), pytest.mark.usefixtures("images")]

HERE = Path(__file__).resolve().parents[1]  # tests/
PG_PASSWORD = "pw-" + uuid.uuid4().hex[:8]


@pytest.fixture
def default_redis_broker_image() -> str:
    return "proj/redis:ci"


@pytest.fixture
def celery_broker_cluster(celery_redis_broker: RedisTestBroker) -> Iterator[CeleryBrokerCluster]:
    cluster = CeleryBrokerCluster(celery_redis_broker)  # Redis only: no registry for the others
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster() -> None:
    return None  # our steps store their results in Postgres


proj_postgres = container(
    image="proj/postgres:ci",
    environment={"POSTGRES_USER": "proj", "POSTGRES_PASSWORD": PG_PASSWORD, "POSTGRES_DB": "proj"},
    network="{default_pytest_celery_network.name}",
    timeout=60,
)


class ProjWorkerContainer(CeleryWorkerContainer):
    """`celery -A proj worker` from our image: it consumes its own version queues."""

    @classmethod
    def command(cls, *args: str, **kwargs: Any) -> list[str]:
        return ["celery", "-A", "proj", "worker", "--loglevel=INFO", "-n", "proj@%h", "-c", "2", *args]

    @property
    def ready_prompt(self) -> str:
        return "ready."


@pytest.fixture
def proj_env(proj_postgres: Any, celery_broker_cluster: CeleryBrokerCluster) -> dict[str, str]:
    pg = proj_postgres.attrs["Config"]["Hostname"]
    return {
        "DATABASE_URL": f"postgresql://proj:{PG_PASSWORD}@{pg}:5432/proj",
        "BROKER_URL": celery_broker_cluster.config()["urls"][0],
        "ENGINE_EXTRA_KINDS": "docker_kinds",
        "PYTHONPATH": "/kinds",
        "EXPECTED_WORKERS": "2",
        "LEASE_TTL_S": "15",
        "PROJ_ROLE": "worker",
    }


@pytest.fixture
def migrated(proj_env: dict[str, str], default_pytest_celery_network: Any, proj_postgres: Any) -> None:
    """`proj migrate` in a one-shot container of the worker image, as compose's `migrate` does."""
    client = docker.from_env()
    wait_for(lambda: proj_postgres.exec_run("pg_isready -h 127.0.0.1 -U proj").exit_code == 0, 60, what="pg")
    out = client.containers.run(
        "proj/app:ci",
        ["proj", "migrate"],
        environment=proj_env,
        network=default_pytest_celery_network.name,
        volumes={str(HERE / "docker"): {"bind": "/kinds", "mode": "ro"}},
        remove=True,
    )
    assert b"schema at" in out, out


proj_worker = container(
    image="proj/app:ci",
    environment=fxtr("proj_env"),
    network="{default_pytest_celery_network.name}",
    volumes={str(HERE / "docker"): {"bind": "/kinds", "mode": "ro"}},
    wrapper_class=ProjWorkerContainer,
    timeout=90,
    command=ProjWorkerContainer.command(),
)


@pytest.fixture
def celery_worker_cluster(migrated: None, proj_worker: ProjWorkerContainer, celery_setup_app: Any):
    worker = CeleryTestWorker(container=proj_worker, app=celery_setup_app)
    cluster = CeleryWorkerCluster(worker)
    yield cluster
    cluster.teardown()


def in_worker(setup: Any, code: str) -> Any:
    """Run Python in the worker container (its settings, its kinds); returns the printed JSON."""
    result = setup.worker.container.exec_run(["python", "-c", code])
    assert result.exit_code == 0, result.output.decode()[-3000:]
    return json.loads(result.output.decode().strip().splitlines()[-1])


def enqueue(setup: Any, kind: str, inp: dict[str, Any]) -> str:
    code = (
        "import json; from proj.engine import runs; "
        f"r = runs.enqueue({kind!r}, {inp!r}, idempotency_key='pc-' + __import__('uuid').uuid4().hex); "
        "print(json.dumps(str(r.task_run_id)))"
    )
    return str(in_worker(setup, code))


def view(setup: Any, run_id: str) -> dict[str, Any]:
    code = (
        "import json, uuid; from proj.engine import runs; "
        f"v = runs.get(uuid.UUID({run_id!r})); "
        "print(json.dumps({'status': v.status, 'result': v.result, 'attempts': v.attempts}, default=str))"
    )
    return dict(in_worker(setup, code))


def test_our_kinds_are_served(celery_setup: Any) -> None:
    """Asked over the broker container from inside its network (the setup app on the host would
    reach this machine's own Redis): the worker node answers with the step tasks it registered."""
    from proj.engine.kind import all_kinds

    node = f"proj@{celery_setup.worker.container.id[:12]}"  # -n proj@%h; %h is the container id
    code = (
        "import json; from proj.celery import app; "
        f"print(json.dumps(app.control.inspect(destination=[{node!r}], timeout=10).registered() or {{}}))"
    )
    replies = wait_for(lambda: in_worker(celery_setup, code), 30, interval=1, what=f"{node} to answer")
    registered = {t for tasks in replies.values() for t in tasks}
    ours = [
        k for k in all_kinds() if k.name in {"acquire", "import", "notify", "compensate", "demo", "purge"}
    ]
    expected = {k.task_name(s) for k in ours for s in k.step_names()}
    assert len(expected) > 10 and expected <= registered, sorted(expected - registered)
    assert {"docker_slow.v1.slow", "docker_slow.v1.done", "engine.sweep"} <= registered


def test_a_durable_run_completes(celery_setup: Any) -> None:
    run_id = enqueue(celery_setup, "demo", {"title": "pytest-celery", "parts": 4})
    wait_for(lambda: view(celery_setup, run_id)["status"] == "succeeded", 60, interval=1, what="the demo run")
    result = view(celery_setup, run_id)["result"]
    assert result["parts"] == 4 and len(result["digests"]) == 4


def test_a_worker_container_killed_mid_step_recovers_through_the_sweeper(celery_setup: Any) -> None:
    first = celery_setup.worker
    run_id = enqueue(celery_setup, "docker_slow", {"seconds": 8.0})
    wait_for(
        lambda: view(celery_setup, run_id)["status"] == "running", 60, interval=0.5, what="the slow step"
    )
    first.kill()  # SIGKILL of the whole container: its Postgres sessions end with it
    docker.from_env().containers.get(first.container.id).start()  # the orchestrator's restart
    first.container.reload()
    wait_for(lambda: "ready." in first.logs(), 90, interval=1, what="the restarted worker")
    wait_for(lambda: view(celery_setup, run_id)["status"] == "succeeded", 90, interval=1, what="recovery")
    result = view(celery_setup, run_id)["result"]
    assert result["after"]["attempt"] == 2, result  # the killed attempt, then one more
