"""One heartbeat thread per process keeps every running step's lease alive.

It also reports back what only the database knows: a lease that was taken over (the attempt is
stale and must not commit) and a cancel request on the run.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from proj import db
from proj.engine.store import leases as store
from proj.settings import get_settings

log = logging.getLogger(__name__)


def lock_idle_ms() -> int:
    """How long a transaction holding engine locks may sit idle, set by the statement that takes
    them: two thirds of the lease (`store.idle_bound_ms`), so a holder frozen inside one loses
    its locks before its lease runs out (`tests/integration/test_idle_bounds.py`)."""
    return store.idle_bound_ms(get_settings().lease_ttl_s)


@dataclass
class Lease:
    """What a running attempt knows about its lease; flags are set by the heartbeat thread."""

    step_id: int
    token: uuid.UUID
    lost: threading.Event = field(default_factory=threading.Event)
    cancel: threading.Event = field(default_factory=threading.Event)


class Heartbeat:
    """Renews the leases of this process' running steps every `lease_ttl / 3` seconds."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._wake = threading.Event()

    @contextmanager
    def track(self, step_id: int, token: uuid.UUID) -> Iterator[Lease]:
        """Keep the lease alive while the body runs.

        A step claimed ahead of its turn (`track_many`) already has its record: the body gets
        that one, with what the heartbeat learned while the step waited (a lease taken over, a
        cancel asked). A fresh record dropped both, and the body ran on a lost lease
        (`tests/integration/test_step_path_review.py::
        test_a_claimed_step_whose_lease_was_taken_while_it_waited_its_turn_does_not_run`)."""
        self._ensure_thread()
        with self._lock:
            outer = self._leases.get(step_id)
            inherited = outer is not None and outer.token == token
            lease = outer if outer is not None and inherited else Lease(step_id, token)
            self._leases[step_id] = lease
        try:
            yield lease
        finally:
            if not inherited:  # an inherited record is `track_many`'s to drop
                with self._lock:
                    if self._leases.get(step_id) is lease:
                        del self._leases[step_id]

    @contextmanager
    def track_many(self, held: list[tuple[int, uuid.UUID]]) -> Iterator[None]:
        """Keep the leases of claimed steps that wait their turn alive (a batched claim,
        `protocol._deliver_batch`); each one's own `track` takes over while its body runs."""
        if not held:
            yield
            return
        self._ensure_thread()
        with self._lock:
            for step_id, token in held:
                self._leases.setdefault(step_id, Lease(step_id, token))
        try:
            yield
        finally:
            with self._lock:
                for step_id, token in held:
                    lease = self._leases.get(step_id)
                    if lease is not None and lease.token == token:
                        del self._leases[step_id]

    def _ensure_thread(self) -> None:
        # A forked child inherits the object but not the thread: start one per pid.
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._leases = {}
                self._thread = threading.Thread(target=self._loop, name="lease-heartbeat", daemon=True)
                self._thread.start()

    def interval(self) -> float:
        return max(0.2, min(5.0, get_settings().lease_ttl_s / 3.0))

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval())
            self._wake.clear()
            with self._lock:
                leases = list(self._leases.values())
            if leases:
                try:
                    self.renew(leases)
                except Exception as exc:  # the fence still protects commits
                    log.warning("lease heartbeat failed: %s", exc)

    def renew(self, leases: list[Lease]) -> None:
        """Extend all leases in one statement; a missing row means the lease is gone."""
        with db.transaction() as s:
            rows = store.renew(
                s, ttl=get_settings().lease_ttl_s, leases=[(lease.step_id, lease.token) for lease in leases]
            )
        alive = {row.step_id: row.cancel for row in rows}
        for lease in leases:
            if lease.step_id not in alive:
                lease.lost.set()
            elif alive[lease.step_id]:
                lease.cancel.set()


HEARTBEAT = Heartbeat()
