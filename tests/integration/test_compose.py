"""compose.yaml end to end, as users run it (issue #15), with compose.ci.yaml swapping only the
images for ones built here from Debian packages (scripts/docker-images).

One real request through the API and its approval; the download from a seeder on the compose
network; the file in the library volume with the right sha256; the webhook received; the run
woken by qBittorrent's on-finish hook (curl to /api/hooks/qbittorrent, not the 10-minute
re-check); `docker kill` of the worker container mid-copy, the run still finishing with each
effect once; `compose down -v` (once, after test_compose_review.py's tests on the same stack:
tests/support/compose.py). Docker that cannot run fails these tests with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from proj.qbt.local import add_torrent, make_torrent, wait_seeding
from tests.support.compose import APP_SERVICES, Stack
from tests.support.services import wait_for

# The stack (README's .env, compose.yaml + compose.ci.yaml + tests/docker/compose.test.yaml) is
# brought up once for this file and test_compose_review.py (tests/support/compose.py).
pytest_plugins = ["tests.support.compose_fixtures"]
pytestmark = [pytest.mark.docker, pytest.mark.timeout(600), pytest.mark.usefixtures("images")]

FILES = {"film.mkv": 6 * 1024 * 1024, "extras/notes.bin": 700 * 1024}


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
    try:
        wait_seeding(seeder, infohash, 60)
    except TimeoutError as e:
        info = [dict(t) for t in seeder.torrents_info(torrent_hashes=infohash)]
        logs = s.compose("logs", "--tail", "30", "seeder", check=False)
        raise AssertionError(f"{e}: {info}\n{logs}") from e
    return torrent, infohash, {rel: sha256(root / rel) for rel in FILES}


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
    # The seeder (not an app service) seeds while the app containers become healthy.
    with ThreadPoolExecutor(1) as pool:
        seeding = pool.submit(seed_payload, s)
        s.wait_healthy()
        torrent, infohash, digests = seeding.result()
    # Start order: migrate ran to completion before any app service started.
    assert s.inspect("migrate", "{{.State.ExitCode}}") == "0"
    migrated = s.inspect("migrate", "{{.State.FinishedAt}}")
    for svc in APP_SERVICES:
        assert s.inspect(svc, "{{.State.StartedAt}}") > migrated, f"{svc} started before migrate finished"

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
