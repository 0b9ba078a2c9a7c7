"""compose.yaml end to end, as users run it (issue #15), with compose.ci.yaml swapping only the
images for ones built here from Debian packages (scripts/docker-images).

One real request through the API and its approval; the download from a seeder on the compose
network; the file in the library volume with the right sha256; the webhook received; the run
woken by qBittorrent's on-finish hook (curl to /api/hooks/qbittorrent, not the 10-minute
re-check); `docker kill` of the worker container mid-copy, the run still finishing with each
effect once; `compose down -v`. Docker that cannot run fails these tests with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from proj.qbt.local import add_torrent, free_port, make_torrent, wait_seeding
from tests.support.dockerkit import images  # noqa: F401 - the session fixture
from tests.support.services import ROOT, wait_for

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600), pytest.mark.usefixtures("images")]

FILES = {"film.mkv": 6 * 1024 * 1024, "extras/notes.bin": 700 * 1024}
SECRETS = {
    "ADMIN_PASSWORD": "admin-" + uuid.uuid4().hex[:12],
    "API_TOKEN": "api-" + uuid.uuid4().hex,
    "HOOK_TOKEN": "hook-" + uuid.uuid4().hex,
}
APP_SERVICES = ("worker", "beat", "flower", "admin")


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    api_url: str
    seed_dir: Path
    hooks: Path

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> str:
        files = ["-f", "compose.yaml", "-f", "compose.ci.yaml", "-f", "tests/docker/compose.test.yaml"]
        # Not the checkout's .env (the README's Docker section writes one): this stack's own
        # settings only, on loopback whatever ADMIN_BIND an operator set there.
        r = subprocess.run(
            ["docker-compose", "--env-file", str(self.seed_dir.parent / "none.env"), "-p", self.project]
            + [*files, *args],
            cwd=ROOT,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise AssertionError(
                f"docker-compose {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
            )
        return r.stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def exec(self, service: str) -> list[str]:
        return ["docker", "exec", self.container(service)]

    def inspect(self, service: str, fmt: str) -> str:
        out = subprocess.run(
            ["docker", "inspect", "-f", fmt, self.container(service)], capture_output=True, text=True
        )
        return out.stdout.strip()

    def sql(self, query: str) -> list[list[str]]:
        out = subprocess.run(
            [
                "docker",
                "exec",
                self.container("postgres"),
                "psql",
                "-U",
                "proj",
                "-d",
                "proj",
                "-AtF",
                "\t",
                "-c",
                query,
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [line.split("\t") for line in out.splitlines() if line]

    def scalar(self, query: str) -> str | None:
        rows = self.sql(query)
        return rows[0][0] if rows else None

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.api_url, headers={"Authorization": f"Bearer {SECRETS['API_TOKEN']}"}, timeout=30
        )


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    seed, hooks = tmp_path / "seed", tmp_path / "hooks"
    seed.mkdir()
    hooks.mkdir()
    for d in (tmp_path, seed, hooks):
        d.chmod(0o777)  # the containers run as uid 10001
    (tmp_path / "none.env").touch()  # Stack.compose's --env-file
    port = free_port()
    env = {
        **SECRETS,
        "ADMIN_PORT": str(port),
        "FLOWER_PORT": str(free_port()),
        "SEED_DIR": str(seed),
        "HOOKS_DIR": str(hooks),
    }
    s = Stack(f"projtest{uuid.uuid4().hex[:8]}", env, f"http://127.0.0.1:{port}", seed, hooks)
    try:
        s.compose("up", "-d", "--no-build")
        yield s
    except BaseException:
        print(s.compose("logs", "--tail", "80", check=False))
        raise
    finally:
        s.compose("down", "-v", "--remove-orphans", check=False)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def seed_payload(s: Stack) -> tuple[bytes, str, dict[str, str]]:
    """A payload on the host, shared by the seeder container (bind mount), and its .torrent."""
    root = s.seed_dir / "Payload"
    for rel, size in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(size))
    for p in [root, *root.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    torrent, infohash = make_torrent(root, piece_size=256 * 1024)
    import qbittorrentapi

    port = s.compose("port", "seeder", "8080").strip().rsplit(":", 1)[1]
    seeder = qbittorrentapi.Client(host=f"127.0.0.1:{port}", username="admin", password="seeder-password")
    add_torrent(seeder, torrent, infohash, save_path="/seed", seed=True)
    wait_seeding(seeder, infohash, 60)
    return torrent, infohash, {rel: sha256(root / rel) for rel in FILES}


def wait_healthy(s: Stack) -> None:
    def healthy() -> bool:
        return all(s.inspect(svc, "{{.State.Health.Status}}") == "healthy" for svc in APP_SERVICES)

    wait_for(healthy, 180, interval=1, what="worker, beat, flower and admin to be healthy")


def library_digests(s: Stack, task_id: str) -> dict[str, str]:
    """sha256 of every file under the task's library folder, read inside the library volume."""
    code = (
        "import hashlib, json, pathlib; r = pathlib.Path('/library/" + task_id + "'); "
        "print(json.dumps({p.relative_to(r).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() "
        "for p in sorted(r.rglob('*')) if p.is_file()}))"
    )
    out = subprocess.run(
        ["docker", "exec", s.container("worker"), "python", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_compose_request_approve_download_library_webhook_and_a_killed_worker(stack: Stack) -> None:
    s = stack
    wait_healthy(s)
    # Start order: migrate ran to completion before any app service started.
    assert s.inspect("migrate", "{{.State.ExitCode}}") == "0"
    migrated = s.inspect("migrate", "{{.State.FinishedAt}}")
    for svc in APP_SERVICES:
        assert s.inspect(svc, "{{.State.StartedAt}}") > migrated, f"{svc} started before migrate finished"

    torrent, infohash, digests = seed_payload(s)
    with s.api() as api:
        made = api.post(
            "/api/requests",
            files={"torrent": ("payload.torrent", torrent, "application/x-bittorrent")},
            data={"requester": "alice", "webhook_url": "http://webhook:8000/hook"},
        )
        assert made.status_code == 201, made.text
        task_id = made.json()["id"]
        approved_at = time.monotonic()
        assert api.post(f"/api/requests/{task_id}/approve", json={"by": "olga"}).status_code == 200

        # docker kill the worker container while it copies into the library.
        copying = (
            "SELECT count(*) FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
            "WHERE r.kind = 'import' AND s.name = 'copy' AND s.status = 'running'"
        )
        wait_for(lambda: s.scalar(copying) not in (None, "0"), 120, interval=0.2, what="the copy to start")
        subprocess.run(["docker", "kill", s.container("worker")], check=True, capture_output=True)
        s.compose("start", "worker")  # as an orchestrator would restart it

        wait_for(
            lambda: api.get(f"/api/requests/{task_id}").json()["status"] == "notified",
            240,
            interval=1,
            what="the request to reach the library and its requester",
        )
        took = time.monotonic() - approved_at
        detail = api.get(f"/api/requests/{task_id}").json()

    # The library volume holds exactly the seeded bytes; nothing else (no temp file) is there.
    assert library_digests(s, task_id) == {f"Payload/{rel}": d for rel, d in digests.items()}
    assert {f["path"]: f["library"]["sha256"] for f in detail["files"]} == digests
    assert s.scalar(f"SELECT count(*) FROM acq.library_item WHERE download_task_id = '{task_id}'") == str(
        len(FILES)
    )
    # The kill landed mid-step: some copy ran again; each effect still happened once.
    attempts = s.scalar(
        "SELECT max(s.attempts) FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
        "WHERE r.kind = 'import' AND s.name = 'copy'"
    )
    assert int(attempts or 0) >= 2, "the worker was not killed mid-copy"
    assert s.scalar(f"SELECT count(*) FROM ledger.asset_operation WHERE op_key = 'qbt-add:{task_id}'") == "1"
    torrents = json.loads(
        subprocess.run(
            [
                "docker",
                "exec",
                s.container("qbittorrent"),
                "curl",
                "-fsS",
                "http://127.0.0.1:8080/api/v2/torrents/info",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert [t["hash"] for t in torrents] == [infohash]
    hooks = [json.loads(line) for line in (s.hooks / "hooks.jsonl").read_text().splitlines()]
    assert [h["key"] for h in hooks] == [f"notify:{task_id}"], hooks
    # Woken by qBittorrent's on-finish hook over HTTP, not by the 10-minute re-check.
    woke = s.scalar(f"SELECT payload->>'source' FROM engine.task_signal WHERE topic = 'download:{infohash}'")
    assert woke == "qbittorrent hook"
    hook_log = subprocess.run(
        ["docker", "exec", s.container("qbittorrent"), "cat", "/config/hook.log"],
        capture_output=True,
        text=True,
    ).stdout
    assert f'"topic":"download:{infohash}"' in hook_log
    whats = [e["what"] for e in detail["timeline"]]
    assert whats[:2] == ["requested", "approved"] and whats[-1] == "requester notified"
    print(f"compose: approval → notified in {took:.1f}s with the worker killed mid-copy")
