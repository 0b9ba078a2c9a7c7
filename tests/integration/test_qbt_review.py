"""A real, misbehaving qBittorrent: restarted, moved files, broken torrents, wrong credentials.

Every test drives the managed `qbittorrent-nox` of the fixtures into the state an operator meets
(stopped, a torrent moved to another folder, a torrent in `error`), and reads qBittorrent, the
business tables and the engine, never only what a step returned.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import qbittorrentapi

from proj import db
from proj.acquisition import service
from proj.engine import runs
from proj.engine.celery_engine import CeleryTaskEngine
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import Swarm
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import sha256_tree
from tests.support.services import dump_engine_state, scalar, sql, wait_for

pytestmark = pytest.mark.timeout(120)


def start(swarm: Swarm) -> uuid.UUID:
    """A request for the swarm's payload, approved."""
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="bob", torrent=swarm.payload.torrent)
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    return task_id


def status(task_id: uuid.UUID) -> str:
    return str(scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)))


def acquire_status() -> str | None:
    return scalar("SELECT status FROM engine.task_run WHERE kind = 'acquire'")


def events(task_id: uuid.UUID) -> list[str]:
    rows = sql("SELECT what FROM acq.task_event WHERE download_task_id = %s ORDER BY id", (task_id,))
    return [w for (w,) in rows]


def acquire_ended() -> None:
    """Wait until the acquire run has ended, whichever way."""
    wait_for(lambda: acquire_status() in ("failed", "succeeded"), 60, what="the acquire run to end")


def approve_with_qbt(procs, qbt_payload, tmp_path, **qbt_env: str) -> None:  # noqa: ANN001 - fixtures
    """A worker and beat whose qBittorrent settings are `qbt_env` (library and downloads under
    `tmp_path`); the payload requested and approved; back once the acquire run has ended."""
    (tmp_path / "library").mkdir()
    (tmp_path / "downloads").mkdir()
    env = {**qbt_env, "LIBRARY_ROOT": str(tmp_path / "library"), "DOWNLOAD_DIR": str(tmp_path / "downloads")}
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="bob", torrent=qbt_payload.torrent)
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    acquire_ended()


def imported(procs, swarm: Swarm, task_id: uuid.UUID, timeout: float = 60) -> None:
    """The task reaches the library with the payload's bytes (or the test prints why not)."""

    def done() -> bool:
        failed = scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'")
        return status(task_id) in ("imported", "notified") or failed > 0

    try:
        wait_for(done, timeout, what="the import")
        assert status(task_id) in ("imported", "notified"), "a run failed"
    except AssertionError:
        print(dump_engine_state())
        for name in procs.procs:
            print(f"--- {name}\n" + procs.log(name)[-3000:])
        for side in (swarm.managed, swarm.seeder):  # what each qBittorrent made of the torrent
            with contextlib.suppress(Exception):
                t = side.client().torrents_info(torrent_hashes=swarm.payload.infohash)
                print(f"--- {side.name}: {[(x.state, x.progress, x.num_seeds, x.num_leechs) for x in t]}")
            print(side.log_tail(20))
        raise
    got = sha256_tree(swarm.library / str(task_id) / swarm.payload.path.name)
    assert got == swarm.payload.digests


def hold_seeding(swarm: Swarm) -> None:
    """The seeder stops uploading: the managed download stays incomplete until `release`."""
    swarm.seeder.client().torrents_pause(torrent_hashes=swarm.payload.infohash)


def release(swarm: Swarm) -> None:
    swarm.seeder.client().torrents_resume(torrent_hashes=swarm.payload.infohash)


def added(swarm: Swarm, task_id: uuid.UUID) -> None:
    """The acquire run added the torrent and parks in its download wait."""
    wait_for(lambda: status(task_id) == "downloading", 30, what="the torrent added")
    wait_for(lambda: acquire_status() == "waiting", 30, what="the download wait to park")
    assert swarm.managed.client().torrents_info(torrent_hashes=swarm.payload.infohash)


# ------------------------------------------------------------------ qBittorrent restarted


def test_a_download_survives_qbittorrent_being_down_while_its_wait_rechecks(procs, swarm: Swarm) -> None:
    """qBittorrent stopped (an upgrade, a container restart) while a request downloads: the
    download wait's re-checks find it unreachable. Before: each re-check raised, the network
    retry policy (1 s, 2 s, 4 s, 8 s) ran out in ~15 s and the request was a dead letter that
    only an operator could revive. Now the wait parks again, says so on the request's timeline,
    and the download finishes once qBittorrent is back."""
    hold_seeding(swarm)
    env = swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="2")
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    added(swarm, task_id)

    spent_before = download_attempts_spent()
    swarm.managed.stop()
    topic = service.download_topic(swarm.payload.infohash)
    woken = wakeups()
    # Four re-checks that find qBittorrent down: each one that raised spent an attempt (and the
    # policy's backoff), so spending none over four shows they park instead.
    deadline = time.monotonic() + 30
    while wakeups() < woken + 4 and time.monotonic() < deadline:
        runs.signal(topic)  # the hook or reconcile waking it meanwhile
        assert acquire_status() != "failed", dump_engine_state()
        time.sleep(0.5)
    assert wakeups() >= woken + 4, dump_engine_state()
    assert download_attempts_spent() == spent_before, dump_engine_state()
    assert "qBittorrent unreachable" in events(task_id)
    assert status(task_id) == "downloading"

    swarm.managed.restart()
    release(swarm)
    imported(procs, swarm, task_id)


def wakeups() -> int:
    return int(scalar("SELECT wakeups FROM engine.step WHERE name = 'download'"))


def download_attempts_spent() -> int:
    return int(scalar("SELECT attempts - outages FROM engine.step WHERE name = 'download'"))


def test_a_request_approved_while_qbittorrent_is_down_is_added_once_it_is_back(procs, swarm: Swarm) -> None:
    """qBittorrent down when the add runs: each attempt is an outage (`qbt.Down`), not spent, the
    request's timeline and the run say why nothing moves, and the torrent is added once
    qBittorrent is back. Before, the add's ten attempts (about 8 min) were spent on the outage
    and a longer one left a dead letter."""
    procs.worker("w1", concurrency=2, env=swarm.worker_env())
    procs.beat(env=swarm.worker_env())
    swarm.managed.stop()
    task_id = start(swarm)

    outages = "SELECT outages, attempts - outages FROM engine.step WHERE name = 'add_torrent'"
    wait_for(lambda: (sql(outages) or [(0, 0)])[0][0] >= 2, 30, what="two attempts to meet the outage")
    assert sql(outages)[0][1] == 0, dump_engine_state()
    assert "qBittorrent unreachable" in events(task_id)
    run = scalar("SELECT id FROM engine.task_run WHERE kind = 'acquire'")
    view = runs.get(run)
    assert view is not None and view.attempts == 0
    assert view.last_error is not None and view.last_error["type"] == "Down", view.last_error

    swarm.managed.restart()
    imported(procs, swarm, task_id)
    assert events(task_id).count("qBittorrent unreachable") == 1


# ------------------------------------------------------------------ files moved by qBittorrent


def test_a_download_qbittorrent_moved_elsewhere_is_brought_back_before_the_import(
    procs, swarm: Swarm, tmp_path
) -> None:
    """The operator moves a managed torrent (qBittorrent's "Set location", or a category whose
    save path differs) while it downloads. Before: the download wait declared it done wherever it
    lay, and the import, which reads DOWNLOAD_DIR, failed with "payload does not match the
    torrent" though the payload was whole. Now the wait moves the torrent back into DOWNLOAD_DIR
    (it is ours: tagged) and declares it done only there."""
    hold_seeding(swarm)
    env = swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="2")
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    added(swarm, task_id)
    elsewhere = tmp_path / "movies"
    elsewhere.mkdir()
    client = swarm.managed.client()
    client.torrents_set_location(location=str(elsewhere), torrent_hashes=swarm.payload.infohash)
    wait_for(
        lambda: (
            client.torrents_info(torrent_hashes=swarm.payload.infohash)[0].save_path.rstrip("/")
            == str(elsewhere)
        ),
        30,
        what="qBittorrent to move the torrent",
    )
    release(swarm)
    imported(procs, swarm, task_id)
    assert client.torrents_info(torrent_hashes=swarm.payload.infohash)[0].save_path.rstrip("/") == str(
        swarm.downloads
    )
    assert "torrent moved back" in events(task_id)


def test_an_adopted_torrent_kept_outside_the_download_dir_fails_saying_where_it_lies(
    procs, swarm: Swarm, tmp_path
) -> None:
    """The operator already had the torrent, in their own folder, when the request came: the add
    adopts it (untagged: not ours to move). Before: the download wait declared it done and the
    import failed three times with "payload does not match the torrent". Now the acquire run
    fails at once, naming where qBittorrent keeps it and DOWNLOAD_DIR, and nothing is imported."""
    from proj.qbt.local import add_torrent

    elsewhere = tmp_path / "movies"
    p = swarm.payload
    add_torrent(swarm.managed.client(), p.torrent, p.infohash, save_path=elsewhere)
    procs.worker("w1", concurrency=2, env=swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="2"))
    procs.beat(env=swarm.worker_env())
    start(swarm)
    acquire_ended()
    error = str(scalar("SELECT last_error FROM engine.task_run WHERE kind = 'acquire'"))
    assert acquire_status() == "failed", dump_engine_state()
    assert str(elsewhere) in error and str(swarm.downloads) in error, error
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'import'") == 0
    assert swarm.managed.client().torrents_info()[0].save_path.rstrip("/") == str(elsewhere)


# ------------------------------------------------------------------ a torrent stuck in `error`


def test_a_torrent_in_error_is_flagged_on_the_request_and_resumed_once_the_cause_is_gone(
    procs, swarm: Swarm
) -> None:
    """qBittorrent cannot write the download (here a file stands where its folder goes; in life a
    full disk, a lost mount, permissions): the torrent goes to `error`, which qBittorrent never
    leaves by itself. Before: the request stayed `downloading` with no flag and no event, and
    stayed stuck after the cause was removed, until someone resumed it in qBittorrent's UI. Now
    the re-check flags the request (`torrent_error`, on its timeline) and resumes the torrent,
    so it finishes once the cause is gone."""
    obstacle = swarm.downloads / swarm.payload.path.name
    obstacle.write_bytes(b"not a folder")
    env = swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="2")
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    client = swarm.managed.client()
    wait_for(
        lambda: [t.state for t in client.torrents_info(torrent_hashes=swarm.payload.infohash)] == ["error"],
        30,
        what="qBittorrent to put the torrent in error",
    )
    flagged = "SELECT detail->>'state' FROM acq.flag WHERE kind = 'torrent_error' AND subject = %s"
    wait_for(lambda: scalar(flagged, (str(task_id),)) == "error", 15, what="the request flagged")
    assert "torrent in error" in events(task_id)
    assert status(task_id) == "downloading"

    obstacle.unlink()
    imported(procs, swarm, task_id)


# ------------------------------------------------------------------ wrong credentials


def test_wrong_qbittorrent_credentials_fail_once_and_clearly_without_getting_the_host_banned(
    procs, qbt_factory, qbt_payload, tmp_path
) -> None:
    """QBT_PASSWORD is wrong. Before: qbittorrent-api's `LoginFailed` carries no message, so the
    dead letter said nothing useful, and the add step tried it five times (the network policy):
    five failed logins, which is qBittorrent's default ban threshold, so the worker's IP was
    banned for an hour and even the corrected password was refused. Now a refused login fails
    the step at once (one failed login), naming the URL and QBT_USERNAME, never the password."""
    managed = qbt_factory("auth", username="admin", password="right-secret", localhost_auth_bypass=False)
    approve_with_qbt(
        procs,
        qbt_payload,
        tmp_path,
        QBT_URL=managed.webui_url,
        QBT_USERNAME="admin",
        QBT_PASSWORD="wrong-secret",
    )
    assert acquire_status() == "failed"
    attempts = scalar("SELECT attempts FROM engine.step WHERE name = 'add_torrent'")
    error = str(scalar("SELECT last_error FROM engine.task_run WHERE kind = 'acquire'"))
    assert attempts == 1, dump_engine_state()
    assert "QBT_USERNAME" in error and managed.webui_url in error, error
    assert "secret" not in error and "secret" not in procs.log("w1")
    # The operator's own login still works: the host was not banned.
    assert managed.client().app_version()


@contextmanager
def counted_logins(
    qbt_factory, monkeypatch: pytest.MonkeyPatch, name: str, password: str | None
) -> Iterator[Any]:
    """A real qBittorrent whose Web UI password is `right-secret`, reached as QBT_URL through a
    proxy that counts the logins it is sent (yielded), as `admin` with QBT_PASSWORD `password`
    (None: the test sets it); the settings are read afresh before and after."""
    from proj.settings import get_settings
    from tests.support.proxy import CutProxy

    lenient = {"Preferences": {"WebUI/HostHeaderValidation": False, "WebUI/CSRFProtection": False}}
    managed = qbt_factory(
        name, username="admin", password="right-secret", localhost_auth_bypass=False, extra_config=lenient
    )
    logins = CutProxy(("127.0.0.1", managed.webui_port), b"/api/v2/auth/login", cuts=0)
    monkeypatch.setenv("QBT_URL", logins.url)
    monkeypatch.setenv("QBT_USERNAME", "admin")
    if password is not None:
        monkeypatch.setenv("QBT_PASSWORD", password)
    get_settings.cache_clear()
    try:
        yield managed, logins
    finally:
        logins.close()
        get_settings.cache_clear()


def log_in_elsewhere() -> BaseException | None:
    """`qbt.client()` in a fresh thread, a client of its own as in another worker; its error."""
    from proj.acquisition import qbt

    seen: list[BaseException] = []

    def run() -> None:
        try:
            qbt.client().app_version()
        except BaseException as exc:  # noqa: BLE001 - returned for the assertions
            seen.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0] if seen else None


def test_credentials_qbittorrent_refused_are_not_tried_again_by_any_worker(
    qbt_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step failed once on a refused login, but every request, periodic reconcile and worker
    thread had its own login: five requests approved with a wrong QBT_PASSWORD were five failed
    logins, qBittorrent's ban threshold. Now a refusal is remembered in Postgres: four clients
    (threads here, worker processes in a deployment) make one failed login between them, and
    the corrected password is tried at once."""
    from proj.acquisition import qbt
    from proj.settings import get_settings

    with counted_logins(qbt_factory, monkeypatch, "memo", "wrong-secret") as (_, logins):
        errors = [log_in_elsewhere() for _ in range(4)]
        assert logins.requests_seen == 1, errors
        assert len(errors) == 4 and all(isinstance(e, qbt.LoginRefused) for e in errors), errors
        assert all("QBT_USERNAME" in str(e) and "secret" not in str(e) for e in errors), errors
        assert sum("Not tried again" in str(e) for e in errors) == 3, errors

        monkeypatch.setenv("QBT_PASSWORD", "right-secret")
        get_settings.cache_clear()
        assert log_in_elsewhere() is None and logins.requests_seen == 2
        # The wrong password's refusal stays for its window (another worker may still have it).
        wrong = qbt.credentials_digest(logins.url, "admin", "wrong-secret")
        assert sql("SELECT subject FROM acq.flag WHERE kind = 'qbt_login_refused'") == [(wrong,)]


def test_qbt_login_retry_ends_the_wait_once_qbittorrent_takes_the_password(
    qbt_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator fixes the password on qBittorrent's side, to the one the workers have: the
    memo still refuses it for `QBT_LOGIN_RETRY_S`, since no worker can see the change, until
    `proj qbt-login-retry`, which the refusal's message names."""
    from typer.testing import CliRunner

    from proj.acquisition import qbt
    from proj.cli import cli

    with counted_logins(qbt_factory, monkeypatch, "lift", "the-workers-secret") as (managed, logins):
        assert isinstance(log_in_elsewhere(), qbt.LoginRefused) and logins.requests_seen == 1
        admin = qbittorrentapi.Client(
            host=f"http://127.0.0.1:{managed.webui_port}", username="admin", password="right-secret"
        )
        admin.app_set_preferences({"web_ui_password": "the-workers-secret"})  # fixed on its side
        refused = log_in_elsewhere()
        assert isinstance(refused, qbt.LoginRefused) and "proj qbt-login-retry" in str(refused), refused
        assert logins.requests_seen == 1  # the memo: not tried

        result = CliRunner().invoke(cli, ["qbt-login-retry"])
        assert result.exit_code == 0 and "forgot 1 refused" in result.output, result.output
        assert log_in_elsewhere() is None and logins.requests_seen == 2


def test_clients_logging_in_at_once_with_refused_credentials_make_one_failed_login(
    qbt_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memo only helps clients that look after the refusal was recorded: clients logging in
    together (the reconcile and several approved requests picked up in the same second, as after
    a worker restart) each found no refusal and each tried, up to qBittorrent's ban threshold.
    Before: four clients started together made four failed logins. Now the check, the login and
    the record are one step under a Postgres advisory lock of the URL: one failed login."""
    from proj.acquisition import qbt
    from proj.settings import get_settings

    with counted_logins(qbt_factory, monkeypatch, "memo2", "wrong-secret") as (_, logins):
        get_settings()  # settled before the threads: each would otherwise read the environment itself
        errors: list[BaseException] = []
        together = threading.Barrier(4)

        def connect() -> None:  # a fresh thread: a client of its own, as in another worker
            together.wait()
            try:
                qbt.client().app_version()
            except BaseException as exc:  # noqa: BLE001 - collected for the assertions
                errors.append(exc)

        threads = [threading.Thread(target=connect) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 4 and all(isinstance(e, qbt.LoginRefused) for e in errors), errors
        assert logins.requests_seen == 1, errors
        assert sum("Not tried again" in str(e) for e in errors) == 3, errors


def test_a_login_that_succeeds_keeps_the_refusal_of_other_credentials(
    qbt_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sets of credentials at one qBittorrent: a worker still given the old password (another
    host not yet updated, a container not yet recreated) and one given the right one. Before:
    each login of the right one forgot every refusal of the URL, so the wrong one tried again at
    its next step, a failed login each time, until qBittorrent banned its host. Now a success
    forgets only its own credentials' refusal."""
    from proj.acquisition import qbt
    from proj.settings import get_settings

    with counted_logins(qbt_factory, monkeypatch, "memo3", None) as (_, logins):
        outcomes: list[str] = []

        def connect_with(password: str) -> None:
            monkeypatch.setenv("QBT_PASSWORD", password)
            get_settings.cache_clear()
            exc = log_in_elsewhere()
            if exc is None:
                outcomes.append("ok")
            else:
                assert isinstance(exc, qbt.LoginRefused), exc
                outcomes.append("memo" if "Not tried again" in str(exc) else "refused")

        connect_with("wrong-secret")
        connect_with("right-secret")
        connect_with("wrong-secret")
        assert outcomes == ["refused", "ok", "memo"], outcomes
        assert logins.requests_seen == 2


# ------------------------------------------------------------------ the operator's pause


def test_the_download_wait_leaves_the_operators_own_paused_torrent_paused(procs, swarm: Swarm) -> None:
    """The operator's own torrent (untagged), paused by them, is requested: the add adopts it.
    `reconcile_downloads` promises never to resume such a torrent (the operator paused it), but
    before, every re-check of the download wait resumed it. Now only a torrent of ours (tagged)
    is resumed; the operator's stays paused and the request waits for them."""
    from proj.qbt.local import add_torrent

    p = swarm.payload
    client = swarm.managed.client()
    add_torrent(client, p.torrent, p.infohash, save_path=swarm.downloads)
    client.torrents_pause(torrent_hashes=p.infohash)
    paused = ("pausedDL", "stoppedDL")
    wait_for(lambda: client.torrents_info(torrent_hashes=p.infohash)[0].state in paused, 30, what="pause")
    procs.worker("w1", concurrency=2, env=swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="1"))
    procs.beat(env=swarm.worker_env())
    task_id = start(swarm)
    wait_for(lambda: status(task_id) == "downloading", 30, what="the torrent adopted")
    checks = (
        "SELECT count(*) FROM engine.step_attempt a JOIN engine.step s ON s.id = a.step_id"
        " WHERE s.name = 'download'"
    )
    resumed = lambda: client.torrents_info(torrent_hashes=p.infohash)[0].state not in paused  # noqa: E731
    wait_for(lambda: resumed() or scalar(checks) >= 4, 30, what="a few re-checks of the download")
    assert client.torrents_info(torrent_hashes=p.infohash)[0].state in paused
    assert status(task_id) == "downloading"


# ------------------------------------------------------------------ deleted in qBittorrent


def test_a_torrent_deleted_in_qbittorrent_fails_its_request_at_once_and_a_retry_adds_it_again(
    procs, swarm: Swarm
) -> None:
    """The operator deletes a downloading torrent in qBittorrent's UI (or qBittorrent's profile
    is lost). Before: the download wait raised "disappeared" five times (~15 s) and the dead
    letter could never be revived: retrying it only re-ran the wait, which failed again, since
    the add had long been recorded. Now the first re-check flags the request (`missing_torrent`)
    and fails the run at once saying what to do; an operator's retry adds the torrent again
    (through the ledger) and the request finishes."""
    hold_seeding(swarm)
    env = swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="2")
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    added(swarm, task_id)
    client = swarm.managed.client()
    client.torrents_delete(delete_files=True, torrent_hashes=swarm.payload.infohash)
    wait_for(lambda: acquire_status() in ("failed", "succeeded"), 30, what="the acquire run to notice")
    assert acquire_status() == "failed"
    error = scalar("SELECT last_error->>'message' FROM engine.task_run WHERE kind = 'acquire'")
    assert "retry" in error and swarm.payload.infohash in error, error
    assert scalar("SELECT attempts FROM engine.step WHERE name = 'download'") == 1
    flagged = "SELECT count(*) FROM acq.flag WHERE kind = 'missing_torrent' AND subject = %s"
    assert scalar(flagged, (str(task_id),)) == 1

    run_id = scalar("SELECT id FROM engine.task_run WHERE kind = 'acquire'")
    assert runs.retry_failed(run_id) >= 1
    wait_for(lambda: client.torrents_info(torrent_hashes=swarm.payload.infohash), 30, what="the re-add")
    release(swarm)
    imported(procs, swarm, task_id)
    readd = sql("SELECT status FROM ledger.asset_operation WHERE op_key LIKE %s", (f"qbt-readd:{task_id}:%",))
    assert readd == [("done",)]
    assert "torrent added again" in events(task_id)


# ------------------------------------------------------------------ QBT_URL is not qBittorrent


@pytest.fixture
def html_page() -> Iterator[str]:
    """A web server that answers every request with an HTML page (a NAS login, a proxy's page)."""

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            body = b"<html><body>Please log in to your NAS</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer  # noqa: N815 - http.server's naming

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_qbt_url_that_is_not_qbittorrent_fails_at_once_saying_so(
    procs, html_page: str, qbt_payload, tmp_path
) -> None:
    """QBT_URL names a web page that is not qBittorrent's Web API (a wrong port, a proxy's login
    page). Before: the add step failed five times with "Exception during response parsing.
    Error: JSONDecodeError(...)", which does not say QBT_URL is wrong. Now the first call finds
    the answer is not qBittorrent's, and the step fails at once naming QBT_URL and what came."""
    approve_with_qbt(procs, qbt_payload, tmp_path, QBT_URL=html_page)
    assert acquire_status() == "failed"
    error = scalar("SELECT last_error->>'message' FROM engine.task_run WHERE kind = 'acquire'")
    assert scalar("SELECT attempts FROM engine.step WHERE name = 'add_torrent'") == 1, error
    assert "QBT_URL" in error and html_page in error and "NAS" in error, error


def test_an_unset_qbt_url_fails_the_add_at_once_naming_it(procs, qbt_payload, tmp_path) -> None:
    """QBT_URL unset: no retry can reach qBittorrent until the workers are given it. The add step
    used to spend its retries on it (a RuntimeError); it now fails at once, naming QBT_URL."""
    approve_with_qbt(procs, qbt_payload, tmp_path, QBT_URL="")
    assert acquire_status() == "failed"
    error = scalar("SELECT last_error->>'message' FROM engine.task_run WHERE kind = 'acquire'")
    assert scalar("SELECT attempts FROM engine.step WHERE name = 'add_torrent'") == 1, error
    assert "QBT_URL is not set" in error, error


@pytest.mark.parametrize("kind", ["acquire", "retire_seed", "compensate"])
def test_qbittorrent_steps_outlast_a_restart_of_several_minutes(kind: str) -> None:
    """The steps that add or remove torrents retried under the network policy: five attempts in
    about 15 s, so qBittorrent restarting for an upgrade (a minute or more) turned a request
    approved meanwhile, or a cancel's removal, into a dead letter. Their retries now span over
    five minutes (the backoff without its jitter); a refused login, an unset QBT_URL or one that
    is not qBittorrent still fail at once (the tests above)."""
    from proj.engine.kind import get_kind

    policy = get_kind(kind, 1).retry
    span = sum(
        min(policy.max_s, policy.initial_s * policy.multiplier ** (n - 1))
        for n in range(1, policy.max_attempts)
    )
    assert span >= 5 * 60, (kind, span)
