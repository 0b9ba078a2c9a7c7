"""An operator's review of the README's commands outside the test suite: each test names what an
operator saw before its fix. `proj` runs as the operator runs it (a subprocess, stdout piped),
against the test database and broker."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.front_door_fixtures import *  # noqa: F403  (app_settings, api)
from tests.support.services import ROOT


def proj_run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "COLUMNS": "250", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "proj.cli", *args], env=full, capture_output=True, text=True, timeout=120
    )


def worker_run(node: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`celery -A proj worker` with `env` added, until it exits (these tests start one that cannot)."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "worker", "-l", "warning", "-n", f"{node}@%h"],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_database_url_that_is_not_postgres_says_so() -> None:
    """Before: `DATABASE_URL=mysql://…` answered `ModuleNotFoundError: No module named 'MySQLdb'`,
    a URL without a scheme `ArgumentError: Could not parse SQLAlchemy URL`, `sqlite:///…` a
    `TypeError`, and `proj doctor` itself ended on them instead of reporting its postgres check.
    Now every command says DATABASE_URL must be a Postgres URL, without the URL's password, and
    doctor reports it as the failed postgres check."""
    for url in ("mysql://root:hunter2@127.0.0.1/test", "notaurl", "sqlite:///x.db"):
        done = proj_run("runs", env={"DATABASE_URL": url})
        assert done.returncode == 1, (url, done.stdout, done.stderr)
        assert "DATABASE_URL must be a Postgres URL" in done.stderr, (url, done.stderr)
        assert "Traceback" not in done.stderr and "hunter2" not in done.stderr, done.stderr

        doctor = proj_run("doctor", env={"DATABASE_URL": url})
        assert doctor.returncode == 1, (url, doctor.stdout, doctor.stderr)
        out = doctor.stdout + doctor.stderr
        assert "DATABASE_URL must be a Postgres URL" in out and "check(s) failed: postgres" in out, out
        assert "hunter2" not in out, out


def test_outbox_on_a_database_not_migrated_exits_non_zero() -> None:
    """Before: `proj outbox` on a database without the outbox table printed "run `proj migrate`"
    and exited 0, unlike every other command on such a database (exit 1), so a script or a
    healthcheck took it for a working outbox. Now it exits 1 with that line on stderr."""
    import psycopg

    from tests.conftest import PG_ADMIN_URL, TEST_DB
    from tests.support.services import recreate_database

    name = f"{TEST_DB}_unmigrated"
    recreate_database(PG_ADMIN_URL, name)
    try:
        done = proj_run("outbox", env={"DATABASE_URL": PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name})
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "run `proj migrate`" in done.stderr, done.stderr


def test_piped_runs_and_requests_print_only_tab_separated_lines(published) -> None:
    """README: "Piped, `proj runs` and `proj requests` print whole values, one per line,
    tab-separated." Before: piped `proj runs --limit 1` added "more than 1: use --limit or
    filters" to stdout, and `proj requests` with none added "no requests: …", so `cut -f1` or
    `tail -n +2` read a hint as a run or a request. Now hints go to stderr, as `proj requests`'
    "more:" hint already did."""
    from proj.engine import runs
    from tests.conftest import new_key

    for n in range(2):
        runs.enqueue("probe", {"n": n}, idempotency_key=new_key())
    runs = proj_run("runs", "--limit", "1")
    assert runs.returncode == 0, runs.stderr
    lines = runs.stdout.splitlines()
    assert len(lines) == 2 and all(len(line.split("\t")) == 6 for line in lines), runs.stdout
    assert "more than 1" in runs.stderr, runs.stderr

    none = proj_run("requests", "--status", "rejected")
    assert none.returncode == 0, none.stderr
    assert none.stdout.splitlines() == ["id\ttitle\trequester\tstatus\tprogress\tsize\tage"], none.stdout
    assert "no requests" in none.stderr, none.stderr


def test_huge_option_values_are_refused_as_usage_errors() -> None:
    """Before: `proj runs --limit 9223372036854775807` and `proj outbox --limit 99999999999999999999`
    ended on `DataError: (psycopg.errors.NumericValueOutOfRange) bigint out of range`,
    and `proj healthcheck --timeout 1e308` on `OverflowError: timestamp out of range for
    platform time_t`, lines that name no option. Now each is a usage error naming the option
    and its bound, exit 2, before anything is read."""
    cases = [
        ("runs", "--limit", "9223372036854775807"),
        ("outbox", "--limit", "99999999999999999999"),
        ("healthcheck", "--role", "beat", "--timeout", "1e308"),
    ]
    for args in cases:
        done = proj_run(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        option = args[-2]
        assert f"Invalid value for '{option}'" in done.stderr, (args, done.stderr)


def test_an_api_cancel_with_an_empty_reason_is_refused(api, tmp_path) -> None:
    """README: 400 for "an empty `by`/`reason` … (decisions and cancel alike)". Before:
    `POST /api/requests/ID/cancel` with `{"reason": ""}` canceled the request (200) under the
    default reason, while `"   "` was a 400 and `proj cancel ID --reason ''` refused; now an
    empty reason is the same 400 and nothing is canceled. A body without a reason still takes
    the default."""
    from proj.qbt.local import make_torrent
    from tests.front_door_fixtures import post_request

    (tmp_path / "film.mkv").write_bytes(os.urandom(20_000))
    torrent = make_torrent(tmp_path / "film.mkv")[0]
    tid = post_request(api, torrent).json()["id"]
    r = api.post(f"/api/requests/{tid}/cancel", json={"by": "olga", "reason": ""})
    assert r.status_code == 400 and r.json()["error"] == "BadInput", (r.status_code, r.text)
    assert api.get(f"/api/requests/{tid}").json()["status"] == "requested"
    r = api.post(f"/api/requests/{tid}/cancel", json={"by": "olga"})
    assert r.status_code == 200 and r.json()["status"] in ("canceling", "canceled"), r.text


def test_a_malformed_engine_serve_is_a_bad_setting() -> None:
    """README: `ENGINE_SERVE=acquire@2,…` pins the versions a worker serves. Before: a part
    without its version (`acquire`) ended `celery -A proj worker` on `IndexError: list index out
    of range`, and `acquire@x` on int()'s ValueError, naming no setting. Now ENGINE_SERVE is
    checked with the other settings: the worker's error names it and the form it takes, and a
    `proj` command says "bad setting: ENGINE_SERVE" in one line."""
    for value in ("acquire", "acquire@x", "acquire@0"):
        done = proj_run("runs", env={"ENGINE_SERVE": value})
        assert done.returncode == 1, (value, done.stdout, done.stderr)
        assert "bad setting: ENGINE_SERVE" in done.stderr and "kind@version" in done.stderr, done.stderr

    worker = worker_run("badserve", ENGINE_SERVE="acquire")
    assert worker.returncode != 0, worker.stdout + worker.stderr
    assert "engine_serve" in worker.stderr and "'acquire' is not kind@version" in worker.stderr, worker.stderr
    assert "IndexError" not in worker.stderr, worker.stderr


def test_a_signal_payload_that_is_not_json_names_the_option() -> None:
    """Before: `proj signal TOPIC --payload '{bad'` answered `JSONDecodeError: Expecting
    property name enclosed in double quotes: line 1 column 2 (char 1)`, naming neither the
    option nor what it takes, exit 1 as if the command had run. Now it is a usage error: the
    line names --payload and says it must be JSON, exit 2, and nothing is stored."""
    from tests.support.services import scalar

    before = scalar("SELECT count(*) FROM engine.task_signal")
    for bad in ("{bad", ""):
        done = proj_run("signal", "review:payload", "--payload", bad)
        assert done.returncode == 2, (bad, done.stdout, done.stderr)
        assert "--payload must be JSON" in done.stderr and "JSONDecodeError" not in done.stderr, done.stderr
    assert scalar("SELECT count(*) FROM engine.task_signal") == before
    done = proj_run("signal", "review:payload", "--payload", '{"ok": true}')
    assert done.returncode == 0 and "0 run(s) woken" in done.stdout, (done.stdout, done.stderr)


def test_cancel_of_a_run_refuses_an_empty_reason_as_a_request_does(published) -> None:
    """Before: `proj cancel REQUEST --reason ''` refused ("a reason must be 1..500 characters"),
    but `proj cancel RUN --reason ''` canceled the run with the reason " (by root)", and a
    600-character reason went in whole. Now a run's cancel takes the same reason rule, exit 1,
    and the run is left alone."""
    from proj.engine import runs
    from tests.conftest import new_key
    from tests.support.services import scalar

    ref = runs.enqueue("probe", {"n": 1}, idempotency_key=new_key())
    for reason in ("", "   ", "r" * 600):
        done = proj_run("cancel", str(ref.task_run_id), "--reason", reason)
        assert done.returncode == 1, (reason, done.stdout, done.stderr)
        assert "a reason must be 1..500 characters" in done.stderr, done.stderr
    assert scalar("SELECT cancel_requested_at FROM engine.task_run WHERE id = %s", (ref.task_run_id,)) is None
    done = proj_run("cancel", str(ref.task_run_id), "--reason", " wrong film ", "--by", "alice")
    assert done.returncode == 0, (done.stdout, done.stderr)
    reason = scalar("SELECT cancel_reason FROM engine.task_run WHERE id = %s", (ref.task_run_id,))
    assert reason == "wrong film (by alice)", reason


def test_an_engine_serve_naming_no_kind_says_which_exist() -> None:
    """`ENGINE_SERVE=nosuch@1` (a typo, or a version not yet deployed) stopped the worker on
    `unknown kind nosuch@1`, naming neither the setting nor the versions it could name. Now the
    worker's error names ENGINE_SERVE and lists the loaded kinds."""
    worker = worker_run("noserve", ENGINE_SERVE="nosuch@1")
    assert worker.returncode != 0, worker.stdout + worker.stderr
    assert "ENGINE_SERVE names nosuch@1" in worker.stderr, worker.stderr
    assert "acquire@1" in worker.stderr.split("known:")[-1], worker.stderr


def test_a_worker_on_a_schema_a_newer_version_migrated_says_so() -> None:
    """After an upgrade rolled back to the previous image, the worker (and `proj doctor`) said
    "run `proj migrate`", which then failed on alembic's "Can't locate revision". Now the
    schema check says a newer version migrated the database and what to do instead."""
    import psycopg

    from tests.conftest import PG_ADMIN_URL, TEST_DB
    from tests.support.services import recreate_database

    name = f"{TEST_DB}_newer"
    recreate_database(PG_ADMIN_URL, name)
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    try:
        assert proj_run("migrate", env={"DATABASE_URL": url}).returncode == 0
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE public.alembic_version SET version_num = '9999_from_the_future'")
        doctor = proj_run("doctor", env={"DATABASE_URL": url})
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    out = doctor.stdout + doctor.stderr
    assert doctor.returncode == 1, out
    assert "a newer version of proj migrated it" in out, out
    assert "run `proj migrate`" not in out, out
