"""The `/admin` web app: the operator's Requests (upload, approve, reject, cancel), what Flower
cannot show (business timelines, dead letters, draining versions, outbox backlog, parked runs),
the decisions on dead letters, and the JSON API under `/api` (`proj.admin.api`).

Security: every page needs HTTP Basic credentials (`ADMIN_USERNAME` / `ADMIN_PASSWORD`),
checked before a body is read (`AdminGate`), unless the app was made with `insecure=True`
(loopback only, see `proj admin --insecure-local`).
Browsers resend Basic credentials on cross-site requests, so every POST also needs the per-session
CSRF token (a signed session cookie, `SameSite=Strict`); a POST without it gets 403. Every answer
carries a CSP allowing scripts from this origin only (no inline script), `frame-ancestors 'none'`
and `nosniff` (`tests/integration/test_front_door.py::test_security_headers`).
"""

from __future__ import annotations

import base64
import binascii
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from fastapi.templating import Jinja2Templates
from fastapi.utils import is_body_allowed_for_status_code
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.sessions import SessionMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proj import db
from proj.acquisition import service
from proj.admin import overview, queries
from proj.admin.api import FORM_OVERHEAD, ApiRefusal, BearerGate, api_router, too_large
from proj.admin.metrics import MetricsUnavailable, Source, metrics_router
from proj.admin.timeline import short_json
from proj.engine.errors import BadInput
from proj.engine.store import views
from proj.settings import Settings, get_settings

TEMPLATES = Path(__file__).resolve().parent / "templates"
STATIC = Path(__file__).resolve().parent / "static"
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        b"object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]
UPLOAD_PATHS = ("/api/requests", "/admin/requests")
REALM = 'Basic realm="proj admin", charset="UTF-8"'
CSRF_FIELD = "csrf_token"


class AdminConfigError(RuntimeError):
    """The admin cannot start safely with this configuration (says what to set)."""


@dataclass(frozen=True)
class AdminAuth:
    """Credentials checked on every request; `None` means no auth (insecure local mode)."""

    username: str
    password: str | None

    def check(self, header: str | None) -> bool:
        if self.password is None:
            return True
        scheme, _, value = (header or "").partition(" ")
        if scheme.lower() != "basic" or not value:
            return False
        try:
            user, sep, pw = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        # Compare both parts always, in constant time, so timing tells nothing about either.
        ok_user = secrets.compare_digest(user.encode(), self.username.encode())
        ok_pw = secrets.compare_digest(pw.encode(), self.password.encode())
        return bool(sep) and ok_user and ok_pw


# ------------------------------------------------------------------------------ formatting


def fmt_size(value: int | None) -> str:
    """Bytes for people: 1.4 GiB, 700 MiB, 12 KiB."""
    if value is None:
        return ""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(value)


class SecurityHeaders:
    """Pure ASGI: adds the headers to every answer (pages, JSON, errors, static files), and
    refuses a POST body over its limit: an upload over the torrent limit (plus its form), any
    other body over `FORM_OVERHEAD`. An announced `Content-Length` over it is refused before
    anything is read; a body without one (chunked) is counted as it arrives and cut off with
    the same 413 once it passes the limit
    (`tests/integration/test_front_door_review.py::test_a_chunked_upload_over_the_limit_is_cut_off_while_it_streams`)."""

    def __init__(self, app: ASGIApp, max_upload: int) -> None:
        self.app = app
        self.max_upload = max_upload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0] not in dict(SECURITY_HEADERS)]
                message["headers"] = headers + SECURITY_HEADERS
            await send(message)

        request = Request(scope)
        if request.method != "POST":
            await self.app(scope, receive, send_with_headers)
            return
        upload = scope["path"] in UPLOAD_PATHS
        limit = self.max_upload if upload else 0
        why = (
            f"upload over MAX_TORRENT_BYTES ({self.max_upload} bytes)"
            if upload
            else f"request body over {FORM_OVERHEAD} bytes"
        )
        if too_large(request, limit):
            answer = JSONResponse({"detail": why, "error": "TooLarge"}, status_code=413)
            await answer(scope, receive, send_with_headers)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit + FORM_OVERHEAD:
                    # An HTTPException: FastAPI re-raises it from its body parsing (any other
                    # error there becomes a 400), and the app's handler answers it.
                    raise ApiRefusal(413, why, "TooLarge")
            return message

        await self.app(scope, counted, send_with_headers)


class AdminGate:
    """Refuses an `/admin` request without the admin's Basic credentials before anything reads
    its body. FastAPI parses a route's form (an upload spooled to disk) before it runs the
    route's dependencies, so with `require_auth` alone an anonymous client made the server read
    its upload. The health check and the script stay open
    (`test_front_door_review.py::test_admin_credentials_are_checked_before_the_body_is_read`)."""

    OPEN = ("/admin/healthz", "/admin/static/admin.js")

    def __init__(self, app: ASGIApp, auth: AdminAuth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if (
            (path == "/admin" or path.startswith("/admin/"))
            and path not in self.OPEN
            and not self.auth.check(Headers(scope=scope).get("authorization"))
        ):
            answer = JSONResponse(
                {"detail": "authentication required", "error": "Unauthorized"},
                status_code=401,
                headers={"WWW-Authenticate": REALM},
            )
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)


def printable(value: Any) -> Any:
    """A JSON-shaped value whose text UTF-8 can encode (a lone surrogate becomes '?')."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, list):
        return [printable(v) for v in value]
    if isinstance(value, dict):
        return {printable(k): printable(v) for k, v in value.items()}
    return value


def fmt_ts(value: datetime | None) -> str:
    if value is None:
        return ""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value.tzinfo else value.isoformat()


def fmt_ago(value: datetime | None) -> str:
    """Relative time ("3m ago", "in 20s") for a timestamptz."""
    if value is None:
        return ""
    now = datetime.now(UTC) if value.tzinfo else datetime.now()
    secs = (now - value).total_seconds()
    future, secs = secs < 0, abs(secs)
    if secs < 60:
        text = f"{secs:.0f}s"
    elif secs < 3600:
        text = f"{secs / 60:.0f}m"
    elif secs < 86400:
        text = f"{secs / 3600:.1f}h"
    else:
        text = f"{secs / 86400:.1f}d"
    return f"in {text}" if future else f"{text} ago"


def make_templates() -> Jinja2Templates:
    t = Jinja2Templates(directory=str(TEMPLATES))
    t.env.filters["ts"] = fmt_ts
    t.env.filters["ago"] = fmt_ago
    t.env.filters["short"] = short_json
    t.env.filters["size"] = fmt_size
    return t


# ------------------------------------------------------------------------------- the app


def create_app(
    settings: Settings | None = None,
    *,
    insecure: bool = False,
    secret: str | None = None,
) -> FastAPI:
    """Build the admin app. Refuses to build without `ADMIN_PASSWORD` unless `insecure`."""
    settings = settings or get_settings()
    password = settings.admin_password.get_secret_value() if settings.admin_password else None
    if not password and not insecure:
        raise AdminConfigError(
            "ADMIN_PASSWORD is not set: set ADMIN_PASSWORD (and optionally ADMIN_USERNAME, "
            "default 'admin'), or run `proj admin --insecure-local` on 127.0.0.1 only"
        )
    auth = AdminAuth(settings.admin_username, None if insecure and not password else password)
    if secret is None:
        secret = settings.admin_secret.get_secret_value() if settings.admin_secret else None
    # A random secret is safe, it only logs everyone out (new CSRF token) on restart.
    secret = secret or secrets.token_urlsafe(32)

    import proj.celery  # noqa: F401  - registers kinds (versions page, compensation, timeline hooks)
    from proj.engine.celery_engine import CeleryTaskEngine

    engine = CeleryTaskEngine()
    templates = make_templates()
    app = FastAPI(
        title="proj",
        summary="Requests, approvals and qBittorrent's on-finish hook of the media acquisition service",
        version="1",
        docs_url=None,
        redoc_url=None,
        openapi_url="/api/openapi.json",
    )
    app.add_middleware(
        SessionMiddleware,
        secret_key=secret,
        session_cookie="proj_admin",
        max_age=12 * 3600,
        same_site="strict",
        https_only=False,
    )
    # Outermost first: security headers and the body size (by Content-Length, no body read;
    # else counted as it arrives), then the admin's Basic auth and the API's bearer token, then
    # the admin's session.
    app.add_middleware(BearerGate, api_token=settings.api_token, hook_token=settings.hook_token)
    app.add_middleware(AdminGate, auth=auth)
    app.add_middleware(SecurityHeaders, max_upload=settings.max_torrent_bytes)
    app.state.auth = auth

    @app.exception_handler(StarletteHTTPException)
    async def http_refusal(request: Request, exc: StarletteHTTPException) -> Response:
        """`{detail, error}` like every other API refusal (the schema's `ApiError`)."""
        if not is_body_allowed_for_status_code(exc.status_code):
            return Response(status_code=exc.status_code, headers=exc.headers)
        error = getattr(exc, "error", None) or HTTPStatus(exc.status_code).phrase.replace(" ", "")
        body = {"detail": exc.detail, "error": error}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's 422, with the echoed input made encodable: a lone surrogate in a JSON
        body ('\\ud800') made rendering the default answer fail, a 500."""
        body = {"detail": printable(jsonable_encoder(exc.errors())), "error": "RequestValidationError"}
        return JSONResponse(body, status_code=422)

    app.include_router(api_router(settings, engine))
    source = Source(settings)
    app.include_router(metrics_router(settings, source))

    def require_auth(request: Request) -> None:
        if not auth.check(request.headers.get("authorization")):
            raise HTTPException(401, "authentication required", headers={"WWW-Authenticate": REALM})

    async def require_csrf(request: Request) -> None:
        """A POST must carry the session's token: a cross-site form cannot read it."""
        form = await request.form()
        sent = form.get(CSRF_FIELD)
        expected = request.session.get("csrf")
        # As bytes: `compare_digest` raises TypeError on a non-ASCII str (was a 500).
        if (
            not expected
            or not isinstance(sent, str)
            or not secrets.compare_digest(sent.encode(), expected.encode())
        ):
            raise HTTPException(403, "CSRF token missing or invalid: reload the page and try again")

    def csrf_token(request: Request) -> str:
        token = request.session.get("csrf")
        if not token:
            token = secrets.token_urlsafe(32)
            request.session["csrf"] = token
        return token

    def flash(request: Request, message: str, level: str = "ok") -> None:
        request.session.setdefault("flash", []).append([level, message])
        request.session["flash"] = request.session["flash"][-5:]

    def render(request: Request, name: str, status_code: int = 200, **ctx: Any) -> Response:
        base = {
            "csrf": csrf_token(request),
            "csrf_field": CSRF_FIELD,
            "flashes": request.session.pop("flash", []),
            "user": auth.username if auth.password else None,
            "nav": name.removesuffix(".html"),
        }
        return templates.TemplateResponse(request, name, {**base, **ctx}, status_code=status_code)

    def run_id_or_404(value: str) -> uuid.UUID:
        rid = queries.parse_uuid(value)
        if rid is None:
            raise HTTPException(404, f"no run {value}")
        return rid

    def existing_run_or_404(value: str) -> uuid.UUID:
        """For decisions: a well-formed id that names no run is a 404, not a silent no-op."""

        rid = run_id_or_404(value)
        with db.transaction() as s:
            if not views.run_exists(s, rid):
                raise HTTPException(404, f"no run {value}")
        return rid

    def reason_or_400(reason: str | None) -> str:
        from proj.engine.runs import unstorable

        reason = (reason or "operator").strip()[:500] or "operator"
        if unstorable(reason):
            raise HTTPException(400, "the reason must not contain NUL characters")
        return reason

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/admin", status_code=307)

    @app.get("/admin/healthz", include_in_schema=False)
    def healthz() -> PlainTextResponse:
        """Liveness without credentials: says nothing but "ok"."""
        return PlainTextResponse("ok")

    @app.get("/admin/static/admin.js", include_in_schema=False)
    def admin_js() -> FileResponse:
        """The admin's one script (no credentials needed: it holds no data)."""
        return FileResponse(STATIC / "admin.js", media_type="text/javascript")

    r = APIRouter(prefix="/admin", dependencies=[Depends(require_auth)], include_in_schema=False)

    def who(request: Request) -> str:
        """The operator, as the timeline names them."""
        return auth.username if auth.password else "local operator"

    def task_or_404(value: str) -> uuid.UUID:
        tid = queries.parse_uuid(value)
        if tid is None:
            raise HTTPException(404, f"no request {value}")
        return tid

    @r.get("", response_class=HTMLResponse)
    def requests_page(request: Request, status: str = "", requester: str = "", after: str = "") -> Response:
        try:
            mark = queries.parse_uuid(after) if after else None
            if after and mark is None:
                raise BadInput(f"no request {after!r} to page on from")
            with db.transaction() as s:
                rows, following = service.requests_page(
                    s, status=status or None, requester=requester or None, after=mark
                )
                counts = service.status_counts(s)
        except BadInput as exc:
            flash(request, str(exc), "error")
            return RedirectResponse("/admin", status_code=303)
        return render(
            request,
            "requests.html",
            rows=rows,
            following=following,
            counts=counts,
            statuses=list(service.RequestStatus),
            f={"status": status, "requester": requester, "after": after},
            max_bytes=settings.max_torrent_bytes,
        )

    @r.post("/requests", dependencies=[Depends(require_csrf)])
    async def upload_request(
        request: Request,
        torrent: UploadFile = File(...),
        requester: str = Form(...),
        title: str = Form(""),
        webhook_url: str = Form(""),
    ) -> Response:
        data = await torrent.read(settings.max_torrent_bytes + 1)
        try:
            sub = service.submit_request(
                db.sessions(),
                requester=requester.strip(),
                torrent=data,
                title=title.strip() or None,
                webhook_url=webhook_url.strip() or None,
            )
        except BadInput as exc:
            flash(request, f"request refused: {exc}", "error")
            return RedirectResponse("/admin", status_code=303)
        flash(request, f"requested {sub.id}: approve it to start the download")
        return RedirectResponse(f"/admin/requests/{sub.id}", status_code=303)

    @r.get("/requests/{task_id}", response_class=HTMLResponse)
    def request_page(request: Request, task_id: str) -> Response:
        tid = task_or_404(task_id)
        try:
            with db.transaction() as s:
                d = service.request_detail(s, tid)
        except service.UnknownTask:
            return render(request, "missing.html", status_code=404, what=f"request {task_id}")
        return render(request, "request.html", d=d, row=d.row)

    def decided(request: Request, tid: uuid.UUID, act: Any, done: str) -> RedirectResponse:
        try:
            act()
        except service.UnknownTask as exc:
            raise HTTPException(404, str(exc)) from exc
        except (service.RequestConflict, BadInput) as exc:
            flash(request, str(exc), "error")
        else:
            flash(request, done)
        return RedirectResponse(f"/admin/requests/{tid}", status_code=303)

    @r.post("/requests/{task_id}/approve", dependencies=[Depends(require_csrf)])
    def approve_request(request: Request, task_id: str) -> RedirectResponse:
        tid = task_or_404(task_id)
        by = who(request)
        act = lambda: service.approve_and_signal(engine, db.sessions(), tid, by)  # noqa: E731
        return decided(request, tid, act, f"approved by {by}: the download starts")

    @r.post("/requests/{task_id}/reject", dependencies=[Depends(require_csrf)])
    def reject_request(request: Request, task_id: str, reason: str = Form("")) -> RedirectResponse:
        tid = task_or_404(task_id)
        by = who(request)
        act = lambda: service.reject_and_stop(engine, db.sessions(), tid, by, reason)  # noqa: E731
        return decided(request, tid, act, f"rejected by {by}")

    @r.post("/requests/{task_id}/cancel", dependencies=[Depends(require_csrf)])
    def cancel_request(request: Request, task_id: str, reason: str = Form("")) -> RedirectResponse:
        tid = task_or_404(task_id)
        by = who(request)
        why = reason.strip() or "canceled by an operator"
        act = lambda: service.cancel_download(engine, db.sessions(), tid, why, by=by)  # noqa: E731
        return decided(request, tid, act, f"cancel requested by {by}: compensation follows")

    @r.get("/overview", response_class=HTMLResponse)
    def overview_page(request: Request) -> Response:
        """Charts of the numbers `/metrics` serves (`tests/integration/test_overview_browser.py`)."""
        try:
            snap = source.snapshot(overview=True)
        except MetricsUnavailable as exc:
            return render(request, "unavailable.html", status_code=503, reason=str(exc))
        return render(request, "overview.html", o=overview.build(snap))

    @r.get("/runs", response_class=HTMLResponse)
    def runs_page(
        request: Request, kind: str = "", version: str = "", status: str = "", q: str = "", page: int = 0
    ) -> Response:
        f = queries.RunFilter(kind=kind, version=version, status=status, q=q, page=max(0, page))
        with db.transaction() as s:
            rows, more = queries.list_runs(s, f)
            facets = queries.facets(s)
            counts = queries.status_counts(s)
        return render(request, "runs.html", rows=rows, more=more, f=f, facets=facets, counts=counts)

    @r.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(request: Request, run_id: str) -> Response:
        rid = run_id_or_404(run_id)
        with db.transaction() as s:
            detail = queries.run_detail(s, rid)
        if detail is None:
            return render(request, "missing.html", status_code=404, what=f"run {run_id}")
        return render(request, "run.html", d=detail, run=detail.run)

    @r.get("/runs/{run_id}/progress.json")
    def run_progress(run_id: str) -> JSONResponse:
        rid = run_id_or_404(run_id)
        with db.transaction() as s:
            data = queries.progress_json(s, rid)
        if data is None:
            raise HTTPException(404, f"no run {run_id}")
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    @r.post("/runs/{run_id}/retry", dependencies=[Depends(require_csrf)])
    def retry(request: Request, run_id: str) -> RedirectResponse:
        from proj.engine import runs

        rid = existing_run_or_404(run_id)
        n = runs.retry_failed(rid)
        if n:
            flash(request, f"retrying {n} failed step(s) of {rid}")
        else:
            flash(request, f"{rid} is not a failed run: nothing to retry", "warn")
        return RedirectResponse(f"/admin/runs/{rid}", status_code=303)

    @r.post("/runs/{run_id}/abandon", dependencies=[Depends(require_csrf)])
    def abandon(request: Request, run_id: str, reason: str = Form("operator")) -> RedirectResponse:
        from proj.engine import runs

        rid = existing_run_or_404(run_id)
        if runs.abandon(rid, reason_or_400(reason)):
            flash(request, f"abandoned {rid}: compensation queued if the kind has one")
        else:
            flash(request, f"{rid} is not a failed run: nothing abandoned", "warn")
        return RedirectResponse(f"/admin/runs/{rid}", status_code=303)

    @r.post("/runs/{run_id}/cancel", dependencies=[Depends(require_csrf)])
    def cancel(request: Request, run_id: str, reason: str = Form("operator")) -> RedirectResponse:
        from proj.engine import runs

        rid = run_id_or_404(run_id)
        try:
            asked = runs.cancel(rid, reason_or_400(reason))
        except KeyError as exc:
            raise HTTPException(404, f"no run {run_id}") from exc
        if asked.landed:
            flash(request, f"cancel requested for {rid}")
        else:  # finished before the request landed (a stale page): say so, as `proj cancel` does
            hint = ": abandon it to compensate" if asked.status == "failed" else ""
            flash(request, f"{rid} had finished ({asked.status}): nothing to cancel{hint}", "warn")
        return RedirectResponse(f"/admin/runs/{rid}", status_code=303)

    @r.post("/signal", dependencies=[Depends(require_csrf)])
    def send_signal(request: Request, topic: str = Form(...)) -> RedirectResponse:
        from proj.engine import runs
        from proj.engine.errors import BadTopic

        try:
            woken = runs.signal(topic.strip())
        except BadTopic as exc:
            flash(request, str(exc), "error")
        else:
            flash(request, f"signal {topic}: {woken} run(s) woken")
        return RedirectResponse("/admin/parked", status_code=303)

    @r.get("/dead", response_class=HTMLResponse)
    def dead_page(request: Request) -> Response:
        with db.transaction() as s:
            letters = queries.dead_letters(s)
        return render(request, "dead.html", letters=letters)

    @r.get("/versions", response_class=HTMLResponse)
    def versions_page(request: Request) -> Response:
        with db.transaction() as s:
            matrix = queries.version_matrix(s)
        return render(request, "versions.html", matrix=matrix, statuses=queries.RUN_STATUSES)

    @r.get("/outbox", response_class=HTMLResponse)
    def outbox_page(request: Request) -> Response:
        with db.transaction() as s:
            box = queries.outbox_summary(s)
        return render(request, "outbox.html", box=box)

    @r.get("/parked", response_class=HTMLResponse)
    def parked_page(request: Request) -> Response:
        with db.transaction() as s:
            rows, topics = queries.parked_runs(s)
        return render(request, "parked.html", rows=rows, topics=topics)

    app.include_router(r)
    return app
