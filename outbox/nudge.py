"""The post-commit nudge: dispatch right after a commit that added events, not at the next beat.

`add` arms the caller's session; its `after_commit` event pokes a per-process background thread,
which calls the configured `send` (e.g. "publish one `outbox.dispatch` message"). Pokes that
arrive while a send is in flight coalesce into one more send. Best effort by design: the caller's
commit never waits for the broker, and a lost nudge only costs latency because beat dispatches
anyway.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

log = logging.getLogger(__name__)

_ARMED = "outbox.nudge.armed"
_LISTENING = "outbox.nudge.listening"


class Nudger:
    """Calls `send` from a daemon thread whenever poked; never raises into the caller."""

    def __init__(self, send: Callable[[], object]) -> None:
        self.send = send
        self._cond = threading.Condition()
        self._start_lock = threading.Lock()
        self._requested = 0
        self._done = 0
        self._thread: threading.Thread | None = None
        self._pid = 0
        self.sent = 0
        self.failed = 0

    def poke(self) -> None:
        self._ensure_thread()
        with self._cond:
            self._requested += 1
            self._cond.notify_all()

    def _ensure_thread(self) -> None:
        if self._pid != os.getpid():
            # A forked child inherits the object but not the thread, and maybe a held lock.
            self._cond = threading.Condition()
            self._start_lock = threading.Lock()
            self._requested = self._done = 0
            self._thread = None
            self._pid = os.getpid()
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="outbox-nudge", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._done >= self._requested:
                    self._cond.wait()
                target = self._requested
            try:
                self.send()
                self.sent += 1
            except Exception as exc:  # beat is the guarantee
                self.failed += 1
                log.info("outbox nudge not sent (beat will dispatch): %s", exc)
            with self._cond:
                self._done = target
                self._cond.notify_all()

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every poke so far was handled (tests, and process exit)."""
        with self._cond:
            if self._pid != os.getpid():
                return True
            return self._cond.wait_for(lambda: self._done >= self._requested, timeout)


_nudger: Nudger | None = None


def set_nudger(send: Callable[[], object] | None) -> Nudger | None:
    """Install `send` as this process' nudge (None disables it); returns the previous one."""
    global _nudger
    previous = _nudger
    _nudger = Nudger(send) if send is not None else None
    return previous


def restore_nudger(previous: Nudger | None) -> None:
    """Put back what `set_nudger` returned (tests)."""
    global _nudger
    _nudger = previous


def current() -> Nudger | None:
    return _nudger


def arm(session: Session) -> None:
    """Nudge once after this session's next outermost commit (a rollback disarms)."""
    if _nudger is None:
        return
    session.info[_ARMED] = True
    if not session.info.get(_LISTENING):
        event.listen(session, "after_commit", _after_commit)
        event.listen(session, "after_soft_rollback", _after_soft_rollback)
        session.info[_LISTENING] = True


def _after_commit(session: Session) -> None:
    if session.info.pop(_ARMED, False) and _nudger is not None:
        _nudger.poke()


def _after_soft_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    if previous_transaction.parent is None:  # the outermost transaction: its events are gone
        session.info.pop(_ARMED, None)


@atexit.register
def _flush_at_exit() -> None:
    if _nudger is not None:
        _nudger.flush(1.0)
