"""The front door (issue #14): requests and decisions through the JSON API, /admin and the CLI.

Real Postgres, real broker, real workers where a run must move; the acquisition runs themselves
(qBittorrent, library) are in `test_front_door_e2e.py`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from proj.admin.app import create_app
from proj.qbt.local import make_torrent
from proj.settings import get_settings
from tests.front_door_fixtures import *  # noqa: F403  (app_settings, api)
from tests.front_door_fixtures import API_TOKEN, HOOK_TOKEN, PASSWORD, events, post_request, written
from tests.support.services import scalar, wait_for

PROJ = str(Path(sys.executable).parent / "proj")
INFOHASH = "ab" * 20


@pytest.fixture(scope="module")
def torrent_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = tmp_path_factory.mktemp("payload") / "Some Film"
    (root / "extras").mkdir(parents=True)
    (root / "film.mkv").write_bytes(os.urandom(70_000))
    (root / "extras" / "notes.txt").write_bytes(b"notes")
    data, _ = make_torrent(root, piece_size=16 * 1024)
    return data


def other_torrent(tmp_path: Path, name: str = "Other") -> bytes:
    (tmp_path / name).write_bytes(os.urandom(20_000))
    return make_torrent(tmp_path / name, piece_size=16 * 1024)[0]


# ------------------------------------------------------------------------------------- auth


def test_api_auth_missing_or_wrong_token_is_401_json_and_writes_nothing(app_settings, torrent_bytes) -> None:
    before = written()
    with TestClient(create_app(app_settings)) as c:
        tid = str(uuid.uuid4())
        calls = [
            lambda h: post_request(c, torrent_bytes, headers=h),
            lambda h: c.get("/api/requests", headers=h),
            lambda h: c.get(f"/api/requests/{tid}", headers=h),
            lambda h: c.post(f"/api/requests/{tid}/approve", headers=h),
            lambda h: c.post(f"/api/requests/{tid}/reject", json={"reason": "x"}, headers=h),
            lambda h: c.post(f"/api/requests/{tid}/cancel", headers=h),
        ]
        bad = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {API_TOKEN}"},
            {"Authorization": f"Bearer {HOOK_TOKEN}"},  # the hook's token opens the hook only
            {"Authorization": f"Bearer {API_TOKEN}x"},
        ]
        for call in calls:
            for headers in bad:
                r = call(headers)
                assert r.status_code == 401, (r.request.url, headers, r.text)
                assert r.headers["content-type"].startswith("application/json")
                assert "bearer token" in r.json()["detail"]
                assert r.headers["www-authenticate"].startswith("Bearer")
        hook = "/api/hooks/qbittorrent?hash=" + INFOHASH
        for headers in ({}, {"Authorization": f"Bearer {API_TOKEN}"}, {"Authorization": "Bearer no"}):
            r = c.post(hook, headers=headers)
            assert r.status_code == 401 and "HOOK_TOKEN" in r.json()["detail"]
        # Basic auth of the admin opens the admin, not the API.
        r = c.get("/api/requests", auth=("admin", PASSWORD))
        assert r.status_code == 401
    assert written() == before


def test_api_auth_is_checked_before_the_body_is_read(app_settings) -> None:
    """Without its token an /api request is refused before its body is parsed: a malformed JSON
    body or multipart upload gets the 401, not the parser's 422 or 400 (FastAPI parses bodies
    before it runs a route's dependencies; `proj.admin.api.BearerGate` answers first)."""
    before = written()
    tid = str(uuid.uuid4())
    with TestClient(create_app(app_settings)) as c:
        bodies = [
            (f"/api/requests/{tid}/reject", "application/json", b'{"reason": '),
            ("/api/requests", "multipart/form-data; boundary=zz", b"--zz\r\nnot a part"),
            ("/api/hooks/qbittorrent?hash=" + INFOHASH, "application/json", b"{"),
        ]
        for path, ctype, body in bodies:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = c.post(path, content=body, headers={"Content-Type": ctype, **headers})
                assert r.status_code == 401, (path, headers, r.status_code, r.text)
                assert "bearer token" in r.json()["detail"]
                assert r.headers["www-authenticate"].startswith("Bearer")
                assert r.headers["x-content-type-options"] == "nosniff"  # inside the security headers
        # With the token, the same malformed bodies reach the parser.
        r = c.post(
            f"/api/requests/{tid}/reject",
            content=b'{"reason": ',
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_TOKEN}"},
        )
        assert r.status_code == 422, r.text
        assert c.get("/api/openapi.json").status_code == 200  # the schema stays open
    assert written() == before


def test_an_unset_token_disables_its_endpoints(app_settings, torrent_bytes) -> None:
    settings = app_settings.model_copy(update={"api_token": None, "hook_token": None})
    with TestClient(create_app(settings)) as c:
        r = post_request(c, torrent_bytes, headers={"Authorization": "Bearer "})
        assert r.status_code == 401 and "API_TOKEN is not set" in r.json()["detail"]
        r = c.post("/api/hooks/qbittorrent?hash=" + INFOHASH, headers={"Authorization": "Bearer "})
        assert r.status_code == 401 and "HOOK_TOKEN is not set" in r.json()["detail"]
    assert written()[0] == 0


# --------------------------------------------------------------------------- requests, API


def test_request_get_list_through_the_api(api: TestClient, torrent_bytes: bytes) -> None:
    r = post_request(api, torrent_bytes, title="A Film", webhook_url="http://127.0.0.1:9/hook")
    assert r.status_code == 201, r.text
    body = r.json()
    tid = body["id"]
    assert body["status"] == "requested" and body["title"] == "A Film" and body["files"] == 2
    assert r.headers["location"] == f"/api/requests/{tid}"

    one = api.get(f"/api/requests/{tid}").json()
    assert one["status"] == "requested" and one["progress"] == 0.0
    assert {f["path"] for f in one["files"]} == {"film.mkv", "extras/notes.txt"}
    assert [e["what"] for e in one["timeline"]] == ["requested"]
    assert one["approved_by"] is None and one["webhook_url"] == "http://127.0.0.1:9/hook"

    second = post_request(api, other_torrent_bytes(), requester="bob").json()["id"]
    listed = api.get("/api/requests").json()["requests"]
    assert [x["id"] for x in listed] == [second, tid]  # newest first
    assert [x["id"] for x in api.get("/api/requests", params={"status": "requested"}).json()["requests"]] == [
        second,
        tid,
    ]
    assert api.get("/api/requests", params={"status": "approved"}).json()["requests"] == []
    r = api.get("/api/requests", params={"status": "bogus"})
    assert r.status_code == 400 and "unknown status" in r.json()["detail"]


def other_torrent_bytes() -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return other_torrent(Path(d), "Another Film")


def test_decisions_are_taken_once(api: TestClient, torrent_bytes: bytes) -> None:
    """Approve twice, approve after a reject or a cancel, reject after approve: 409, no write."""
    a = post_request(api, torrent_bytes).json()["id"]
    r = api.post(f"/api/requests/{a}/approve", json={"by": "olga"})
    assert r.status_code == 200 and r.json()["status"] == "approved", r.text
    before = written()
    again = api.post(f"/api/requests/{a}/approve", json={"by": "olga"})
    assert again.status_code == 409 and "already approved (by olga)" in again.json()["detail"]
    assert again.json()["error"] == "RequestConflict"
    late_reject = api.post(f"/api/requests/{a}/reject", json={"by": "olga", "reason": "no"})
    assert late_reject.status_code == 409
    assert written() == before
    assert [w for w, _ in events(a)] == ["requested", "approved"]
    assert events(a)[1][1] == {"by": "olga"}

    b = post_request(api, other_torrent_bytes()).json()["id"]
    r = api.post(f"/api/requests/{b}/reject", json={"by": "olga", "reason": "not in our catalogue"})
    assert r.status_code == 200 and r.json()["status"] == "rejected", r.text
    before = written()
    for path in ("approve", "reject"):
        r = api.post(f"/api/requests/{b}/{path}", json={"by": "x", "reason": "y"})
        assert r.status_code == 409, (path, r.text)
    assert api.post(f"/api/requests/{b}/cancel").status_code == 409
    assert written() == before
    assert events(b)[-1] == ("rejected", {"by": "olga", "reason": "not in our catalogue"})

    c = post_request(api, other_torrent_bytes()).json()["id"]
    r = api.post(f"/api/requests/{c}/cancel", json={"by": "carl", "reason": "changed my mind"})
    assert r.status_code == 200 and r.json()["status"] == "canceling", r.text
    assert api.post(f"/api/requests/{c}/approve").status_code == 409
    assert api.post(f"/api/requests/{c}/cancel").status_code == 409
    assert ("cancel requested", {"by": "carl", "reason": "changed my mind"}) in events(c)

    r = api.post(f"/api/requests/{a}/reject", json={"by": "olga"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reason"], r.text


def test_idempotency_key(api: TestClient, torrent_bytes: bytes) -> None:
    key = {"Idempotency-Key": "client-" + uuid.uuid4().hex}
    first = post_request(api, torrent_bytes, headers=key, title="T")
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    again = post_request(api, torrent_bytes, headers=key, title="T")
    assert again.status_code == 201 and again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    before = written()
    for other in ({"title": "Other title"}, {"requester": "bob"}, {"webhook_url": "https://x.test/h"}):
        r = post_request(api, torrent_bytes, headers=key, **{"title": "T", **other})
        assert r.status_code == 409, r.text
        assert "another body" in r.json()["detail"] and r.json()["error"] == "KeyConflict"
    r = post_request(api, other_torrent_bytes(), headers=key, title="T")
    assert r.status_code == 409
    assert written() == before
    assert scalar("SELECT count(*) FROM acq.download_task") == 1
    # No key: every call is a new request (the API has no way to tell a retry from a second ask).
    assert post_request(api, torrent_bytes).json()["id"] != first.json()["id"]


# ------------------------------------------------------------------------------ bad input


def test_bad_input_gets_a_clear_4xx_and_writes_nothing(api: TestClient, torrent_bytes, tmp_path) -> None:
    from tests.integration.test_bad_input import bencode

    escaping = bencode(
        {
            "info": {
                "name": b"x",
                "piece length": 16384,
                "pieces": b"\0" * 20,
                "files": [{"path": [b"..", b"etc", b"passwd"], "length": 1}],
            }
        }
    )
    big = get_settings().max_torrent_bytes + 10
    kept = post_request(api, torrent_bytes).json()["id"]
    before = written()
    cases = [
        (post_request(api, b"<html>not a torrent</html>"), 400, "unreadable torrent"),
        (post_request(api, b""), 400, "empty torrent"),
        (post_request(api, escaping), 400, "unsafe path segment in torrent: '..'"),
        (post_request(api, torrent_bytes, webhook_url="ftp://example.org/x"), 400, "http(s)"),
        (post_request(api, torrent_bytes, webhook_url="javascript:alert(1)"), 400, "http(s)"),
        (post_request(api, torrent_bytes, requester=""), 422, ""),
        (post_request(api, b"d" + b"0" * big + b"e"), 413, "MAX_TORRENT_BYTES"),
        (api.get(f"/api/requests/{uuid.uuid4()}"), 404, "no download task"),
        (api.get("/api/requests/not-a-uuid"), 404, "no request"),
        (api.post(f"/api/requests/{uuid.uuid4()}/approve"), 404, "no download task"),
        (api.post(f"/api/requests/{uuid.uuid4()}/reject", json={"reason": "r"}), 404, ""),
        (api.post(f"/api/requests/{uuid.uuid4()}/cancel"), 404, ""),
        (api.post("/api/requests", data={"requester": "a"}), 422, ""),
    ]
    for r, status, text in cases:
        assert r.status_code == status, (r.request.url, r.text)
        assert r.headers["content-type"].startswith("application/json")
        detail = r.json()["detail"]
        assert text in (detail if isinstance(detail, str) else json.dumps(detail)), (status, detail)
    assert written() == before
    assert api.get(f"/api/requests/{kept}").json()["status"] == "requested"  # nothing stored changed


def test_an_oversized_upload_is_refused_before_it_is_read(api: TestClient) -> None:
    """The announced length alone decides: the body is never parsed (no temp file, no row)."""
    limit = get_settings().max_torrent_bytes
    body = b"x" * (limit + 70 * 1024)
    headers = {"Content-Type": "multipart/form-data; boundary=zzz"}
    r = api.post("/api/requests", content=body, headers=headers)
    assert r.status_code == 413 and r.json()["error"] == "TooLarge"
    assert written()[0] == 0


# ------------------------------------------------------------------------------ the hook


def test_qbittorrent_hook_stores_the_signal(api: TestClient) -> None:
    hook = {"Authorization": f"Bearer {HOOK_TOKEN}"}
    r = api.post("/api/hooks/qbittorrent", params={"hash": INFOHASH.upper()}, headers=hook)
    assert r.status_code == 200, r.text
    assert r.json() == {"topic": f"download:{INFOHASH}", "woken": 0}
    # Stored even with no waiter yet: an early signal is not lost (invariant 7).
    assert scalar("SELECT count(*) FROM engine.task_signal WHERE topic = %s", (f"download:{INFOHASH}",)) == 1
    # A v2 infohash (%J) names the same torrent as its first 40 digits, qBittorrent's id (%K).
    v2 = "cd" * 32
    r = api.post("/api/hooks/qbittorrent", params={"hash": v2}, headers=hook)
    assert r.status_code == 200 and r.json()["topic"] == f"download:{v2[:40]}", r.text
    before = written()
    for bad in ("xyz", "ab" * 19, "%K", "%I", "ab" * 20 + "; rm -rf /"):
        r = api.post("/api/hooks/qbittorrent", params={"hash": bad}, headers=hook)
        assert r.status_code == 400 and "infohash" in r.json()["detail"], bad
    assert api.post("/api/hooks/qbittorrent", headers=hook).status_code == 422
    assert written() == before


# ------------------------------------------------------------------- headers and schema


def test_security_headers(app_settings) -> None:
    with TestClient(create_app(app_settings)) as c:
        api = {"Authorization": f"Bearer {API_TOKEN}"}
        admin = {"Authorization": "Basic " + _b64(f"admin:{PASSWORD}")}
        answers = [
            c.get("/api/requests", headers=api),
            c.get("/api/requests/nope", headers=api),
            c.get("/api/requests"),  # 401 from the bearer check
            c.get("/admin", headers=admin),
            c.get("/admin"),  # 401 from Basic auth
            c.get("/admin/healthz"),
            c.get("/admin/static/admin.js"),
            c.get("/api/openapi.json"),
        ]
        for r in answers:
            csp = r.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, r.request.url
            assert "unsafe-inline" not in csp.split("script-src", 1)[1].split(";")[0]
            assert r.headers["x-content-type-options"] == "nosniff"
        # An inline script would be blocked by that CSP: the pages have none.
        for path in ("/admin", "/admin/runs", "/admin/dead", "/admin/parked"):
            html = c.get(path, headers=admin).text
            assert re.search(r"<script(?![^>]*\bsrc=)", html) is None, path
            assert "onsubmit=" not in html and "onclick=" not in html, path


def _b64(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def test_openapi_schema_describes_the_api_only(api: TestClient) -> None:
    schema = api.get("/api/openapi.json").json()
    paths = schema["paths"]
    assert set(paths) == {
        "/api/requests",
        "/api/requests/{task_id}",
        "/api/requests/{task_id}/approve",
        "/api/requests/{task_id}/reject",
        "/api/requests/{task_id}/cancel",
        "/api/hooks/qbittorrent",
    }
    assert "multipart/form-data" in paths["/api/requests"]["post"]["requestBody"]["content"]
    assert "201" in paths["/api/requests"]["post"]["responses"]
    assert "409" in paths["/api/requests/{task_id}/approve"]["post"]["responses"]


# ------------------------------------------------------------------ reject stops the run


def test_a_rejected_request_never_adds_a_torrent(inproc, api: TestClient, torrent_bytes) -> None:
    """The acquire run ends canceled with the reason; compensation leaves qBittorrent alone
    (none is configured here: touching it would fail the compensation run)."""
    import outbox
    from proj import db

    tid = post_request(api, torrent_bytes).json()["id"]
    outbox.dispatch(db.sessions(), inproc)  # the post-commit nudge may have done it already
    key = f"acquire:{tid}"
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE idempotency_key = %s", (key,)) == "waiting",
        30,
        what="acquire to park on the approval",
    )
    r = api.post(f"/api/requests/{tid}/reject", json={"by": "olga", "reason": "duplicate"})
    assert r.status_code == 200 and r.json()["runs_stopped"] == 1, r.text
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE idempotency_key = %s", (key,)) == "canceled",
        20,
        what="acquire to end canceled",
    )
    reason = scalar("SELECT cancel_reason FROM engine.task_run WHERE idempotency_key = %s", (key,))
    assert reason == "rejected by olga: duplicate"
    wait_for(
        lambda: scalar("SELECT status FROM engine.task_run WHERE kind = 'compensate'") == "succeeded",
        30,
        what="compensation to finish",
    )
    result = scalar("SELECT result FROM engine.task_run WHERE kind = 'compensate'")
    assert result is not None
    assert scalar("SELECT count(*) FROM ledger.asset_operation WHERE op_key LIKE 'qbt-%%'") == 0
    assert api.get(f"/api/requests/{tid}").json()["status"] == "rejected"
    whats = [w for w, _ in events(tid)]
    assert whats[:2] == ["requested", "rejected"] and "approved" not in whats
    assert "cancel requested" not in whats  # the run's cancel hook adds nothing to a reject


# ------------------------------------------------------------------------------- /admin


def test_admin_requests_page_upload_and_buttons(app_settings, torrent_bytes) -> None:
    with TestClient(create_app(app_settings)) as c:
        c.auth = ("admin", PASSWORD)
        page = c.get("/admin")
        assert page.status_code == 200 and "Requests" in page.text and 'id="upload"' in page.text
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        files = {"torrent": ("film.torrent", torrent_bytes, "application/x-bittorrent")}
        # Without the CSRF token: refused, nothing written.
        r = c.post("/admin/requests", data={"requester": "ann"}, files=files, follow_redirects=False)
        assert r.status_code == 403 and written()[0] == 0
        r = c.post(
            "/admin/requests",
            data={"requester": "ann", "csrf_token": token, "title": "Film"},
            files=files,
            follow_redirects=False,
        )
        assert r.status_code == 303, r.text
        tid = r.headers["location"].rsplit("/", 1)[1]
        detail = c.get(f"/admin/requests/{tid}").text
        assert 'data-action="approve"' in detail and 'data-action="reject"' in detail
        listing = c.get("/admin", params={"status": "requested"}).text
        assert f'data-request="{tid}"' in listing and "ann" in listing
        assert f'data-request="{tid}"' not in c.get("/admin", params={"status": "approved"}).text

        assert c.post(f"/admin/requests/{tid}/approve", follow_redirects=False).status_code == 403
        r = c.post(f"/admin/requests/{tid}/approve", data={"csrf_token": token}, follow_redirects=False)
        assert r.status_code == 303
        assert events(tid)[-1] == ("approved", {"by": "admin"})
        # A second click says why it did nothing.
        again = c.post(f"/admin/requests/{tid}/approve", data={"csrf_token": token})
        assert "already approved (by admin)" in again.text
        r = c.post(f"/admin/requests/{tid}/cancel", data={"csrf_token": token, "reason": "oops"})
        assert r.status_code == 200 and "cancel requested by admin" in r.text
        assert ("cancel requested", {"by": "admin", "reason": "oops"}) in events(tid)

        bad = c.post(
            "/admin/requests",
            data={"requester": "ann", "csrf_token": token},
            files={"torrent": ("x.torrent", b"junk", "application/octet-stream")},
        )
        assert "request refused" in bad.text and written()[0] == 1
        assert c.get(f"/admin/requests/{uuid.uuid4()}").status_code == 404
        assert c.get("/admin/requests/nope").status_code == 404


# --------------------------------------------------------------------------------- CLI


def proj(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([PROJ, *args], capture_output=True, text=True, timeout=60, env=os.environ.copy())
    if ok:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


def test_cli_request_list_approve_reject_cancel(tmp_path: Path, torrent_bytes: bytes) -> None:
    f = tmp_path / "film.torrent"
    f.write_bytes(torrent_bytes)
    out = proj("request", str(f), "--requester", "ann", "--title", "CLI Film").stdout
    first_line = out.splitlines()[0]
    tid = str(uuid.UUID(first_line))  # the id alone on its own line
    assert "requested" in out
    listing = proj("requests").stdout
    assert tid in listing and "CLI Film" in listing and "ann" in listing
    assert tid in proj("requests", "--status", "requested").stdout
    assert tid not in proj("requests", "--status", "approved").stdout
    r = proj("requests", "--status", "nonsense", ok=False)
    assert r.returncode == 1 and "unknown status" in r.stderr

    assert "approved" in proj("approve", tid, "--by", "olga").stdout
    r = proj("approve", tid, ok=False)
    assert r.returncode == 1 and "already approved (by olga)" in r.stderr
    r = proj("reject", tid, "--reason", "late", ok=False)
    assert r.returncode == 1 and "RequestConflict" in r.stderr
    assert events(tid)[1] == ("approved", {"by": "olga"})

    g = tmp_path / "other.torrent"
    g.write_bytes(other_torrent(tmp_path))
    other = proj("request", str(g), "--requester", "bob").stdout.splitlines()[0]
    assert "rejected" in proj("reject", other, "--reason", "no", "--by", "olga").stdout
    assert events(other)[-1] == ("rejected", {"by": "olga", "reason": "no"})

    # `proj cancel` takes a request id as well as a run id.
    out = proj("cancel", tid, "--reason", "changed", "--by", "carl").stdout
    assert "cancel requested for request" in out
    assert ("cancel requested", {"by": "carl", "reason": "changed"}) in events(tid)
    r = proj("cancel", tid, ok=False)
    assert r.returncode == 1 and "already canceling" in r.stderr

    before = written()
    junk = tmp_path / "junk.torrent"
    junk.write_bytes(b"nope")
    r = proj("request", str(junk), "--requester", "x", ok=False)
    assert r.returncode == 1 and "BadTorrent" in r.stderr
    r = proj("request", str(f), "--requester", "x", "--webhook", "file:///etc/passwd", ok=False)
    assert r.returncode == 1 and "http(s)" in r.stderr
    r = proj("approve", str(uuid.uuid4()), ok=False)
    assert r.returncode == 1 and "no download task" in r.stderr
    r = proj("approve", "not-an-id", ok=False)
    assert r.returncode == 2
    r = proj("cancel", str(uuid.uuid4()), ok=False)
    assert r.returncode == 1 and "no request or run" in r.stderr
    assert written() == before


def test_cli_json_is_not_needed_for_scripts(tmp_path: Path, torrent_bytes: bytes) -> None:
    """`ID=$(proj request … | head -1)` is the scripting idiom the first line serves."""
    f = tmp_path / "film.torrent"
    f.write_bytes(torrent_bytes)
    script = (
        f'ID=$({PROJ} request {f} --requester sh | head -1) && {PROJ} approve "$ID" --by sh && echo "$ID"'
    )
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tid = r.stdout.strip().splitlines()[-1]
    assert json.loads(json.dumps(events(tid)))[1][0] == "approved"
