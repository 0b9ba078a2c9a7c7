"""One compose stack for the Docker tests of tests/integration/test_compose.py and
test_compose_review.py (its fixtures: tests/support/compose_fixtures.py, a pytest plugin both
files name in `pytest_plugins`, so that they exist once, whichever file asks first).

Bringing the stack up (Postgres initialised, `migrate`, four app containers healthy) and down
took most of those tests' time, once per test. Here it is brought up once, as the README's
Docker section tells an operator to (its `.env` line, as written, then `docker-compose up -d`
with compose.yaml and compose.ci.yaml), plus tests/docker/compose.test.yaml (a seeder and a
webhook receiver on the compose network, test knobs on the worker), and torn down once at the
end (`down -v`). A test that changes the stack past reuse (the upgrade to another image) marks it
`spent`; the next test that asks gets a fresh one.

Docker that cannot run fails these tests with the reason (`tests/support/dockerkit.py`).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from proj.qbt.local import free_port
from tests.support.services import ROOT, wait_for

SECRETS = ("ADMIN_PASSWORD", "API_TOKEN", "HOOK_TOKEN")
APP_SERVICES = ("worker", "beat", "flower", "admin")
SERVICES = ("postgres", "redis", "qbittorrent", *APP_SERVICES)
FILES = ("compose.yaml", "compose.ci.yaml", "tests/docker/compose.test.yaml")


def docker(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {r.stdout[-1000:]}{r.stderr[-2000:]}")
    return r


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
class Stack:
    """An operator's shell in the checkout: every setting in `.env` (here `--env-file`, the same
    file compose reads beside compose.yaml), no secret in the environment."""

    project: str
    env_file: Path
    secrets: dict[str, str]
    settings: dict[str, str]
    seed_dir: Path
    hooks: Path
    spent: bool = field(default=False)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.settings['ADMIN_PORT']}"

    def compose(
        self, *args: str, files: tuple[str, ...] = (), check: bool = True, timeout: float = 300
    ) -> str:
        env = {k: v for k, v in os.environ.items() if k not in SECRETS}
        cmd = ["docker-compose", "--env-file", str(self.env_file), "-p", self.project]
        for f in (*FILES, *files):
            cmd += ["-f", f]
        r = subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            out = f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{out}")
        return r.stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def exec(self, service: str) -> list[str]:
        return ["docker", "exec", self.container(service)]

    def inspect(self, service: str, fmt: str) -> str:
        """`fmt` of the service's container; empty while it does not exist."""
        return docker("inspect", "-f", fmt, self.container(service), check=False).stdout.strip()

    def sql(self, query: str) -> list[list[str]]:
        out = docker(
            "exec", self.container("postgres"), "psql", "-U", "proj", "-d", "proj", "-AtF", "\t", "-c", query
        ).stdout  # fmt: skip
        return [line.split("\t") for line in out.splitlines() if line]

    def scalar(self, query: str) -> str | None:
        rows = self.sql(query)
        return rows[0][0] if rows else None

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.api_url,
            headers={"Authorization": f"Bearer {self.secrets['API_TOKEN']}"},
            timeout=30,
        )

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            return all(self.inspect(s, "{{.State.Health.Status}}") == "healthy" for s in APP_SERVICES)

        wait_for(healthy, 180, interval=0.5, what="worker, beat, flower and admin to be healthy")

    def down(self, *files: str) -> None:
        self.compose("down", "-v", "--remove-orphans", files=files, check=False)
        self.spent = True


def start_stack(where: Path) -> Stack:
    """The README's `.env`, this stack's ports and test directories beside it, `up -d`."""
    seed, hooks = where / "seed", where / "hooks"
    for d in (seed, hooks):
        d.mkdir()
    for d in (where, seed, hooks):
        d.chmod(0o777)  # the containers run as uid 10001
    values = readme_env_file(where)
    settings = {
        # this stack's ports, beside whatever else listens here, and its peer port on loopback
        "ADMIN_PORT": str(free_port()),
        "FLOWER_PORT": str(free_port()),
        "QBT_PEER_PORT": str(free_port()),
        "QBT_PEER_BIND": "127.0.0.1",
        "SEED_DIR": str(seed),
        "HOOKS_DIR": str(hooks),
    }
    env_file = where / ".env"
    with env_file.open("a") as f:
        f.write("".join(f"{k}={v}\n" for k, v in settings.items()))
    s = Stack(
        f"projci{uuid.uuid4().hex[:8]}", env_file, {k: values[k] for k in SECRETS}, settings, seed, hooks
    )
    try:
        s.compose("up", "-d", "--no-build")
    except BaseException:
        print(s.compose("logs", "--tail", "80", check=False))
        s.down()
        raise
    return s
