"""The JSON API under `/api`: requests, decisions, and qBittorrent's on-finish hook.

It calls the same business functions as the CLI and the /admin pages
(`proj.acquisition.service`), so a decision is the same row and the same timeline event
whichever door it came through.

Auth: bearer tokens from the environment, separate from the admin's Basic auth. `API_TOKEN`
opens the request endpoints, `HOOK_TOKEN` opens the hook only. A missing or wrong token is a
401 JSON answer, checked before the body is read (`BearerGate`), so nothing is written
(`tests/integration/test_front_door.py::test_api_auth_missing_or_wrong_token_is_401_json_and_writes_nothing`).
An unset token disables its endpoints (401 that says so).
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any

from fastapi import (
    APIRouter,
    Depends,
    File,
    Form,
    Header,
    HTTPException,
    Query,
    Request,
    Security,
    UploadFile,
)
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, SecretStr
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from proj import db
from proj.acquisition import service, torrents
from proj.admin.bearer import bearer_matches
from proj.engine.errors import BadInput, BadTopic
from proj.engine.port import TaskEngine
from proj.settings import Settings

API_PREFIX = "/api/"
HOOKS_PREFIX = "/api/hooks/"
OPENAPI_PATH = "/api/openapi.json"
INFOHASH = re.compile(r"^(?:[0-9a-fA-F]{40}|[0-9a-fA-F]{64})$")
# Multipart framing and the small text fields on top of the torrent itself.
FORM_OVERHEAD = 64 * 1024


class ApiError(BaseModel):
    detail: str
    error: str = Field(description="the error's type, e.g. BadTorrent, RequestConflict")


class RequestOut(BaseModel):
    id: uuid.UUID
    title: str
    requester: str
    status: service.RequestStatus
    progress: float = Field(description="download progress in %")
    total_size: int
    files: int
    created_at: str
    updated_at: str


class FileOut(BaseModel):
    path: str
    size: int
    library: dict[str, Any] | None = Field(description="the library copy, once imported")


class EventOut(BaseModel):
    at: str
    what: str
    detail: dict[str, Any]


class RunOut(BaseModel):
    id: uuid.UUID
    kind: str
    version: int
    status: str


class RequestDetailOut(BaseModel):
    id: uuid.UUID
    title: str
    requester: str
    status: service.RequestStatus
    progress: float
    total_size: int
    created_at: str
    updated_at: str
    infohash: str
    webhook_url: str | None
    approved_by: str | None
    files: list[FileOut]
    timeline: list[EventOut]
    runs: list[RunOut]


class RequestList(BaseModel):
    requests: list[RequestOut]
    next: uuid.UUID | None = Field(
        default=None,
        description="more requests follow: pass this as `after` for the next page (null: none)",
    )


class Decision(BaseModel):
    by: str = Field(default="api", max_length=200, description="who decided (on the timeline)")
    reason: str | None = Field(default=None, max_length=500)


class Rejection(BaseModel):
    """A reject's body: unlike approve and cancel, its reason is required (the requester is
    told why)."""

    by: str = Field(default="api", max_length=200, description="who decided (on the timeline)")
    reason: str = Field(min_length=1, max_length=500, description="why (shown to the requester)")


class DecisionOut(BaseModel):
    id: uuid.UUID
    status: service.RequestStatus
    runs_stopped: int = 0


class HookOut(BaseModel):
    topic: str
    woken: int


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ApiError, "description": "bad input; nothing written"},
    401: {"model": ApiError, "description": "missing or wrong bearer token"},
    404: {"model": ApiError, "description": "no such request"},
    409: {"model": ApiError, "description": "conflicts with the request's state or key"},
    413: {"model": ApiError, "description": "a body over 64 KiB"},
}


def answers(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error answers one route can give (401 is on every route), for its schema."""
    return {c: ERRORS[c] for c in (401, *codes)}


class ApiRefusal(HTTPException):
    """An HTTPException answered as `ApiError` (`detail` and `error`) by the app's handler."""

    def __init__(self, status: int, detail: str, error: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(status, detail, headers)
        self.error = error


def error(status: int, exc: BaseException | str, kind: str | None = None) -> JSONResponse:
    detail = str(exc)
    name = kind or (type(exc).__name__ if isinstance(exc, BaseException) else "Error")
    return JSONResponse({"detail": detail, "error": name}, status_code=status)


def token_refusal(token: SecretStr | None, name: str, authorization: str | None) -> str | None:
    """Why a request with this `Authorization` header is refused, or None: it must be exactly
    `Bearer <token>` (compared in constant time), and an unset token refuses everything."""
    expected = token.get_secret_value() if token else ""
    if not expected:
        return f"{name} is not set on the server: this endpoint is disabled"
    if not bearer_matches(authorization, expected):
        return f"missing or wrong bearer token ({name})"
    return None


def bearer_check(token: SecretStr | None, name: str) -> Any:
    """The route's dependency: the same check as `BearerGate`, and the schema's security (an
    HTTP bearer scheme named after the token; a plain `Authorization` header parameter is
    ignored by OpenAPI tools, so generated clients would never send it)."""
    scheme = HTTPBearer(scheme_name=name, description=f"`Authorization: Bearer <{name}>`", auto_error=False)

    def check(request: Request, _: HTTPAuthorizationCredentials | None = Security(scheme)) -> None:
        why = token_refusal(token, name, request.headers.get("authorization"))
        if why is not None:
            raise ApiRefusal(401, why, "Unauthorized", _challenge())

    return check


class BearerGate:
    """Refuses an `/api` request without its bearer token before anything reads the body.

    Why: FastAPI reads and parses a request's body (a multipart upload too) before it runs the
    route's dependencies, so with them alone an anonymous client could make the server parse
    its upload, and a malformed body got 422 instead of 401. The hook's paths take
    `HOOK_TOKEN`, every other `/api` path `API_TOKEN`; the schema stays open
    (`tests/integration/test_front_door.py::test_api_auth_is_checked_before_the_body_is_read`).
    """

    def __init__(self, app: ASGIApp, api_token: SecretStr | None, hook_token: SecretStr | None) -> None:
        self.app = app
        self.api_token = api_token
        self.hook_token = hook_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(API_PREFIX) and path != OPENAPI_PATH:
            hook = path.startswith(HOOKS_PREFIX)
            token, name = (self.hook_token, "HOOK_TOKEN") if hook else (self.api_token, "API_TOKEN")
            why = token_refusal(token, name, Headers(scope=scope).get("authorization"))
            if why is not None:
                answer = JSONResponse(
                    {"detail": why, "error": "Unauthorized"}, status_code=401, headers=_challenge()
                )
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _challenge() -> dict[str, str]:
    return {"WWW-Authenticate": 'Bearer realm="proj api"'}


def task_id_or_404(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise ApiRefusal(404, f"no request {value}", "UnknownTask") from None


def api_router(settings: Settings, engine: TaskEngine) -> APIRouter:
    """The `/api` routes; `engine` is the port the decisions signal and cancel through."""
    api = APIRouter(prefix="/api")
    need_api = [Depends(bearer_check(settings.api_token, "API_TOKEN"))]
    need_hook = [Depends(bearer_check(settings.hook_token, "HOOK_TOKEN"))]
    max_bytes = settings.max_torrent_bytes

    @api.post(
        "/requests",
        status_code=201,
        response_model=RequestOut,
        dependencies=need_api,
        responses={
            **answers(400, 409),
            413: {"model": ApiError, "description": "torrent over MAX_TORRENT_BYTES"},
        },
        summary="Request a download (multipart upload of a .torrent)",
    )
    async def create_request(
        request: Request,
        torrent: Annotated[UploadFile, File(description="the .torrent file")],
        requester: Annotated[str, Form(max_length=200)],
        title: Annotated[str | None, Form(max_length=500)] = None,
        webhook_url: Annotated[str | None, Form(max_length=2000)] = None,
        idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    ) -> Any:
        data = await torrent.read(max_bytes + 1)
        if len(data) > max_bytes:
            return error(413, f"the torrent is over MAX_TORRENT_BYTES ({max_bytes} bytes)", "TorrentTooLarge")
        try:
            sub = service.submit_request(
                db.sessions(),
                requester=requester,
                torrent=data,
                title=title or None,
                webhook_url=webhook_url or None,
                client_key=idempotency_key,
            )
        except torrents.TorrentTooLarge as exc:
            return error(413, exc)
        except service.RequestConflict as exc:
            return error(409, exc)
        except BadInput as exc:
            return error(400, exc)
        with db.transaction() as s:
            row = service.request_detail(s, sub.id).row
        headers = {"Location": f"/api/requests/{sub.id}"}
        if sub.replayed:
            headers["Idempotent-Replayed"] = "true"
        return JSONResponse(row.as_json(), status_code=201, headers=headers)

    @api.get(
        "/requests",
        response_model=RequestList,
        dependencies=need_api,
        responses=answers(400),
        summary="List requests",
    )
    def list_requests(
        status: Annotated[str | None, Query(description="one status")] = None,
        requester: str | None = None,
        limit: Annotated[int, Query(ge=1, le=service.LIST_LIMIT)] = 100,
        after: Annotated[
            uuid.UUID | None, Query(description="the `next` of the previous page: go on from there")
        ] = None,
    ) -> Any:
        try:
            with db.transaction() as s:
                rows, following = service.requests_page(
                    s, status=status, requester=requester, limit=limit, after=after
                )
        except BadInput as exc:
            return error(400, exc)
        return {"requests": [r.as_json() for r in rows], "next": following}

    @api.get(
        "/requests/{task_id}",
        response_model=RequestDetailOut,
        dependencies=need_api,
        responses=answers(404),
        summary="One request: status, progress, files, timeline",
    )
    def get_request(task_id: str) -> Any:
        tid = task_id_or_404(task_id)
        try:
            with db.transaction() as s:
                return service.request_detail(s, tid).as_json()
        except service.UnknownTask as exc:
            return error(404, exc)

    @api.post(
        "/requests/{task_id}/approve",
        response_model=DecisionOut,
        dependencies=need_api,
        responses=answers(400, 404, 409, 413),
    )
    def approve(task_id: str, body: Decision | None = None) -> Any:
        tid = task_id_or_404(task_id)
        by = (body or Decision()).by

        def act() -> int:
            service.approve_and_signal(engine, db.sessions(), tid, by)
            return 0

        return decide(tid, act)

    @api.post(
        "/requests/{task_id}/reject",
        response_model=DecisionOut,
        dependencies=need_api,
        responses=answers(400, 404, 409, 413),
    )
    def reject(task_id: str, body: Rejection) -> Any:
        tid = task_id_or_404(task_id)
        return decide(tid, lambda: service.reject_and_stop(engine, db.sessions(), tid, body.by, body.reason))

    @api.post(
        "/requests/{task_id}/cancel",
        response_model=DecisionOut,
        dependencies=need_api,
        responses=answers(400, 404, 409, 413),
    )
    def cancel(task_id: str, body: Decision | None = None) -> Any:
        tid = task_id_or_404(task_id)
        d = body or Decision()
        # Only a missing reason takes the default: an empty one is bad input (400), as for `by`
        # (`tests/integration/test_operator_review.py::test_an_api_cancel_with_an_empty_reason_is_refused`).
        reason = "canceled through the API" if d.reason is None else d.reason
        return decide(tid, lambda: service.cancel_download(engine, db.sessions(), tid, reason, by=d.by))

    def decide(tid: uuid.UUID, act: Any) -> Any:
        try:
            stopped = act()
        except service.UnknownTask as exc:
            return error(404, exc)
        except service.RequestConflict as exc:
            return error(409, exc)
        except BadInput as exc:
            return error(400, exc)
        with db.transaction() as s:
            status = service.load(s, tid).status
        return {"id": str(tid), "status": status, "runs_stopped": stopped}

    @api.post(
        "/hooks/qbittorrent",
        response_model=HookOut,
        dependencies=need_hook,
        responses=answers(400),
        summary="qBittorrent's on-finish hook (Run external program: curl … ?hash=%K)",
    )
    def qbittorrent_finished(
        hash: Annotated[  # noqa: A002
            str, Query(description="the torrent's id (%K); a v2 infohash (%J) is cut to it")
        ],
    ) -> Any:
        if not INFOHASH.match(hash):
            return error(400, "hash must be a 40- or 64-hex-digit infohash", "BadInput")
        # qBittorrent names a hybrid torrent by its v2 infohash cut to 40 digits (`torrents.torrent_id`).
        topic = service.download_topic(hash.lower()[:40])
        try:
            woken = engine.signal(topic, {"source": "qbittorrent hook"})
        except BadTopic as exc:
            return error(400, exc)
        return {"topic": topic, "woken": woken}

    return api


def too_large(request: Request, limit: int) -> bool:
    """A body announced larger than a torrent plus its form is refused before it is read."""
    length = request.headers.get("content-length")
    return length is not None and length.isdigit() and int(length) > limit + FORM_OVERHEAD
