"""Crash-stop detection: a worker process that died gives its steps back within about a second,
whatever the lease (DESIGN.md invariant 2).

Why: a lease is the only safe signal for a worker that is *frozen* or *partitioned* (it may wake
and try to commit), but a process that *died* (kill -9, OOM, a lost prefork child) is known dead
at once, because Postgres ends its sessions when its sockets close. Waiting 15 s for its lease
then is pure loss.

How:
- Each process that claims steps keeps one dedicated connection (`application_name
  'proj-liveness'`) holding a session-level advisory lock on a random key of its own. Its lease
  owner, written by the claim, names that key and the postmaster start time it was taken under:
  `host:pid#<key>@<postmaster start, µs>`.
- Every `REAP_INTERVAL_S` each such process looks, on that connection, for running steps whose
  owner's lock nobody holds on the same postmaster (`store.leases.free_owner_keys`). A key still
  free `REAP_GRACE_S` after it was first seen so has its leases ended
  (`store.leases.end_leases_of_dead_owners`). Then an ordinary `sweep()` recovers them, so
  fencing, retries, the attempt count, slot hand-off and publishing are exactly those of an
  expired lease.
- The grace is for a process that lives but lost its session (an admin's
  `pg_terminate_backend`, a connection reset): it takes the same key again at its next reap
  tick, before the grace ends, and nobody takes its steps over while it still runs them
  (`Suspects`, `tests/integration/test_liveness.py`).
- A frozen (SIGSTOP) or partitioned process keeps its session, so its lock, so its lease: it is
  recovered by lease expiry only, and its late commit is refused by the token fence
  (`tests/faults/test_recovery_fast.py`). A Postgres restart drops every lock but kills no worker: the
  postmaster start in the owner no longer matches, so those steps also fall back to the lease.
- Without a liveness connection (database down at claim time, or `REAP_INTERVAL_S=0`) the owner
  is plain `host:pid` and only the lease applies.
- The same session says which version queues the process consumes (`serve`, shared advisory
  locks): the sweeper re-sends a seemingly lost message only to a queue someone consumes.

Proof: `tests/faults/test_recovery_fast.py` (kill -9 of a worker and of a prefork child with
`LEASE_TTL_S=15`: resumed in about a second, the effect once; SIGSTOP keeps the lease).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable

import psycopg

from proj import db
from proj.engine.store import leases as store
from proj.settings import get_settings, libpq_url

log = logging.getLogger(__name__)

APPLICATION_NAME = "proj-liveness"


def _conninfo() -> str:
    """The libpq form of the liveness URL: `LIVENESS_DATABASE_URL`, else DATABASE_URL.

    A session advisory lock needs a real session: behind a transaction pooler the lock would
    stay on whichever server connection ran the statement (held after this process died, or
    dropped while it lives), so `DB_POOLER=transaction` needs a direct URL here
    (`proj.engine.preflight.check_pooling`, `tests/integration/test_pgbouncer.py`).
    """
    s = get_settings()
    s.require_database_url()
    return libpq_url(s.liveness_database_url or s.database_url or "")


class Suspects:
    """Liveness keys this reaper saw free, and since when (monotonic seconds).

    Why: a key is also free for a moment while its process lives, between the loss of its
    session and the retake of the key at that process' next reap tick. Ending its leases then
    would start a second copy of a body that still runs (fenced, but run twice at once). A key
    free for `grace` seconds is a dead process: its process would have taken it again
    (`tests/integration/test_liveness.py::
    test_a_live_process_that_lost_its_session_keeps_its_steps`)."""

    def __init__(self) -> None:
        self._since: dict[int, float] = {}

    def dead(self, free: set[int], now: float, grace: float) -> list[int]:
        """Note `free` (the keys free now) and return those free for `grace` seconds."""
        self._since = {key: self._since.get(key, now) for key in free}
        return sorted(key for key, since in self._since.items() if now - since >= grace)

    def due_in(self, now: float, grace: float) -> float | None:
        """Seconds until the earliest grace still running ends (None: none is). A suspect past
        its grace was handed to the reaper already; should its leases' end fail, the next try
        is at the reap interval, not a 5 ms spin while Postgres refuses
        (`tests/unit/test_suspects.py::test_a_suspect_past_its_grace_does_not_hurry_the_next_tick`)."""
        running = [since + grace - now for since in self._since.values() if since + grace > now]
        return min(running) if running else None


class Liveness:
    """This process' liveness lock, its lease owner name, and the reaper loop."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._serving: set[tuple[str, int]] = set()  # version queues this process consumes
        self._held: set[tuple[str, int]] = set()  # ... said so on the current session
        self._pid = 0
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self._owner = ""
        self._key = 0  # this process' advisory key, kept across reconnects
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._suspects = Suspects()

    def owner(self) -> str:
        """The lease owner to write on a claim; takes the lock first, once per process."""
        if self._pid != os.getpid():
            self._start()
        return self._owner or self._plain()

    @staticmethod
    def _plain() -> str:
        return f"{socket.gethostname()}:{os.getpid()}"

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            # A forked child inherits the parent's connection object: never close or use it
            # (closing would end the parent's session and so release the parent's lock).
            self._conn, self._owner, self._key, self._pid = None, "", 0, os.getpid()
            self._held = set()
            self._suspects = Suspects()
            self._stop.clear()
            if get_settings().reap_interval_s <= 0:
                return
            self._connect()
            self._thread = threading.Thread(target=self._loop, name="liveness-reaper", daemon=True)
            self._thread.start()

    def _connect(self) -> None:
        """(Re)open the liveness session and take this process' lock; on failure, plain owner.

        A reconnect takes the same key again. Why: the steps this process claimed before name
        that key in their owner; under a new key the reapers would find the old one released
        and end the leases of a process that is alive and still running them. Taken again, the
        key is released only between the old session's end and the retake (a reap interval at
        most). While the old session still holds it (its end not yet seen by the server), the
        retake fails, the old leases stay covered, and new claims use the plain owner until a
        later tick takes the key (`tests/integration/test_liveness.py`)."""
        key = self._key or secrets.randbits(62)
        try:
            conn = psycopg.connect(
                _conninfo(),
                autocommit=True,
                application_name=APPLICATION_NAME,
                connect_timeout=5,
                **db.tcp_params(),  # type: ignore[arg-type]  # libpq keywords psycopg passes on
            )
            taken, postmaster_start = store.lock_and_identify(conn, key)
        except psycopg.Error as exc:
            log.warning("liveness: no session (%s); this process falls back to its leases", exc)
            self._owner = ""
            return
        if not taken:
            assert self._key, "a fresh random advisory key cannot be taken"
            conn.close()
            log.warning("liveness: this process' old session still holds its lock; retrying")
            self._owner = ""
            return
        self._key = key
        self._conn = conn
        self._owner = f"{self._plain()}#{key}@{postmaster_start}"
        self._held = set()
        self._say_served()

    def serve(self, versions: Iterable[tuple[str, int]]) -> None:
        """Say, on this process' liveness session, that it consumes these (kind, version) queues.

        Why: the sweeper re-sends a step whose message seems lost only to a queue some live
        process consumes (`store.recovery.PUBLISH_DUE`). Without it, each step of a version
        nobody serves put one more message in that queue every `REPUBLISH_AFTER_S`. Said once
        per session (taken again after a reconnect); the session's end withdraws it
        (`tests/integration/test_unserved_versions.py`)."""
        with self._lock:
            self._serving |= set(versions)
        self.owner()  # the session, if this process has none yet
        self._say_served()

    def _say_served(self) -> None:
        with self._lock:
            conn, new = self._conn, sorted(self._serving - self._held)
            if conn is None or not new:
                return
            try:
                store.serve_versions(conn, new)
            except psycopg.Error as exc:  # the reaper's next tick reconnects and says it again
                log.warning("liveness: could not register the served queues (%s)", exc)
                return
            self._held |= set(new)

    def _next_tick(self) -> float:
        """The reap interval, or less when a suspect's grace ends sooner: a dead process is
        recovered `REAP_GRACE_S` after it was first seen, not at the tick after that."""
        s = get_settings()
        due = self._suspects.due_in(time.monotonic(), s.reap_grace_s)
        return s.reap_interval_s if due is None else min(s.reap_interval_s, due + 0.005)

    def _loop(self) -> None:
        while not self._stop.wait(self._next_tick()):
            if self._pid != os.getpid():
                return  # a forked child runs its own loop
            self.tick()

    def tick(self) -> None:
        """One turn of the reaper loop: reap; a lost session is replaced under the same key."""
        try:
            self.reap()
        except psycopg.Error as exc:
            conn = self._conn
            if conn is not None and not conn.closed and not conn.broken:
                log.warning("liveness: reap failed (%s); the session and its lock are kept", exc)
                return
            log.warning("liveness: session lost (%s); reconnecting", exc)
            self._reconnect()
        except Exception:  # keep reaping; the lease path still recovers everything
            log.exception("liveness: reap failed")

    def _reconnect(self) -> None:
        old, self._conn, self._owner = self._conn, None, ""
        if old is not None:
            with contextlib.suppress(psycopg.Error):
                old.close()
        self._connect()  # at once: the key is free for others' reapers until it is taken again

    def reap(self) -> int:
        """End the leases of steps whose owner's session is gone for the grace period, then
        recover them at once."""
        if self._conn is None:
            self._reconnect()
            return 0
        free = store.free_owner_keys(self._conn)
        dead = self._suspects.dead(free, time.monotonic(), get_settings().reap_grace_s)
        if not dead:
            return 0
        rows = store.end_leases_of_dead_owners(self._conn, dead)
        if not rows:
            return 0
        log.info("liveness: %d step(s) of dead worker(s) %s", len(rows), sorted({r.owner for r in rows}))
        recover_now()
        return len(rows)

    def stop(self) -> None:
        """Release the lock (tests, `engine.stop()`): this process' leases stay as they are."""
        self._stop.set()
        conn, self._conn, self._owner, self._key, self._pid = self._conn, None, "", 0, 0
        self._held, self._serving = set(), set()
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.close()


_recover: list[Callable[[], object]] = []


def on_dead_owners(recover: Callable[[], object]) -> None:
    """What to run once leases of dead owners were ended: the sweeper registers a sweep queued
    behind one in progress (which may have read before the leases ended), so recovery does not
    wait for the next beat tick. A callback, not an import: the sweeper imports the engine,
    which imports this module."""
    _recover[:] = [recover]


def recover_now() -> None:
    for recover in _recover:
        recover()


LIVENESS = Liveness()
