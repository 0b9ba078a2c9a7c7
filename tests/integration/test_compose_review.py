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
  and UDP, as the port it listens on, and a peer from outside reaches it.

The operator's path runs on test_compose.py's stack, brought up once for both files
(tests/support/compose.py). Docker that cannot run fails these tests with the reason
(`tests/support/dockerkit.py`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from proj.engine.preflight import head_revision
from proj.qbt.local import make_torrent
from tests.support.compose import APP_SERVICES, SECRETS, SERVICES, Stack, docker, docker_section
from tests.support.services import ROOT, wait_for

# The stack the operator's path runs on is test_compose.py's, brought up once for both files
# (tests/support/compose.py).
pytest_plugins = ["tests.support.compose_fixtures"]
pytestmark = [pytest.mark.docker, pytest.mark.timeout(600), pytest.mark.usefixtures("images")]


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


def test_migrate_started_by_several_containers_at_once_migrates_once(
    postgres: Postgres, tmp_path: Path
) -> None:
    pg = postgres
    migrators = [f"{pg.net}_m{i}" for i in range(4)]
    go = tmp_path / "go"
    go.mkdir()
    go.chmod(0o755)
    try:
        # Each imports `proj` first and says so; once all four have, /go/now appears and they run
        # `proj migrate` at the same instant (within 5 ms). A fixed 8 s barrier spent most of it
        # waiting for imports long done.
        barrier = (
            "import os, sys, time; from proj.cli import main; sys.argv = ['proj', 'migrate']; "
            "print('imported', flush=True)\n"
            "while not os.path.exists('/go/now'): time.sleep(0.005)\n"
            "main()"
        )
        for name in migrators:
            docker(
                "create", "--name", name, "--network", pg.net, "-e", f"DATABASE_URL={pg.url('proj')}",
                "-v", f"{go}:/go:ro", "proj/app:ci", "python", "-c", barrier,
            )  # fmt: skip
        docker("start", *migrators)
        wait_for(
            lambda: all("imported" in docker("logs", name).stdout for name in migrators),
            120,
            interval=0.1,
            what="the migrators to import proj",
        )
        (go / "now").touch()
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


def qbt_api(s: Stack, *curl: str, stdin: bytes | None = None) -> str:
    """qBittorrent's Web API from inside its container (no login from loopback)."""
    r = subprocess.run(
        ["docker", "exec", "-i", s.container("qbittorrent"), "curl", "-fsS", *curl],
        input=stdin,
        capture_output=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout.decode()


def peer_handshake(port: int, infohash: str) -> bytes:
    """A BitTorrent handshake for `infohash` to 127.0.0.1:`port`: the answering peer's info hash."""
    hello = (
        b"\x13BitTorrent protocol"
        + bytes(8)
        + bytes.fromhex(infohash)
        + b"-PT0001-"
        + os.urandom(6).hex().encode()[:12]
    )
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(hello)
            while len(answer) < 48:
                chunk = sock.recv(68)
                if not chunk:
                    break
                answer += chunk
    except OSError:
        pass  # refused or reset: no answer (yet)
    return answer[28:48]


def test_the_running_stack_counts_its_workers_and_takes_peers_on_its_published_port(
    stack: Stack, tmp_path: Path
) -> None:
    """On a real `up`: the preflight counts as many workers as run (WORKER_REPLICAS), and a peer
    from outside the compose network reaches qBittorrent on the published QBT_PEER_PORT (a
    BitTorrent handshake for a torrent it has is answered with that torrent's info hash)."""
    s = stack
    s.wait_healthy()
    workers = docker(
        "ps", "-q", "--filter", f"label=com.docker.compose.project={s.project}",
        "--filter", "label=com.docker.compose.service=worker",
    ).stdout.split()  # fmt: skip
    counted = docker(
        "exec", s.container("worker"), "python", "-c",
        "from proj.settings import get_settings; print(get_settings().expected_workers)",
    ).stdout.strip()  # fmt: skip
    assert counted == str(len(workers)) == "1", (counted, workers)

    port = s.settings["QBT_PEER_PORT"]
    prefs = json.loads(qbt_api(s, "http://127.0.0.1:8080/api/v2/app/preferences"))
    assert str(prefs["listen_port"]) == port
    for proto in ("tcp", "udp"):
        assert s.compose("port", "--protocol", proto, "qbittorrent", port).strip() == f"127.0.0.1:{port}", (
            proto
        )
    payload = tmp_path / "peer-probe.bin"
    payload.write_bytes(os.urandom(64 * 1024))
    torrent, infohash = make_torrent(payload)
    qbt_api(
        s,
        "-F",
        "torrents=@-;filename=probe.torrent",
        "http://127.0.0.1:8080/api/v2/torrents/add",
        stdin=torrent,
    )
    try:
        wait_for(
            lambda: infohash in qbt_api(s, f"http://127.0.0.1:8080/api/v2/torrents/info?hashes={infohash}"),
            30,
            what="qBittorrent to take the probe torrent",
        )
        assert (
            wait_for(lambda: peer_handshake(int(port), infohash).hex(), 30, interval=1, what="a handshake")
            == infohash
        )
    finally:
        qbt_api(
            s, "-d", f"hashes={infohash}&deleteFiles=true", "http://127.0.0.1:8080/api/v2/torrents/delete"
        )


def test_the_readme_operator_path_secrets_in_env_file_exec_no_secret_in_ps_and_an_upgrade(
    stack: Stack, tmp_path: Path
) -> None:
    op = stack
    # The upgraded image (below) builds meanwhile.
    building = ThreadPoolExecutor(1)
    upgrade = building.submit(upgraded_image, tmp_path, f"proj/app:upgrade-{op.project}")
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
    hook_ends_by = time.monotonic() + 30  # its retries of the refusing admin end meanwhile

    # Upgrade: a rebuilt image with a new migration, `docker compose up -d` again: migrate runs
    # it before any app container of the new image starts, and they come up healthy on it.
    before = op.inspect("migrate", "{{.State.FinishedAt}}")
    tag = upgrade.result()
    building.shutdown()
    override = tmp_path / "upgrade.yaml"
    override.write_text(
        "services:\n" + "".join(f'  {s}: {{image: "{tag}"}}\n' for s in ("migrate", *APP_SERVICES))
    )
    try:
        op.compose("up", "-d", "--no-build", files=(str(override),))
        hook.wait(max(0.0, hook_ends_by - time.monotonic()))
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
        op.down(str(override))  # on an image about to go: no later test can use this stack
        docker("rmi", "-f", tag, check=False)
