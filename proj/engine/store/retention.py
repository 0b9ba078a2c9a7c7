"""Retention (the `purge` kind): the step rows (with their attempts and results) of runs that
finished more than `:secs` ago, and old signals. Run rows stay: they hold the idempotency key,
which never expires (invariant 5); failed runs keep their steps (dead letters wait for an
operator). Proof: `tests/integration/test_acquisition_kinds.py`.
"""

from __future__ import annotations

from sqlalchemy import text

PURGE_FINISHED_STEPS = text(
    """
    DELETE FROM engine.step
     WHERE run_id IN (SELECT id FROM engine.task_run
                       WHERE status IN ('succeeded', 'canceled')
                         AND finished_at < now() - make_interval(secs => :secs))
    """
)

PURGE_SIGNALS = text("DELETE FROM engine.task_signal WHERE created_at < now() - make_interval(secs => :secs)")
