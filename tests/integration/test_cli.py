"""`proj` CLI: doctor, outbox, runs/show/resolve and the admin command's refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import proj.cli as cli_mod
from proj.engine.port import TaskRunView
from tests.conftest import new_key
from tests.kinds_admin import ADMIN_DDL
from tests.support.services import ROOT, scalar, sql, wait_for

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rich wraps table cells at 80 columns; assertions read whole lines."""
    monkeypatch.setattr(cli_mod, "console", Console(width=250))


def proj(*args: str) -> tuple[int, str]:
    result = runner.invoke(cli_mod.cli, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def proj_subprocess(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "COLUMNS": "250", "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-m", "proj.cli", *args], env=full, capture_output=True, text=True, timeout=120
    )


def test_doctor_passes_on_a_healthy_setup() -> None:
    code, out = proj("doctor")
    assert code == 0, out
    for name in ("postgres", "broker", "qbittorrent", "schema", "connection budget"):
        assert name in out
    assert "FAIL" not in out
    # A warning (no worker answered: none runs here) is not called a pass.
    assert ("no check failed; " in out) if "WARN" in out else ("all checks passed" in out), out
    assert "at head" in out and "worst case" in out
    autovacuum = scalar("SHOW autovacuum")
    assert ("autovacuum        │ OK" if autovacuum == "on" else "autovacuum        │ WARN") in out, out


def test_doctor_warns_of_autovacuum_off_for_one_table() -> None:
    """`autovacuum = on` server-wide said OK even with an engine table's own autovacuum switched
    off (its statistics never refreshed); the check now names such tables."""
    from proj.doctor import check_autovacuum

    assert "engine.step" not in check_autovacuum().detail
    sql("ALTER TABLE engine.step SET (autovacuum_enabled = false)")
    try:
        c = check_autovacuum()
    finally:
        sql("ALTER TABLE engine.step RESET (autovacuum_enabled)")
    assert c.status == "WARN" and "autovacuum_enabled = false on engine.step" in c.detail, c


def test_doctor_says_what_to_fix_and_hides_passwords() -> None:
    r = proj_subprocess(
        "doctor",
        env={
            "DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/nope",
            "BROKER_URL": "redis://:hunter3@127.0.0.1:1/0",
            "QBT_URL": "http://127.0.0.1:1",
            "QBT_PASSWORD": "hunter4",
        },
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "start PostgreSQL or correct DATABASE_URL" in out
    assert "start Redis (or RabbitMQ) or correct BROKER_URL" in out
    assert "start qbittorrent-nox" in out
    assert "3 check(s) failed: postgres, broker, qbittorrent" in out
    assert "hunter" not in out, "a password reached the output"


def test_doctor_warns_that_acquires_fail_without_qbt_url() -> None:
    r = proj_subprocess("doctor", env={"QBT_URL": ""})
    out = r.stdout + r.stderr
    assert "qbittorrent       │ WARN" in out and "every acquire fails" in out, out
    assert "qbittorrent" in out.split("warning(s): ")[-1], out


def test_doctor_warns_of_a_library_root_that_is_not_there(tmp_path) -> None:  # noqa: ANN001
    """An unmounted library disk: imports wait for it, and the doctor says where to look. The
    missing root's path is short: a long one (pytest's own) wrapped the detail in the table."""
    missing = Path("/tmp") / f"nolib-{uuid.uuid4().hex[:8]}" / "library"
    r = proj_subprocess("doctor", env={"LIBRARY_ROOT": str(missing)})
    out = r.stdout + r.stderr
    assert "library           │ WARN" in out and "imports wait for it" in out, out
    r = proj_subprocess("doctor", env={"LIBRARY_ROOT": str(tmp_path)})
    out = r.stdout + r.stderr
    assert "library           │ OK" in out and "GiB free" in out, out


def test_a_blank_by_is_a_usage_error() -> None:
    """`--by ''` was silently your user name (the API refuses an empty `by`)."""
    some = str(uuid.uuid4())
    for args in (("approve", some), ("reject", some, "--reason", "no"), ("cancel", some)):
        code, out = proj(*args, "--by", "  ")
        assert code == 2 and "--by must name someone" in out, (args, out)


def test_doctor_fails_an_impossible_connection_budget() -> None:
    r = proj_subprocess("doctor", env={"EXPECTED_WORKERS": "400", "QBT_URL": ""})
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "connection budget │ FAIL" in out and "lower the pools or concurrency" in out
    assert "postgres          │ OK" in out


def test_outbox_counts_and_oldest_pending() -> None:
    sql(
        "INSERT INTO outbox.outbox_event (kind, idempotency_key, payload, status, attempts, last_error) "
        "VALUES ('notify', 'first', '{}', 'pending', 1, NULL), ('notify', 'second', '{}', 'pending', 0, "
        "NULL), ('acquire', 'gone', '{}', 'dead', 8, '{\"message\": \"unknown kind acquire\"}'), "
        "('notify', 'sent', '{}', 'dispatched', 1, NULL)"
    )
    code, out = proj("outbox")
    assert code == 0, out
    assert "│ pending    │ 2 " in out and "│ dead       │ 1 " in out and "│ dispatched │ 1 " in out
    assert "oldest pending: #1 notify key=first attempts=1" in out
    assert "unknown kind acquire" in out


def test_runs_show_and_resolve(inproc) -> None:
    sql(ADMIN_DDL)
    key = new_key()
    ref = inproc.enqueue("mendable", {"key": key, "chunks": 2, "chunk_s": 0.01}, idempotency_key="cli-" + key)
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == "failed", 20
    )
    code, out = proj("runs", "--status", "failed")
    assert code == 0 and str(ref.task_run_id) in out and "mendable@1" in out
    code, out = proj("runs", "--search", key[:12])
    assert str(ref.task_run_id) in out
    code, out = proj("runs", "--kind", "probe")
    assert str(ref.task_run_id) not in out
    code, out = proj("runs", "--status", "faild")  # a typo is refused, not ignored
    assert code == 2 and "unknown status 'faild'" in out
    assert proj("runs", "--limit", "0")[0] == 2
    code, out = proj("runs", "--status", "failed")  # piped: whole ids, tab-separated
    assert f"{ref.task_run_id}\tmendable@1\tfailed\t" in out

    code, out = proj("show", str(ref.task_run_id))
    assert code == 0, out
    assert "business timeline" in out and "created mendable@1" in out and "source for" in out
    assert f"proj resolve {ref.task_run_id} --retry" in out
    code, out = proj("show", str(ref.task_run_id), "--json")
    assert '"status": "failed"' in out
    assert proj("show", "not-a-run")[0] == 1

    sql("INSERT INTO testkit_admin.fix (key, fixed) VALUES (%s, true)", (key,))
    code, out = proj("resolve", str(ref.task_run_id), "--retry")
    assert code == 0 and "1 step(s) sent back" in out
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == "succeeded",
        20,
    )
    code, out = proj("show", str(ref.task_run_id))
    assert "source repaired by operator" in out and "succeeded" in out
    # On a run that is not a dead letter (any more), nothing happens and the exit code says so.
    for action in ("--retry", "--abandon"):
        code, out = proj("resolve", str(ref.task_run_id), action)
        assert code == 1 and "is not a failed run" in out, (action, out)
    code, out = proj("cancel", str(ref.task_run_id))
    assert code == 1 and "has finished (succeeded): nothing to cancel" in out, out
    assert proj("resolve", "not-a-run", "--retry")[0] == 2


def test_runs_finds_a_requests_runs_by_its_id_and_cancel_records_who(published) -> None:
    """`proj runs -q <request id>` lists the runs whose keys hold it (`acquire:<id>`,
    `import:<id>`), not only a run of that id; `proj cancel RUN --by` is kept in the reason."""
    import uuid

    from proj.engine import runs

    request_id = uuid.uuid4()
    ref = runs.enqueue("probe", {"n": 1}, idempotency_key=f"import:{request_id}")
    other = runs.enqueue("probe", {"n": 2}, idempotency_key=new_key())
    code, out = proj("runs", "-q", str(request_id))
    assert code == 0 and str(ref.task_run_id) in out and str(other.task_run_id) not in out, out
    code, out = proj("runs", "-q", str(other.task_run_id))  # a run's own id still finds it alone
    assert str(other.task_run_id) in out and str(ref.task_run_id) not in out, out

    code, out = proj("cancel", str(ref.task_run_id), "--reason", "wrong film", "--by", "alice")
    assert code == 0, out
    assert scalar("SELECT cancel_reason FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == (
        "wrong film (by alice)"
    )


@pytest.mark.parametrize(
    ("kind", "payload", "final", "hint"),
    [("probe", {}, "succeeded", False), ("flaky", {"fatal": True}, "failed", True)],
)
def test_cancel_of_a_run_that_finishes_before_it_lands_says_so(
    published, monkeypatch: pytest.MonkeyPatch, kind: str, payload: dict[str, object], final: str, hint: bool
) -> None:
    """`proj cancel RUN` checks the run is live, then cancels; a run finishing in between was
    reported "cancel requested" (exit 0) though nothing was written. Forced here: the check reads
    the live run, then the worker's step runs it to its end before the cancel."""
    from proj.engine import protocol, runs
    from tests.support.steps import first_step

    ref = runs.enqueue(kind, payload, idempotency_key=new_key())
    real_get = runs.get

    def get_then_finish(run_id: uuid.UUID) -> TaskRunView | None:
        view = real_get(run_id)
        assert view is not None and view.status == "pending"
        protocol.execute(first_step(ref.task_run_id), starts_run=True)  # the run ends meanwhile
        assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == final
        return view

    monkeypatch.setattr(runs, "get", get_then_finish)
    code, out = proj("cancel", str(ref.task_run_id))
    assert "cancel requested" not in out, out
    assert code == 1 and f"finished ({final}) before the cancel landed: nothing to cancel" in out, out
    assert (f"proj resolve {ref.task_run_id} --abandon" in out) is hint, out
    assert scalar("SELECT cancel_requested_at FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) is None
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) == final


def test_runs_cancel_says_whether_the_request_landed(published) -> None:
    """`runs.cancel` reports what its guarded statement changed: landed on a live run, not on a
    finished one (and its status then); `chain.request_cancel` still returns the dispatches."""
    from proj import db
    from proj.engine import chain, runs

    live = runs.enqueue("probe", {}, idempotency_key=new_key()).task_run_id
    assert runs.cancel(live, "operator") == runs.CancelOutcome(landed=True, status="pending")
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (live,)) == "canceled"
    assert runs.cancel(live, "again") == runs.CancelOutcome(landed=False, status="canceled")
    assert scalar("SELECT cancel_reason FROM engine.task_run WHERE id = %s", (live,)) == "operator"
    with db.transaction() as s:
        assert chain.request_cancel(s, live, "once more") == []
    with pytest.raises(KeyError):
        runs.cancel(uuid.uuid4(), "no such run")


def test_admin_command_refuses_unsafe_configurations(monkeypatch: pytest.MonkeyPatch) -> None:
    from proj.settings import get_settings

    monkeypatch.setattr(get_settings(), "admin_password", None)
    code, out = proj("admin", "--port", "1")
    assert code == 2 and "ADMIN_PASSWORD is not set" in out
    code, out = proj("admin", "--insecure-local", "--host", "0.0.0.0", "--port", "1")
    assert code == 2 and "loopback only" in out


def test_admin_command_serves_with_auth_and_never_logs_the_password(tmp_path) -> None:
    import signal
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secret = "admin-" + new_key()
    log = tmp_path / "admin.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ADMIN_PASSWORD": secret, "ADMIN_USERNAME": "ops"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proj.cli", "admin", "--port", str(port)],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/admin"
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 30, what="proj admin to listen")
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, auth=("ops", "nope")).status_code == 401
        assert httpx.get(url, auth=("ops", secret)).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    out = log.read_text()
    assert f"admin on http://127.0.0.1:{port}/admin (user ops)" in out
    assert secret not in out


def test_doctor_warns_of_a_queue_nobody_consumes(procs) -> None:
    """A version queue holding messages that no worker consumes (invariant 10's old run with no
    worker of its version) is named by `proj doctor`, with its count; served queues are not."""
    from proj.celery import app
    from proj.engine.kind import get_kind

    served, orphan = get_kind("probe", 1), get_kind("flaky", 1)
    procs.worker("w1", concurrency=1, env={"ENGINE_SERVE": "probe@1"})
    for _ in range(2):
        app.send_task(orphan.task_name(orphan.step_names()[0]), args=(0,), queue=orphan.queue)
    app.send_task(served.task_name(served.step_names()[0]), args=(0,), queue=served.queue)
    code, out = proj("doctor")
    assert f"{orphan.queue} has 2 message(s) and no consumer" in out, out
    assert f"{served.queue} has" not in out, out
    assert "workers           │ WARN" in out, out


def _lock_steps(path) -> subprocess.CompletedProcess[str]:
    """`proj lock-steps` in a fresh process (kinds not imported yet), writing `path`."""
    code = (
        "import pathlib, sys\n"
        "import proj.engine.versions as v\n"
        "v.LOCK_PATH = pathlib.Path(sys.argv[1])\n"
        "from proj.cli import main\n"
        "sys.argv = ['proj', 'lock-steps']\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_lock_steps_records_the_kinds_and_refuses_a_changed_version(tmp_path) -> None:
    import json

    from proj.engine.versions import LOCK_PATH

    lock = json.loads(LOCK_PATH.read_text())
    missing = dict(lock)
    dropped = missing.pop("notify@1")
    path = tmp_path / "steps.lock.json"
    path.write_text(json.dumps(missing))
    done = _lock_steps(path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(path.read_text())["notify@1"] == dropped, "the unlocked version was not recorded"

    changed = {**lock, "notify@1": [*dropped[:-1], "renamed"]}
    path.write_text(json.dumps(changed))
    refused = _lock_steps(path)
    assert refused.returncode == 1 and "refused" in refused.stderr, refused.stdout + refused.stderr
    assert json.loads(path.read_text()) == changed, "a refused lock must not be rewritten"


def test_errors_are_one_line_not_a_traceback() -> None:
    """An operator gets one line saying what to do, exit 1: the database out of reach, a bad
    setting, bad input; `PROJ_TRACEBACK=1` still shows the traceback."""
    dead = {
        "DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:1/none",
        "BROKER_URL": "redis://127.0.0.1:1/0",
    }
    cases = [
        (["runs"], dead, "proj doctor"),
        (["runs"], {"LEASE_TTL_S": "abc"}, "bad setting: LEASE_TTL_S"),
        (["signal", "bad topic"], {}, "bad signal topic"),
    ]
    for args, env, expected in cases:
        done = proj_subprocess(*args, env=env)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert expected in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) <= 2, done.stderr  # one line, soft-wrapped at most once
    shown = proj_subprocess("runs", env={**dead, "PROJ_TRACEBACK": "1"})
    assert shown.returncode == 1 and "Traceback" in shown.stderr


def test_requests_pages_on_with_after(tmp_path) -> None:
    """`proj requests --limit N` says how to go on when more follow (`--after ID`), and
    `--after` goes on from there: before, requests past the limit were out of reach."""
    import os as _os

    from proj import db
    from proj.acquisition import service
    from proj.qbt.local import make_torrent

    (tmp_path / "Film").mkdir()
    (tmp_path / "Film" / "f.bin").write_bytes(_os.urandom(20_000))
    torrent = make_torrent(tmp_path / "Film", piece_size=16 * 1024)[0]
    ids = []
    for who in ("ann", "bob", "cid"):
        with db.sessions().begin() as s:
            ids.append(str(service.request_download(s, requester=who, torrent=torrent)))
    code, out = proj("requests", "--limit", "2")
    assert code == 0, out
    assert ids[2] in out and ids[1] in out and ids[0] not in out, out
    assert f"more: proj requests --after {ids[1]}" in out, out
    code, out = proj("requests", "--limit", "2", "--after", ids[1])
    assert code == 0 and ids[0] in out and ids[1] not in out and "more:" not in out, out
    code, out = proj("requests", "--after", "nope")
    assert code == 1 and "--after must be a request id" in out, out
