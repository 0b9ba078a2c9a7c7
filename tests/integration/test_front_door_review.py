"""A review of the front door (`/api`, `/admin`): each test names what a user saw before its fix.

Real Postgres and broker; the app is built as `proj admin` builds it (`create_app`). Clients that
expect a refusal do not re-raise server exceptions, so a 500 is seen as the user sees it.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from proj.admin.app import create_app
from proj.qbt.local import make_torrent
from tests.front_door_fixtures import *  # noqa: F403  (app_settings, api)
from tests.front_door_fixtures import API_TOKEN, PASSWORD, events, post_request, written
from tests.support.services import scalar


@pytest.fixture(scope="module")
def film(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    root = tmp_path_factory.mktemp("payload") / "Review Film"
    root.mkdir()
    (root / "film.mkv").write_bytes(os.urandom(40_000))
    return make_torrent(root, piece_size=16 * 1024)[0]


@pytest.fixture
def raise_server_exceptions() -> bool:
    """`api` and `admin` see a 500 as the user sees it (`tests/front_door_fixtures.py`)."""
    return False


@pytest.fixture
def admin(app_settings) -> Iterator[TestClient]:
    with TestClient(create_app(app_settings), raise_server_exceptions=False) as c:
        c.auth = ("admin", PASSWORD)
        yield c


def csrf_of(c: TestClient) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', c.get("/admin").text)
    assert m is not None
    return m.group(1)


def raw_json(c: TestClient, path: str, body: bytes):
    return c.post(path, content=body, headers={"Content-Type": "application/json"})


# ------------------------------------------------------------------------------ /admin auth


def test_admin_credentials_are_checked_before_the_body_is_read(app_settings) -> None:
    """Before: FastAPI parsed an /admin POST's form (a multipart upload spooled to disk) before
    the Basic-auth dependency ran, so an anonymous client made the server read its upload and
    got the parser's 400 ("Part exceeded maximum size") instead of 401."""
    big_field = "x" * (1024 * 1024 + 10)
    files = {"torrent": ("f.torrent", b"d4:infode", "application/x-bittorrent")}
    with TestClient(create_app(app_settings), raise_server_exceptions=False) as c:
        for auth in (None, ("admin", "wrong")):
            r = c.post("/admin/requests", data={"requester": big_field}, files=files, auth=auth)
            assert r.status_code == 401, (auth, r.status_code, r.text[:200])
            assert r.headers["www-authenticate"].startswith("Basic")
            assert r.headers["x-content-type-options"] == "nosniff"
            assert r.json()["detail"] == "authentication required"
        # The open paths stay open; with the password the same POST reaches the CSRF check.
        assert c.get("/admin/healthz").text == "ok"
        assert c.get("/admin/static/admin.js").status_code == 200
        r = c.post("/admin/requests", data={"requester": "ann"}, files=files, auth=("admin", PASSWORD))
        assert r.status_code == 403
    assert written()[0] == 0


def test_a_non_ascii_csrf_token_is_refused_with_403_not_500(
    api: TestClient, admin: TestClient, film: bytes
) -> None:
    """Before: `secrets.compare_digest` on a non-ASCII str raised TypeError: a 500."""
    tid = post_request(api, film).json()["id"]
    csrf_of(admin)
    before = written()
    for token in ("ü", "\u2603" * 43):
        r = admin.post(f"/admin/requests/{tid}/approve", data={"csrf_token": token}, follow_redirects=False)
        assert r.status_code == 403, (token, r.status_code, r.text)
    assert written() == before


# --------------------------------------------------------------------------- bad text in fields


def test_a_lone_surrogate_in_a_json_body_is_a_422_not_a_500(api: TestClient, film: bytes) -> None:
    """Before: the validation error echoed the input ('\\ud800') and rendering it as UTF-8 raised
    UnicodeEncodeError: the client got a 500 text/plain."""
    tid = post_request(api, film).json()["id"]
    before = written()
    for path, body in (
        ("approve", rb'{"by": "\ud800"}'),
        ("reject", rb'{"by": "olga", "reason": "x\udfff"}'),
        ("cancel", rb'{"reason": "\ud800"}'),
    ):
        r = raw_json(api, f"/api/requests/{tid}/{path}", body)
        assert r.status_code == 422, (path, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["detail"][0]["loc"][0] == "body"
    assert written() == before
    assert api.get(f"/api/requests/{tid}").json()["status"] == "requested"


def test_a_nul_in_the_requester_filter_is_a_400_not_a_500(api: TestClient, admin: TestClient, film) -> None:
    """Before: Postgres refused the NUL in the query parameter: 500 on /api and on /admin."""
    post_request(api, film)
    r = api.get("/api/requests", params={"requester": "al\x00ice"})
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["error"] == "BadInput" and "requester" in r.json()["detail"]
    assert [
        x["requester"] for x in api.get("/api/requests", params={"requester": "alice"}).json()["requests"]
    ] == ["alice"]
    r = admin.get("/admin", params={"requester": "\x00"}, follow_redirects=False)
    assert r.status_code == 303, (r.status_code, r.text)
    assert "requester" in admin.get("/admin").text  # the flash says why


def test_a_cancel_with_unstorable_or_empty_who_or_why_is_a_400_and_writes_nothing(
    api: TestClient, admin: TestClient, film: bytes
) -> None:
    """Before: `by`/`reason` went unchecked into the timeline's JSONB: a NUL was a 500, and an
    empty `by` was written as a cancel "by ''" (approve and reject refuse both)."""
    tid = post_request(api, film).json()["id"]
    before = written()
    for body in ({"by": "a\x00b"}, {"reason": "why\x00"}, {"by": ""}, {"by": "   "}, {"reason": "  "}):
        r = api.post(f"/api/requests/{tid}/cancel", json=body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert r.json()["error"] == "BadInput"
    token = csrf_of(admin)
    r = admin.post(
        f"/admin/requests/{tid}/cancel", data={"csrf_token": token, "reason": "x\x00"}, follow_redirects=False
    )
    assert r.status_code == 303, (r.status_code, r.text)
    assert written() == before
    assert api.get(f"/api/requests/{tid}").json()["status"] == "requested"
    assert [w for w, _ in events(tid)] == ["requested"]
    # A well-formed cancel still goes through, once.
    r = api.post(f"/api/requests/{tid}/cancel", json={"by": "carl", "reason": "changed my mind"})
    assert r.status_code == 200 and r.json()["status"] == "canceling", r.text


# --------------------------------------------------------------------- error bodies, schema


def test_every_api_refusal_has_the_documented_error_body(app_settings, film: bytes) -> None:
    """The schema says a 401 or 404 answer is `ApiError` ({detail, error}, both required).
    Before: a 401 and the 404 of a malformed id carried `detail` only."""
    with TestClient(create_app(app_settings), raise_server_exceptions=False) as c:
        ok = {"Authorization": f"Bearer {API_TOKEN}"}
        answers = [
            (c.get("/api/requests"), 401),
            (c.get("/api/requests", headers={"Authorization": "Bearer nope"}), 401),
            (c.post(f"/api/hooks/qbittorrent?hash={'ab' * 20}"), 401),
            (c.get("/api/requests/not-a-uuid", headers=ok), 404),
            (c.post("/api/requests/zz/approve", headers=ok), 404),
            (c.post("/api/requests/zz/reject", json={"reason": "r"}, headers=ok), 404),
            (c.post("/api/requests/zz/cancel", headers=ok), 404),
            (c.get(f"/api/requests/{uuid.uuid4()}", headers=ok), 404),
        ]
        for r, status in answers:
            assert r.status_code == status, (r.request.url, r.text)
            body = r.json()
            assert isinstance(body.get("detail"), str) and isinstance(body.get("error"), str), (
                r.request.url,
                body,
            )
        schema = c.get("/api/openapi.json").json()
        assert schema["components"]["schemas"]["ApiError"]["required"] == ["detail", "error"]


def test_the_openapi_schema_declares_the_bearer_tokens(api: TestClient) -> None:
    """Before: the token was an optional `authorization` header parameter, which OpenAPI tools
    ignore by the spec: no security scheme, so a generated client never sent the token. And the
    hook listed 404 "no such request" and 409, which it never answers."""
    schema = api.get("/api/openapi.json").json()
    schemes = schema["components"]["securitySchemes"]
    assert {s["type"] for s in schemes.values()} == {"http"}
    assert {s["scheme"].lower() for s in schemes.values()} == {"bearer"}
    assert set(schemes) == {"API_TOKEN", "HOOK_TOKEN"}
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            want = "HOOK_TOKEN" if path.startswith("/api/hooks/") else "API_TOKEN"
            assert op.get("security") == [{want: []}], (method, path, op.get("security"))
            params = [p["name"].lower() for p in op.get("parameters", [])]
            assert "authorization" not in params, (method, path)
            assert "401" in op["responses"], (method, path)
    hook = schema["paths"]["/api/hooks/qbittorrent"]["post"]["responses"]
    assert "404" not in hook and "409" not in hook and "400" in hook
    for verb in ("approve", "reject", "cancel"):
        assert {"400", "404", "409", "413"} <= set(
            schema["paths"][f"/api/requests/{{task_id}}/{verb}"]["post"]["responses"]
        )
    assert "413" in schema["paths"]["/api/requests"]["post"]["responses"]
    assert "409" not in schema["paths"]["/api/requests"]["get"]["responses"]


# ------------------------------------------------------------------------------- uploads


def test_a_chunked_upload_over_the_limit_is_cut_off_while_it_streams(app_settings) -> None:
    """An upload without `Content-Length` (chunked; `curl -T -`) was read to its end and spooled
    to disk before the torrent's size was checked. Now the body is counted as it arrives and
    refused with 413 once it passes the limit; the rest is never read."""
    app = create_app(app_settings)
    limit = app_settings.max_torrent_bytes
    head = (
        b'--zz\r\nContent-Disposition: form-data; name="torrent"; filename="f.torrent"\r\n'
        b"Content-Type: application/x-bittorrent\r\n\r\n"
    )
    chunk = b"x" * (256 * 1024)
    total_chunks = (4 * limit) // len(chunk)
    consumed = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal consumed
        if consumed == 0:
            consumed += 1
            return {"type": "http.request", "body": head, "more_body": True}
        if consumed > total_chunks:
            return {"type": "http.request", "body": b"\r\n--zz--\r\n", "more_body": False}
        consumed += 1
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/requests",
        "raw_path": b"/api/requests",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", f"Bearer {API_TOKEN}".encode()),
            (b"content-type", b"multipart/form-data; boundary=zz"),
            (b"transfer-encoding", b"chunked"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 413, (start, consumed, total_chunks)
    assert (consumed - 1) * len(chunk) <= limit + 64 * 1024 + len(chunk), (consumed, total_chunks)
    assert written()[0] == 0


def test_a_chunked_upload_under_the_limit_still_lands(api: TestClient, film: bytes) -> None:
    """The guard of the test above: counting the body must not refuse a torrent in the limit."""
    body = (
        b'--zz\r\nContent-Disposition: form-data; name="requester"\r\n\r\nchunky\r\n'
        b'--zz\r\nContent-Disposition: form-data; name="torrent"; filename="f.torrent"\r\n'
        b"Content-Type: application/x-bittorrent\r\n\r\n" + film + b"\r\n--zz--\r\n"
    )

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    r = api.post(
        "/api/requests", content=chunks(), headers={"Content-Type": "multipart/form-data; boundary=zz"}
    )
    assert r.status_code == 201, r.text
    assert r.json()["requester"] == "chunky"
    assert scalar("SELECT count(*) FROM acq.download_task") == 1


def test_a_decision_body_over_its_limit_is_a_413_and_decides_nothing(api: TestClient, film: bytes) -> None:
    """A decision's body is a few hundred bytes; before, any size was read into memory and a
    padded one still approved. Now a body over 64 KiB is refused: by its `Content-Length`
    before it is read, or counted as it arrives when it has none (chunked)."""
    tid = post_request(api, film).json()["id"]
    pad = "x" * (200 * 1024)
    before = written()
    r = api.post(f"/api/requests/{tid}/approve", json={"by": "olga", "pad": pad})
    assert r.status_code == 413, (r.status_code, r.text[:200])
    assert r.json()["error"] == "TooLarge"

    def chunked() -> Iterator[bytes]:
        yield b'{"by": "olga", "pad": "'
        yield pad.encode()
        yield b'"}'

    r = api.post(
        f"/api/requests/{tid}/approve", content=chunked(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413, (r.status_code, r.text[:200])
    assert r.json()["error"] == "TooLarge"
    assert written() == before
    assert api.get(f"/api/requests/{tid}").json()["status"] == "requested"
    r = api.post(f"/api/requests/{tid}/approve", json={"by": "olga"})
    assert r.status_code == 200 and r.json()["status"] == "approved", r.text


def test_the_runs_page_with_out_of_range_filters_is_not_a_500(admin: TestClient) -> None:
    """Before: `?page=` past bigint's range or `?version=` past integer's, or a NUL in a
    filter, reached Postgres as such and the page was a 500."""
    for params in (
        {"page": str(10**19)},
        {"page": "-5"},
        {"version": "9" * 20},
        {"q": "ab\x00"},
        {"kind": "acquire\x00"},
    ):
        r = admin.get("/admin/runs", params=params)
        assert r.status_code == 200, (params, r.status_code, r.text[:200])


# ------------------------------------------------------------------------ list, pages, reject


def test_the_requests_list_pages_on_to_the_oldest(api: TestClient, film: bytes) -> None:
    """Before: `GET /api/requests` returned at most `LIST_LIMIT` (200) rows with no way on, so
    older requests were out of reach. Now each page carries `next`, the id to pass as `after`.
    Four of the requests share one transaction (one `created_at`): the id orders them, and no
    row repeats or goes missing across pages, even when a request arrives between two pages."""
    from proj import db
    from proj.acquisition import service

    for _ in range(3):
        assert post_request(api, film).status_code == 201
    with db.sessions().begin() as s:
        for _ in range(4):
            service.request_download(s, requester="alice", torrent=film)
    everything = [r["id"] for r in api.get("/api/requests", params={"limit": 200}).json()["requests"]]
    assert len(everything) == 7

    seen: list[str] = []
    after = None
    pages = 0
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        page = api.get("/api/requests", params=params).json()
        seen += [r["id"] for r in page["requests"]]
        pages += 1
        if pages == 1:
            assert post_request(api, film).status_code == 201  # newer: not on the later pages
        after = page["next"]
        if after is None:
            break
    assert pages == 3
    assert seen == everything
    assert api.get("/api/requests", params={"limit": 7}).json()["next"] is not None  # the new one
    assert api.get("/api/requests", params={"limit": 8}).json()["next"] is None

    r = api.get("/api/requests", params={"after": str(uuid.uuid4())})
    assert r.status_code == 400 and r.json()["error"] == "BadInput", r.text
    assert api.get("/api/requests", params={"after": "not-a-uuid"}).status_code == 422


def test_a_requester_of_only_spaces_is_refused(api: TestClient, film: bytes) -> None:
    """Before: the API accepted `requester="   "` (the admin form strips it), a request nobody
    could be told about."""
    before = written()
    r = post_request(api, film, requester="   ")
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["error"] == "BadInput" and "requester" in r.json()["detail"]
    assert written() == before


def test_a_reject_without_a_reason_is_refused_as_the_schema_says(api: TestClient, film: bytes) -> None:
    """Before: the schema showed a reject's `reason` as optional, and leaving it out was a 400.
    Now the schema requires it and a body without one is refused by validation."""
    schema = api.get("/api/openapi.json").json()
    body = schema["paths"]["/api/requests/{task_id}/reject"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert "reason" in schema["components"]["schemas"][ref]["required"]

    tid = post_request(api, film).json()["id"]
    for payload in ({"by": "olga"}, {"by": "olga", "reason": ""}):
        r = api.post(f"/api/requests/{tid}/reject", json=payload)
        assert r.status_code == 422, (payload, r.status_code, r.text)
    assert api.get(f"/api/requests/{tid}").json()["status"] == "requested"
    r = api.post(f"/api/requests/{tid}/reject", json={"by": "olga", "reason": "not in the catalogue"})
    assert r.status_code == 200 and r.json()["status"] == "rejected", r.text


def test_the_admin_requests_page_pages_on_to_the_oldest(admin: TestClient, film: bytes) -> None:
    """Before: /admin showed the newest 100 requests and nothing older. Now a full page links
    to the older ones (`?after=`, the same keyset as the API), and an unknown mark says so."""
    from proj import db
    from proj.acquisition import service

    with db.sessions().begin() as s:
        first = service.request_download(s, requester="oldest", torrent=film)
    with db.sessions().begin() as s:
        for _ in range(100):
            service.request_download(s, requester="alice", torrent=film)
    page = admin.get("/admin").text
    assert str(first) not in page
    m = re.search(r'href="\?status=&(?:amp;)?requester=&(?:amp;)?after=([0-9a-f-]{36})">older', page)
    assert m is not None, "no link to the older requests"
    older = admin.get("/admin", params={"after": m.group(1)}).text
    assert str(first) in older and "older →" not in older
    r = admin.get("/admin", params={"after": "nope"}, follow_redirects=False)
    assert r.status_code == 303


def test_a_non_ascii_api_token_is_accepted(app_settings, film: bytes) -> None:
    """The `Authorization` header reaches the app decoded as latin-1, and its text was compared
    re-encoded as UTF-8: a non-ASCII `API_TOKEN` refused every request, its own included."""
    token = "clé-" + uuid.uuid4().hex
    with TestClient(
        create_app(app_settings.model_copy(update={"api_token": SecretStr(token)})),
        raise_server_exceptions=False,
    ) as c:
        r = c.get("/api/requests", headers={"Authorization": b"Bearer " + token.encode()})
        assert r.status_code == 200, r.text
        r = c.get("/api/requests", headers={"Authorization": b"Bearer " + token.replace("é", "e").encode()})
        assert r.status_code == 401
