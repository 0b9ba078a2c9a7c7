"""The recovery sweeper (a beat task): Postgres decides what must run, the broker is only told.

Each tick, under a transaction-level advisory lock (so two beats are harmless):
- steps whose lease expired (worker killed, stopped, partitioned) go back to `pending`, or fail
  the run when their attempts are spent — recovery within `lease_ttl + sweep interval`;
- parked steps whose timer is due are woken for a re-check;
- cancel-requested runs with no live step are finalised;
- live children of a failed or canceled parent that its cascade skipped are canceled;
- live runs past their deadline with no live step end `failed` (`DeadlineExceeded`), with
  their compensation: a deadline wakes a parked run at once;
- a limited kind's slot freed by an expired lease goes to the head of its line (`handoff`);
- a run of a version this process does not know is left to one that does: the statements that
  pick runs to end take only known versions (`Known`), so such runs neither fill the batch nor
  roll the sweep back (`chain.if_served` stays as the guard for a child met by a cascade);
- pending, due steps that were never published (broker down) or whose message seems lost
  (`republish_after_s`) are published, highest priority first; steps refused a slot are
  re-sent this way too, so a waiter is retried at least every `republish_after_s`. A queue no
  live worker says it consumes (`liveness.serve`) is re-sent to only every
  `republish_unconsumed_s`, so it does not grow while nobody reads it.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from dataclasses import dataclass

from sqlalchemy.orm import Session

from proj import db
from proj.engine import dispatch
from proj.engine.admission import handoff
from proj.engine.chain import expire_run, finalize_cancel, if_served, request_cancel
from proj.engine.commits import fail_run
from proj.engine.dispatch import Dispatch, step_dispatch
from proj.engine.errors import UnknownKind
from proj.engine.heartbeat import lock_idle_ms
from proj.engine.kind import all_kinds, get_kind
from proj.engine.liveness import on_dead_owners
from proj.engine.runs import woken_dispatches
from proj.engine.status import StepStatus
from proj.engine.store import children as children_store
from proj.engine.store import recovery as store
from proj.engine.store import stats, waits
from proj.engine.store.rows import Known
from proj.settings import get_settings

log = logging.getLogger(__name__)

BATCH = 1000


@dataclass
class SweepReport:
    """What one tick did (logged, and returned to tests and the CLI)."""

    skipped: bool = False
    expired: int = 0
    failed: int = 0
    woken: int = 0
    cancel_checked: int = 0
    published: int = 0
    expired_runs: int = 0


def sweep(*, wait: bool = False) -> SweepReport:
    """One tick of recovery; safe to run concurrently and as often as wanted.

    `wait`: queue behind a sweep in progress instead of skipping: the liveness reaper has just
    ended leases that sweep may have read too early to see (`proj.engine.liveness`).
    """
    report = SweepReport()
    settings = get_settings()
    idle_ms = lock_idle_ms()  # a sweeper frozen holding the lock loses it
    with db.transaction() as s:
        if wait:
            store.lock_sweep(s, idle_ms=idle_ms)
        elif not store.try_lock_sweep(s, idle_ms=idle_ms):
            report.skipped = True
            return report
        known = known_versions()
        expired = store.expire_leases(s, BATCH, known)
        report.expired = len(expired)
        if expired:  # `proj_lease_recoveries_total`, counted where the lease is taken back
            stats.count_lease_recoveries(s, len(expired))
        to_publish: list[Dispatch] = []
        for row in expired:
            if row.status == StepStatus.FAILED:
                report.failed += 1
                err = {**row.error, "step": row.name, "attempts": row.attempts}
                # A run asked to cancel is finished as canceled, with its compensation: its kind.
                to_publish.extend(if_served(s, row.run_id, functools.partial(fail_run, s, err=err)))
        for kind_name, version, key in _slots(s, [row.run_id for row in expired]):
            try:
                kind = get_kind(kind_name, version)
            except UnknownKind:  # a version this process does not know: waiters are re-sent below
                continue
            to_publish.extend(handoff(s, kind, key))
        woken = woken_dispatches(waits.wake_due_timers(s, BATCH))
        report.woken = len(woken)
        to_publish.extend(dispatch.batched(woken, dispatch.wake_batch_size()))
        cancels = store.cancels_to_finish(s, BATCH, known)
        for run_id in cancels:
            to_publish.extend(if_served(s, run_id, lambda r: finalize_cancel(s, r)))
        report.cancel_checked = len(cancels)
        for run_id in children_store.orphaned_children(s, BATCH, known):
            to_publish.extend(
                if_served(s, run_id, lambda r: request_cancel(s, r, "its parent run ended", by_parent=True))
            )
        late = children_store.past_deadline(s, BATCH, known)
        for run_id in late:  # parked or between steps past the deadline: the run ends now
            to_publish.extend(if_served(s, run_id, lambda r: expire_run(s, r)))
        report.expired_runs = len(late)
        due = store.publish_due(
            s,
            again_s=settings.republish_after_s,
            again_unconsumed_s=max(settings.republish_unconsumed_s, settings.republish_after_s),
            n=BATCH,
        )
        due = sorted(due, key=lambda r: (-r.priority, r.next_attempt_at))  # RETURNING has no order
        to_publish.extend(step_dispatch(r.id, r.kind, r.version, r.name, r.priority) for r in due)
        report.published = len(due)
    dispatch.publish_after_commit(to_publish)
    if report.expired or report.woken or report.published or report.failed or report.expired_runs:
        log.info("sweep: %s", json.dumps(report.__dict__))
    return report


def known_versions() -> Known:
    """The (kind, version) pairs declared in this process: the runs its sweep can end."""
    kinds = all_kinds()
    return Known([k.name for k in kinds], [k.version for k in kinds])


def _slots(s: Session, run_ids: list[uuid.UUID]) -> list[store.RunSlot]:
    """The (kind, version, concurrency_key) of runs whose step lost its lease: slots to hand off."""
    if not run_ids:
        return []
    return store.slots_of_runs(s, run_ids)


# The liveness reaper recovers a dead worker's steps at once, through a sweep that waits for one
# in progress (`proj.engine.liveness`, `tests/faults/test_recovery_fast.py`).
on_dead_owners(lambda: sweep(wait=True))
