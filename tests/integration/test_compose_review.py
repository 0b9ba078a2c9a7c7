"""The Docker operator's path, reviewed: what the README's Docker section tells an operator to do
works as written on the images CI builds (scripts/docker-images), and what could go wrong
around it does not.

- `proj migrate` started by several containers at once (the `migrate` service beside a
  `docker compose run migrate`, or one replica per host): one migrates, the others wait and
  find the schema at head; none fails halfway (it used to: duplicate types and columns).
- `proj migrate` on a schema a newer version migrated (a rollback to the previous image) says
  so, and what to do, instead of alembic's "Can't locate revision".
- a POSTGRES_PASSWORD with characters a URL reserves (`@ : / # % ?`) reaches Postgres.
- the README's commands as written: the secrets in `.env`, so that `docker compose exec admin
  proj requests` (and logs, ps, down) run at all; no secret on a process' command line (Flower's
  `--basic-auth` and the on-finish hook's curl were, for every local user's `ps`); an upgrade (a
  rebuilt image with a new migration, `docker compose up -d` again) migrates before the new app
  containers start.
- every container's log is capped (json-file grew without bound).
- the worker count is one setting (`WORKER_REPLICAS`): the replicas and the connection-budget
  preflight's EXPECTED_WORKERS (a fixed "1" under-counted `--scale worker=3`); Postgres has a
  `start_period` for a first init; qBittorrent's peer port (`QBT_PEER_PORT`) is published, TCP
  and UDP, as the port it listens on.

Docker that cannot run fails these tests with the reason (`tests/support/dockerkit.py`).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from proj.engine.preflight import head_revision
from proj.qbt.local import free_port
from tests.support.dockerkit import images  # noqa: F401 - the session fixture
from tests.support.services import ROOT, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600), pytest.mark.usefixtures("images")]


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {r.stdout[-1000:]}{r.stderr[-2000:]}")
    return r


@dataclass
class Postgres:
    """A Postgres container of CI's image on a network of its own, for one-shot app containers."""

    net: str
    name: str

    def url(self, db: str) -> str:
        return f"postgresql://proj:pw@{self.name}:5432/{db}"

    def psql(self, db: str, sql: str) -> str:
        return docker("exec", self.name, "psql", "-U", "proj", "-d", db, "-Atc", sql).stdout.strip()


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    tag = f"projreview{uuid.uuid4().hex[:8]}"
    pg = Postgres(tag, f"{tag}_pg")
    try:
        docker("network", "create", pg.net)
        docker(
            "run", "-d", "--name", pg.name, "--network", pg.net,
            "-e", "POSTGRES_USER=proj", "-e", "POSTGRES_PASSWORD=pw", "-e", "POSTGRES_DB=proj",
            "proj/postgres:ci",
        )  # fmt: skip
        wait_for(
            lambda: (
                docker("exec", pg.name, "pg_isready", "-q", "-h", "127.0.0.1", check=False).returncode == 0
            ),
            60,
            interval=0.3,
            what="postgres",
        )
        yield pg
    finally:
        docker("rm", "-f", pg.name, check=False)
        docker("network", "rm", pg.net, check=False)


def one_shot(pg: Postgres, name: str, db: str, *command: str) -> tuple[str, str]:
    """Run an app container to its end: (exit code, its output)."""
    try:
        docker(
            "run", "--name", name, "--network", pg.net, "-e", f"DATABASE_URL={pg.url(db)}",
            "proj/app:ci", *command, check=False, timeout=180,
        )  # fmt: skip
        code = docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        logs = docker("logs", name)
        return code, logs.stdout + logs.stderr
    finally:
        docker("rm", "-f", name, check=False)


def test_migrate_started_by_several_containers_at_once_migrates_once(postgres: Postgres) -> None:
    pg = postgres
    migrators = [f"{pg.net}_m{i}" for i in range(4)]
    try:
        # Each imports `proj` first, then runs `proj migrate` at the same wall-clock instant.
        at = time.time() + 8
        barrier = (
            "import sys, time; from proj.cli import main; sys.argv = ['proj', 'migrate']; "
            f"time.sleep(max(0.0, {at} - time.time())); main()"
        )
        for name in migrators:
            docker(
                "create", "--name", name, "--network", pg.net, "-e", f"DATABASE_URL={pg.url('proj')}",
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
        assert pg.psql("proj", "TABLE alembic_version") == head
    finally:
        docker("rm", "-f", *migrators, check=False)


def test_migrate_on_a_schema_a_newer_version_migrated_says_so(postgres: Postgres) -> None:
    """A rollback to the previous image after an upgrade that migrated: `migrate` (which the
    stack waits for) used to end on alembic's "Can't locate revision identified by …"."""
    pg = postgres
    pg.psql("proj", "CREATE DATABASE rollback")
    code, out = one_shot(pg, f"{pg.net}_up", "rollback", "proj", "migrate")
    assert code == "0", out
    pg.psql("rollback", "UPDATE alembic_version SET version_num = '9999_from_a_newer_version'")
    code, out = one_shot(pg, f"{pg.net}_back", "rollback", "proj", "migrate")
    assert code == "1", out
    line = " ".join(out.split())
    assert "9999_from_a_newer_version" in line and "newer version" in line, out
    assert "restore" in line and "Traceback" not in out, out


SECRETS = ("ADMIN_PASSWORD", "API_TOKEN", "HOOK_TOKEN")
APP_SERVICES = ("worker", "beat", "flower", "admin")
SERVICES = ("postgres", "redis", "qbittorrent", *APP_SERVICES)


def docker_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]


def readme_env_file(where: Path) -> dict[str, str]:
    """Run the README's Docker section's lines that write `.env`, as written, in `where`."""
    block = docker_section().split("```sh\n", 1)[1].split("```", 1)[0]
    lines = block.replace("\\\n", " ").splitlines()
    writes = [line for line in lines if "> .env" in line]
    assert writes, f"the README's Docker section writes no .env:\n{block}"
    subprocess.run(["bash", "-euc", "\n".join(writes)], cwd=where, check=True, capture_output=True)
    values = dict(line.split("=", 1) for line in (where / ".env").read_text().splitlines() if "=" in line)
    assert all(values.get(k) for k in SECRETS), values
    return values


@dataclass
class Operator:
    """An operator's shell in the checkout: the secrets in `.env` (here `--env-file`, the same
    file compose reads beside compose.yaml), none in the environment."""

    project: str
    env_file: Path
    secrets: dict[str, str]

    def compose(self, *args: str, files: tuple[str, ...] = (), check: bool = True) -> str:
        env = {k: v for k, v in os.environ.items() if k not in SECRETS}
        cmd = ["docker-compose", "--env-file", str(self.env_file), "-p", self.project]
        for f in ("compose.yaml", "compose.ci.yaml", *files):
            cmd += ["-f", f]
        r = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if check and r.returncode != 0:
            out = f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{out}")
        return r.stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def inspect(self, service: str, fmt: str) -> str:
        return docker("inspect", "-f", fmt, self.container(service)).stdout.strip()

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            return all(self.inspect(s, "{{.State.Health.Status}}") == "healthy" for s in APP_SERVICES)

        wait_for(healthy, 180, interval=1, what="worker, beat, flower and admin to be healthy")


@pytest.fixture
def operator(tmp_path: Path) -> Iterator[Operator]:
    values = readme_env_file(tmp_path)
    env_file = tmp_path / ".env"
    with env_file.open("a") as f:  # this test's ports, beside whatever else listens here
        f.write(f"ADMIN_PORT={free_port()}\nFLOWER_PORT={free_port()}\n")
    op = Operator(f"projop{uuid.uuid4().hex[:8]}", env_file, {k: values[k] for k in SECRETS})
    try:
        op.compose("up", "-d", "--no-build")
        yield op
    except BaseException:
        print(op.compose("logs", "--tail", "60", check=False))
        raise
    finally:
        op.compose("down", "-v", "--remove-orphans", check=False)


def upgraded_image(tmp_path: Path, tag: str) -> str:
    """proj/app:ci with one more migration, as a rebuilt image after `git pull` would be."""
    where = docker(
        "run", "--rm", "proj/app:ci", "python", "-c",
        "import migrations, os; print(os.path.dirname(migrations.__file__))",
    ).stdout.strip()  # fmt: skip
    ctx = tmp_path / "upgrade"
    ctx.mkdir()
    (ctx / "9999_upgrade_probe.py").write_text(
        f'revision = "9999_upgrade_probe"\ndown_revision = "{head_revision()}"\n'
        "branch_labels = depends_on = None\n\n\n"
        "def upgrade() -> None:\n"
        "    from alembic import op\n\n"
        '    op.execute("SELECT pg_sleep(2)")  # long enough for a worker that did not wait to show\n'
        '    op.execute("CREATE TABLE public.upgrade_probe (id int)")\n'
    )
    (ctx / "Dockerfile").write_text(
        f"FROM proj/app:ci\nCOPY 9999_upgrade_probe.py {where}/versions/9999_upgrade_probe.py\n"
    )
    docker("build", "-q", "-t", tag, str(ctx))
    return tag


def test_the_readme_operator_path_secrets_in_env_file_exec_no_secret_in_ps_and_an_upgrade(
    operator: Operator, tmp_path: Path
) -> None:
    op = operator
    # The README puts the secrets in `.env` (the fixture ran its lines): given only on `up`'s
    # command line, every later `docker compose` command (exec, logs, ps, down) refuses to run.
    assert "ADMIN_PASSWORD=… API_TOKEN=… HOOK_TOKEN=… docker" not in docker_section()
    assert (
        ".env" in (ROOT / ".gitignore").read_text().split()
        and ".env" in (ROOT / ".dockerignore").read_text().split()
    )
    op.wait_healthy()
    assert op.compose("exec", "-T", "admin", "proj", "requests").startswith("id\ttitle\trequester")

    # No secret on any process' command line (`ps` shows it to every local user), qBittorrent's
    # on-finish hook included: here it retries an admin that refuses, for some seconds.
    hook = subprocess.Popen(
        [
            "docker",
            "exec",
            op.container("qbittorrent"),
            "sh",
            "-c",
            "PROJ_HOOK_URL=http://admin:9/x on-finished 0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(
        lambda: "on-finished" in docker("top", op.container("qbittorrent"), "-eo", "pid,args").stdout,
        10,
        what="the on-finish hook to run",
    )
    time.sleep(0.5)
    for svc in ("qbittorrent", *(s for s in SERVICES if s != "qbittorrent")):
        top = docker("top", op.container(svc), "-eo", "pid,args").stdout
        leaked = [k for k, v in op.secrets.items() if v in top]
        assert not leaked, f"{svc} shows {leaked} on its command line:\n{top}"
        # and its log is capped (test_every_container_rotates_its_logs), as Docker applies it
        assert op.inspect(svc, '{{index .HostConfig.LogConfig.Config "max-size"}}') == "10m", svc
    hook.wait(30)

    # Upgrade: a rebuilt image with a new migration, `docker compose up -d` again: migrate runs
    # it before any app container of the new image starts, and they come up healthy on it.
    before = op.inspect("migrate", "{{.State.FinishedAt}}")
    tag = upgraded_image(tmp_path, f"proj/app:upgrade-{op.project}")
    override = tmp_path / "upgrade.yaml"
    override.write_text(
        "services:\n" + "".join(f'  {s}: {{image: "{tag}"}}\n' for s in ("migrate", *APP_SERVICES))
    )
    try:
        op.compose("up", "-d", "--no-build", files=(str(override),))
        op.wait_healthy()
        migrated = op.inspect("migrate", "{{.State.FinishedAt}}")
        assert migrated > before and op.inspect("migrate", "{{.State.ExitCode}}") == "0"
        for svc in APP_SERVICES:
            assert op.inspect(svc, "{{.Config.Image}}") == tag
            assert op.inspect(svc, "{{.State.StartedAt}}") > migrated, f"{svc} started before migrate"
        version = docker(
            "exec", op.container("postgres"), "psql", "-U", "proj", "-d", "proj", "-Atc",
            "TABLE alembic_version",
        ).stdout.split()  # fmt: skip
        assert version == ["9999_upgrade_probe"]
    finally:
        op.compose("down", "-v", "--remove-orphans", files=(str(override),), check=False)
        docker("rmi", "-f", tag, check=False)


def compose_config(env: dict[str, str]) -> dict[str, Any]:
    """compose.yaml + compose.ci.yaml as compose renders them with this environment (and not the
    checkout's .env: an empty env file)."""
    with tempfile.NamedTemporaryFile(suffix=".env") as none:
        return _compose_config(env, none.name)


def _compose_config(env: dict[str, str], env_file: str) -> dict[str, Any]:
    out = subprocess.run(
        ["docker-compose", "--env-file", env_file, "-f", "compose.yaml", "-f", "compose.ci.yaml", "config"],
        cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k not in SECRETS}, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(yaml.safe_load(out))


def test_a_postgres_password_with_url_characters_reaches_postgres(postgres: Postgres) -> None:
    """POSTGRES_PASSWORD from a password manager (`@ : / # % ?`): the app containers used to put
    it into DATABASE_URL as is, a URL libpq cannot parse, so `migrate` failed and nothing
    started."""
    password = "p@ss:w/rd#1%?x"
    env = {"POSTGRES_PASSWORD": password, **{k: "x" for k in SECRETS}}
    services = compose_config(env)["services"]
    pg_env, migrate_env = services["postgres"]["environment"], services["migrate"]["environment"]
    assert pg_env["POSTGRES_PASSWORD"] == password
    name = f"{postgres.net}_pgpw"
    try:
        docker(
            "run", "-d", "--name", name, "--network", postgres.net, "--network-alias", "postgres",
            *[a for k, v in pg_env.items() for a in ("-e", f"{k}={v}")], services["postgres"]["image"],
        )  # fmt: skip
        wait_for(
            lambda: docker("exec", name, "pg_isready", "-q", "-h", "127.0.0.1", check=False).returncode == 0,
            60,
            interval=0.3,
            what="postgres",
        )
        run = docker(
            "run", "--rm", "--network", postgres.net,
            *[a for k, v in migrate_env.items() for a in ("-e", f"{k}={v}")],
            services["migrate"]["image"], *services["migrate"]["command"], check=False, timeout=180,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"schema at {head_revision()}" in run.stdout
    finally:
        docker("rm", "-f", name, check=False)


def test_every_container_rotates_its_logs() -> None:
    """Docker's json-file logs grow without bound unless told otherwise, and an idle stack writes
    about 80 kB a minute (the worker and beat log every sweep and outbox tick): 40 GB a year on
    the operator's disk. Every service caps its log."""
    services = compose_config({k: "x" for k in SECRETS})["services"]
    unbounded = {
        name: svc.get("logging")
        for name, svc in services.items()
        if not (svc.get("logging", {}).get("options", {}).get("max-size"))
    }
    assert not unbounded, f"logs without max-size: {sorted(unbounded)}"


def test_a_stopped_worker_has_time_to_finish_its_running_steps() -> None:
    """`docker stop` (down, an upgrade) sends SIGTERM and Celery's warm shutdown lets the running
    steps finish, but Docker's default grace is 10 s: a step with a few seconds' more work was
    killed and ran again from the start elsewhere (a 30 s step re-ran as attempt 2 on every
    `down`). The worker is given a minute, and the operator can change it."""
    services = compose_config({k: "x" for k in SECRETS})["services"]
    grace = str(services["worker"].get("stop_grace_period", "10s"))
    assert grace == "1m0s" or grace in ("60s", "1m"), grace
    custom = compose_config({**{k: "x" for k in SECRETS}, "WORKER_STOP_GRACE": "5m"})["services"]
    assert str(custom["worker"]["stop_grace_period"]) in ("5m", "5m0s"), custom["worker"]["stop_grace_period"]


def duration_s(value: object) -> float:
    """A compose duration as rendered ("90s", "1m30s", "1m0s", "500ms") in seconds."""
    total, num = 0.0, ""
    text_ = str(value)
    i = 0
    while i < len(text_):
        ch = text_[i]
        if ch.isdigit() or ch == ".":
            num += ch
            i += 1
            continue
        unit = "ms" if text_.startswith("ms", i) else ch
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
        num, i = "", i + len(unit)
    return total + (float(num) if num else 0.0)


def published(ports: list[Any]) -> set[tuple[str, str, str, str]]:
    """(host ip, published, target, protocol) of a service's ports, from either compose's short
    strings (docker-compose 1.x) or its long form (Compose v2)."""
    out = set()
    for p in ports:
        if isinstance(p, dict):
            out.add(
                (
                    p.get("host_ip", ""),
                    str(p.get("published", "")),
                    str(p["target"]),
                    p.get("protocol", "tcp"),
                )
            )
            continue
        spec, _, proto = str(p).partition("/")
        parts = spec.rsplit(":", 2)
        ip, pub, target = ([""] * (3 - len(parts)) + parts)[-3:]
        out.add((ip, pub, target, proto or "tcp"))
    return out


def test_the_worker_count_is_one_setting_for_the_replicas_and_the_connection_budget() -> None:
    """`EXPECTED_WORKERS` was a fixed "1" while `--scale worker=3` ran three workers: the
    connection-budget preflight (EXPECTED_WORKERS x WORKER_CONCURRENCY x pool) counted a third of
    them. `WORKER_REPLICAS` is both how many worker containers run and what every app service
    tells the preflight."""
    secrets = {k: "x" for k in SECRETS}
    for env, want in (({}, 1), ({"WORKER_REPLICAS": "3"}, 3)):
        services = compose_config({**secrets, **env})["services"]
        assert int(services["worker"].get("deploy", {}).get("replicas", 1)) == want, services["worker"]
        for svc in ("migrate", *APP_SERVICES):
            assert services[svc]["environment"]["EXPECTED_WORKERS"] == str(want), svc
    assert "WORKER_REPLICAS" in docker_section() and "WORKER_REPLICAS" in (ROOT / ".env.example").read_text()


def test_postgres_has_time_for_a_first_init_before_it_can_be_unhealthy() -> None:
    """A first start initialises the database (initdb), which on a slow disk outlasted the
    healthcheck's retries: Postgres marked unhealthy, `migrate` and everything after it never
    started. Failures within `start_period` do not count."""
    services = compose_config({k: "x" for k in SECRETS})["services"]
    check = services["postgres"]["healthcheck"]
    assert duration_s(check.get("start_period", "0s")) >= 60, check
    assert services["postgres"]["healthcheck"]["test"][1] == "pg_isready"


def test_the_qbittorrent_peer_port_is_published_tcp_and_udp_as_it_listens() -> None:
    """qBittorrent's BitTorrent port was not published: no peer could connect in (only out), so
    a torrent with few seeders behind NAT never finished. It is published on TCP and UDP, the same
    number on both sides (qBittorrent announces the port it listens on), and `QBT_PEER_PORT`
    moves both."""
    secrets = {k: "x" for k in SECRETS}
    for env, port in (({}, "6881"), ({"QBT_PEER_PORT": "51413"}, "51413")):
        qbt = compose_config({**secrets, **env})["services"]["qbittorrent"]
        assert qbt["environment"]["QBT_LISTEN_PORT"] == port, qbt["environment"]
        ports = {(pub, target, proto) for _, pub, target, proto in published(qbt.get("ports", []))}
        assert {(port, port, "tcp"), (port, port, "udp")} <= ports, qbt.get("ports")
    assert "QBT_PEER_PORT" in docker_section() and "QBT_PEER_PORT" in (ROOT / ".env.example").read_text()
