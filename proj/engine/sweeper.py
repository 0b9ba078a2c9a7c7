"""The recovery sweeper (a beat task): Postgres decides what must run, the broker is only told.

Each tick, under a transaction-level advisory lock (so two beats are harmless):
- steps whose lease expired (worker killed, stopped, partitioned) go back to `pending`, or fail
  the run when their attempts are spent — recovery within `lease_ttl + sweep interval`;
- parked steps whose timer is due are woken for a re-check;
- cancel-requested runs with no live step are finalised;
- a limited kind's slot freed by an expired lease goes to the head of its line (`handoff`);
- pending, due steps that were never published (broker down) or whose message seems lost
  (`republish_after_s`) are published, highest priority first; steps refused a slot are
  re-sent this way too, so a waiter is retried at least every `republish_after_s`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj import db
from proj.engine import dispatch
from proj.engine.dispatch import Dispatch, step_dispatch
from proj.engine.errors import UnknownKind
from proj.engine.kind import get_kind
from proj.engine.protocol import fail_run, finalize_cancel, handoff
from proj.engine.runs import woken_dispatches
from proj.engine.store import stats, waits
from proj.settings import get_settings

log = logging.getLogger(__name__)

SWEEP_LOCK = 0x5EE9_0001
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


def sweep(*, wait: bool = False) -> SweepReport:
    """One tick of recovery; safe to run concurrently and as often as wanted.

    `wait`: queue behind a sweep in progress instead of skipping: the liveness reaper has just
    ended leases that sweep may have read too early to see (`proj.engine.liveness`).
    """
    report = SweepReport()
    settings = get_settings()
    with db.transaction() as s:
        if wait:
            s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": SWEEP_LOCK})
        elif not s.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": SWEEP_LOCK}):
            report.skipped = True
            return report
        expired = s.execute(
            text(
                """
                UPDATE engine.step
                   SET status = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'pending' END,
                       error = jsonb_build_object('type', 'LeaseExpired', 'message',
                               'worker ' || coalesce(lease_owner, '?') || ' stopped renewing its lease'),
                       lease_token = NULL, lease_until = NULL, published_at = NULL,
                       next_attempt_at = now()
                 WHERE id IN (SELECT id FROM engine.step WHERE status = 'running'
                               AND lease_until < now() ORDER BY lease_until LIMIT :n
                               FOR UPDATE SKIP LOCKED)
             RETURNING id, run_id, status, name, attempts, error
                """
            ),
            {"n": BATCH},
        ).all()
        report.expired = len(expired)
        if expired:  # `proj_lease_recoveries_total`, counted where the lease is taken back
            s.execute(stats.COUNT_LEASE_RECOVERIES, {"n": len(expired)})
        for row in expired:
            if row.status == "failed":
                report.failed += 1
                fail_run(s, row.run_id, {**row.error, "step": row.name, "attempts": row.attempts})
        to_publish: list[Dispatch] = []
        for kind_name, version, key in _slots(s, [row.run_id for row in expired]):
            try:
                kind = get_kind(kind_name, version)
            except UnknownKind:  # a version this process does not know: waiters are re-sent below
                continue
            to_publish.extend(handoff(s, kind, key))
        woken = woken_dispatches(waits.wake_due_timers(s, BATCH))
        report.woken = len(woken)
        to_publish.extend(dispatch.batched(woken, dispatch.wake_batch_size()))
        cancels = s.scalars(
            text(
                "SELECT id FROM engine.task_run WHERE cancel_requested_at IS NOT NULL "
                "AND status IN ('pending', 'running', 'waiting') LIMIT :n"
            ),
            {"n": BATCH},
        ).all()
        for run_id in cancels:
            to_publish.extend(finalize_cancel(s, run_id))
        report.cancel_checked = len(cancels)
        due = s.execute(
            text(
                """
                UPDATE engine.step s SET published_at = now()
                  FROM engine.task_run r
                 WHERE s.id IN (
                        SELECT p.id FROM engine.step p JOIN engine.task_run pr ON pr.id = p.run_id
                         WHERE p.status = 'pending' AND p.next_attempt_at <= now()
                           AND (p.published_at IS NULL
                                OR p.published_at < now() - make_interval(secs => :again))
                         ORDER BY pr.priority DESC, p.next_attempt_at LIMIT :n
                         FOR UPDATE OF p SKIP LOCKED)
                   AND r.id = s.run_id AND r.status IN ('pending', 'running', 'waiting')
                   AND r.cancel_requested_at IS NULL
             RETURNING s.id, s.name, r.kind, r.version, r.priority, s.next_attempt_at
                """
            ),
            {"again": settings.republish_after_s, "n": BATCH},
        ).all()
        due = sorted(due, key=lambda r: (-r.priority, r.next_attempt_at))  # RETURNING has no order
        to_publish.extend(step_dispatch(r.id, r.kind, r.version, r.name, r.priority) for r in due)
        report.published = len(due)
    dispatch.publish_after_commit(to_publish)
    if report.expired or report.woken or report.published or report.failed:
        log.info("sweep: %s", json.dumps(report.__dict__))
    return report


def _slots(s: Session, run_ids: list[Any]) -> list[Any]:
    """The (kind, version, concurrency_key) of runs whose step lost its lease: slots to hand off."""
    if not run_ids:
        return []
    return list(
        s.execute(
            text("SELECT DISTINCT kind, version, concurrency_key FROM engine.task_run WHERE id = ANY(:ids)"),
            {"ids": run_ids},
        ).all()
    )
