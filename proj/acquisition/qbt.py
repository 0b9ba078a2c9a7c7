"""The managed qBittorrent, through qbittorrent-api. Every torrent we add carries MANAGED_TAG."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
import time
from typing import Any

import qbittorrentapi
from sqlalchemy import text
from sqlalchemy.orm import Session

from proj import db
from proj.engine.errors import NonRetryable, Unavailable
from proj.engine.kind import RetryPolicy
from proj.settings import get_settings

MANAGED_TAG = "proj-managed"
_local = threading.local()


# The steps that change qBittorrent (add, remove). qBittorrent restarts for an upgrade (a container
# re-pulled, a NAS update) take a minute or more; the network policy's five attempts spent about
# 15 s, so a request approved meanwhile, or a cancel's removal, became a dead letter. These ten
# wait 2 s, 4 s, … up to 2 min apart, about 8 min in all
# (`tests/integration/test_qbt_review.py::test_qbittorrent_steps_outlast_a_restart_of_several_minutes`).
# A refused login, a QBT_URL that is not qBittorrent or unset fail at once, whatever the policy.
#
# qBittorrent not answering at all (`unreachable`) is an outage (`Down`): those attempts are not
# spent for up to a day (`outage_s`), tried every 2 min once the backoff is at its cap, so a
# qBittorrent down overnight leaves requests waiting, not dead letters
# (`tests/integration/test_outages.py`). Past a day they count again.
QBT_RETRY = RetryPolicy(max_attempts=10, initial_s=2.0, max_s=120.0, outage_s=24 * 3600.0)


class Down(Unavailable):
    """qBittorrent did not answer (refused, timed out, a 5xx): an outage, not the step's error."""


class NotConfigured(NonRetryable):
    """QBT_URL is unset: no retry can reach qBittorrent until the workers are given it."""


class LoginRefused(NonRetryable):
    """qBittorrent refused our login: retrying the same credentials cannot succeed."""


# The memo of refused credentials, shared by every worker process: an `acq.flag` row of kind
# `qbt_login_refused` whose subject is a digest of (URL, username, password), never the password.
# `RECENT_REFUSAL` finds it while it is younger than `:window` seconds; `RECORD_REFUSAL` writes
# it (again); `FORGET_REFUSAL` drops the credentials' own once they logged in (a window that
# ended, or was shortened). Only their own: a success of the right password forgot the refusal of
# a worker still given the old one, which then tried again at each step until its host was banned
# (`tests/integration/test_qbt_review.py::test_a_login_that_succeeds_keeps_the_refusal_of_other_credentials`).
RECENT_REFUSAL = text(
    """
    SELECT at, detail->>'message' AS message FROM acq.flag
     WHERE kind = 'qbt_login_refused' AND subject = :subject
       AND at > now() - make_interval(secs => :window)
    """
)
RECORD_REFUSAL = text(
    """
    INSERT INTO acq.flag (kind, subject, detail, at)
    VALUES ('qbt_login_refused', :subject, CAST(:detail AS jsonb), now())
    ON CONFLICT (kind, subject) DO UPDATE SET detail = excluded.detail, at = excluded.at
    """
)
FORGET_REFUSAL = text(
    """
    DELETE FROM acq.flag WHERE kind = 'qbt_login_refused' AND subject = :subject
    """
)
# `proj qbt-login-retry`: every refusal, for an operator who fixed qBittorrent's side.
FORGET_ALL_REFUSALS = text(
    """
    DELETE FROM acq.flag WHERE kind = 'qbt_login_refused'
    """
)
# Held from the memo's check to the refusal's record: clients logging in together (a worker
# restart picking up several requests and the reconcile at once) each found no refusal and each
# tried, up to qBittorrent's ban threshold; now they take turns per URL and the later ones find
# the first one's refusal (`tests/integration/test_qbt_review.py::
# test_clients_logging_in_at_once_with_refused_credentials_make_one_failed_login`).
# Every qBittorrent call is bounded: 5 s to connect, 30 s to answer.
REQUEST_TIMEOUT = (5, 30)

# A transaction held open around qBittorrent calls (the login lock here, an infohash's in
# `kinds.common.torrent_decision`) sits idle between two statements for as long as those calls
# take: a few of at most 35 s each, and a listing wait of 15 s. Its idle time is bounded all the
# same (`idle_in_transaction_session_timeout`, local to the transaction), well above that: a
# process frozen holding the lock (SIGSTOP, a paused VM) gives it up after five minutes, not
# never (`tests/integration/test_idle_bounds.py::test_qbittorrent_locks_bound_their_transaction`).
QBT_LOCK_IDLE_MS = 300_000

LOCK_LOGIN = text(
    "SELECT pg_advisory_xact_lock(hashtextextended('qbt-login:' || :url, 0)),"
    " set_config('idle_in_transaction_session_timeout', CAST(:idle_ms AS text), true)"
)


# scrypt's cost (RFC 7914's interactive parameters: 16 MiB and about 50 ms a digest here).
MEMO_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "dklen": 32}


@functools.lru_cache(maxsize=16)
def credentials_digest(url: str, username: str, password: str) -> str:
    """What names a set of credentials in the memo, so the password is never stored.

    A slow, salted digest (scrypt, salted by the URL and user): it must be the same in every
    process, yet a reader of `acq.flag` must not recover the password from it. A plain sha256
    of the three (before) is tried at billions of guesses a second on one GPU; scrypt costs each
    guess 16 MiB and some 50 ms. Computed once per process per set of credentials (cached).
    Test: `tests/unit/test_qbt_memo_digest.py`."""
    salt = hashlib.sha256("\0".join(("proj qbt login memo", url, username)).encode()).digest()
    return hashlib.scrypt(password.encode(), salt=salt, **MEMO_SCRYPT).hex()


class _Client(qbittorrentapi.Client):  # type: ignore[misc]
    """qbittorrent-api's client, whose (re-)login fails the step at once and says why.

    Why: qbittorrent-api's `LoginFailed` carries no message, so a wrong QBT_PASSWORD left a dead
    letter with an empty error; and the step retried it (the network policy: five attempts),
    five failed logins being qBittorrent's default ban threshold, so the worker's IP was banned
    for an hour and the corrected password refused too
    (`tests/integration/test_qbt_review.py::
    test_wrong_qbittorrent_credentials_fail_once_and_clearly_without_getting_the_host_banned`).

    A refusal is remembered in Postgres for `QBT_LOGIN_RETRY_S` (900 s): each step failing once
    was still one failed login per request, per periodic reconcile and per worker thread, and
    five requests approved together got the host banned. Within that window no process tries
    the same credentials again; changed ones are tried at once (`tests/integration/
    test_qbt_review.py::test_credentials_qbittorrent_refused_are_not_tried_again_by_any_worker`).
    Logins to one URL take turns (`LOCK_LOGIN`), so clients starting together make one failed
    login, not one each.
    """

    def auth_log_in(self, username: str | None = None, password: str | None = None, **kwargs: Any) -> None:
        if username:
            self.username, self._password = username, password or ""
        subject = credentials_digest(self.host, self.username, self._password)
        window = get_settings().qbt_login_retry_s
        with db.transaction() as s:
            s.execute(LOCK_LOGIN, {"url": self.host, "idle_ms": QBT_LOCK_IDLE_MS})
            refused = s.execute(RECENT_REFUSAL, {"subject": subject, "window": window}).first()
            failed = None if refused is not None else self._log_in_recorded(s, subject, kwargs)
        if refused is not None:
            raise LoginRefused(
                f"{refused.message} Not tried again before {window:.0f}s after {refused.at.isoformat()}, so "
                "that qBittorrent does not ban this host; changed credentials are tried at once, and "
                "`proj qbt-login-retry` ends the wait once qBittorrent's side is fixed"
            )
        if failed is not None:
            raise LoginRefused(login_refusal(self.host, self.username, failed)) from failed

    def _log_in_recorded(self, s: Session, subject: str, kwargs: dict[str, Any]) -> BaseException | None:
        """Log in, recording a refusal or forgetting these credentials' own in `s` (the login lock's
        transaction, committed even when the login was refused); the refusal, or None."""
        try:
            super().auth_log_in(**kwargs)
        except (qbittorrentapi.LoginFailed, qbittorrentapi.HTTP403Error) as exc:
            message = login_refusal(self.host, self.username, exc)
            detail = json.dumps({"url": self.host, "username": self.username, "message": message})
            s.execute(RECORD_REFUSAL, {"subject": subject, "detail": detail})
            return exc
        s.execute(FORGET_REFUSAL, {"subject": subject})
        return None


def forget_login_refusals() -> int:
    """Forget every refused login, so each worker tries its credentials at its next step; how
    many were forgotten. Why: the memo waits `QBT_LOGIN_RETRY_S` (900 s) even when the operator
    fixed the password on qBittorrent's side, which no worker can see
    (`tests/integration/test_qbt_review.py::test_qbt_login_retry_ends_the_wait_once_qbittorrent_takes_the_password`)."""
    with db.transaction() as s:
        return int(s.execute(FORGET_ALL_REFUSALS).rowcount or 0)


def login_refusal(url: str, username: str, exc: BaseException) -> str:
    """What to tell the operator about a refused login (never the password)."""
    why = str(exc).strip() or "wrong username or password"
    return (
        f"qBittorrent at {url} refused the login of QBT_USERNAME {username!r}: {why}. "
        "Check QBT_USERNAME and QBT_PASSWORD against its Web UI settings; after too many failed "
        "logins qBittorrent bans this host for a while (Web UI: ban duration)"
    )


def client() -> qbittorrentapi.Client:
    """A logged-in client per thread (qbittorrent-api sessions are not thread-safe)."""
    c = getattr(_local, "client", None)
    if c is None:
        s = get_settings()
        if not s.qbt_url:
            raise NotConfigured("QBT_URL is not set: point it at the managed qBittorrent Web UI")
        c = _Client(
            host=s.qbt_url,
            username=s.qbt_username or "",
            password=s.qbt_password.get_secret_value() if s.qbt_password else "",
            REQUESTS_ARGS={"timeout": REQUEST_TIMEOUT},
            VERIFY_WEBUI_CERTIFICATE=False,
            RAISE_NOTIMPLEMENTEDERROR_FOR_UNIMPLEMENTED_API_ENDPOINTS=False,
        )
        check_is_qbittorrent(c, s.qbt_url)
        _local.client = c  # only once it answered as qBittorrent: a fixed QBT_URL is tried afresh
    return c


class NotQbittorrent(NonRetryable):
    """QBT_URL answers, but not as qBittorrent's Web API: retrying cannot change that."""


API_VERSION = re.compile(r"\d+(\.\d+)+")


def check_is_qbittorrent(c: qbittorrentapi.Client, url: str) -> None:
    """Ask the Web API its version (logging in if it wants); anything but a version is refused.

    Why: a QBT_URL naming another web page (a wrong port, a proxy's or NAS's login page) failed
    the add five times with "Exception during response parsing. Error: JSONDecodeError", which
    does not say that QBT_URL is wrong (`tests/integration/test_qbt_review.py::
    test_a_qbt_url_that_is_not_qbittorrent_fails_at_once_saying_so`). Unreachable or a refused
    login raise as they are (`unreachable`, `LoginRefused`).
    """
    try:
        answer = c.app_web_api_version()
    except qbittorrentapi.APIConnectionError:
        raise
    except (qbittorrentapi.APIError, ValueError) as exc:
        answer = str(exc)
    if not API_VERSION.fullmatch(str(answer).strip()):
        got = " ".join(str(answer).split())[:120]
        raise NotQbittorrent(
            f"QBT_URL {url} does not answer as qBittorrent's Web API (asked for its version, got "
            f"{got!r}): point QBT_URL at qBittorrent's Web UI"
        )


def unreachable(exc: BaseException) -> bool:
    """qBittorrent did not answer: refused, timed out, reset, or a 5xx (down, restarting, busy).

    Not a refused login (`LoginFailed`) nor another 4xx: those are answers, and waiting does not
    change them. Why: a download wait must outlive a qBittorrent restart
    (`tests/integration/test_qbt_review.py::test_a_download_survives_qbittorrent_being_down_while_its_wait_rechecks`).
    """
    return isinstance(exc, qbittorrentapi.APIConnectionError) and not isinstance(
        exc, qbittorrentapi.LoginFailed | qbittorrentapi.HTTP4XXError
    )


def find(infohash: str) -> Any | None:
    """The torrent with this infohash, or None."""
    found = client().torrents_info(torrent_hashes=infohash)
    return found[0] if found else None


def wait_listed(infohash: str, timeout: float = 15.0) -> Any:
    """qBittorrent answers "Ok." before the torrent is listed; wait until it is."""
    return _wait_listing(infohash, True, timeout, f"qBittorrent did not list {infohash} after adding it")


def wait_unlisted(infohash: str, timeout: float = 15.0) -> None:
    """After a delete: wait until qBittorrent no longer lists the torrent."""
    _wait_listing(infohash, False, timeout, f"qBittorrent still lists {infohash} after deleting it")


def _wait_listing(infohash: str, listed: bool, timeout: float, failure: str) -> Any:
    """Poll until the torrent is listed (`listed`) or not; the torrent, or None."""
    deadline = time.monotonic() + timeout
    while ((t := find(infohash)) is not None) != listed:
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.1)
    return t


COMPLETE_STATES = {"uploading", "stalledUP", "pausedUP", "stoppedUP", "queuedUP", "forcedUP", "checkingUP"}


def is_managed(t: Any) -> bool:
    """The torrent carries our tag (qBittorrent lists tags as `a, b`)."""
    return MANAGED_TAG in [tag.strip() for tag in str(t.tags or "").split(",")]


def is_complete(t: Any) -> bool:
    return float(t.progress) >= 1.0 and t.state in COMPLETE_STATES
