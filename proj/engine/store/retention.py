"""Retention (the `purge` kind): the step rows (with their attempts and results) of runs that
finished more than `:secs` ago, and old signals. Run rows stay: they hold the idempotency key,
which never expires (invariant 5); failed runs keep their steps (dead letters wait for an
operator). Proof: `tests/integration/test_acquisition_kinds.py`.

| function | from | to |
|---|---|---|
| `purge_finished_steps` (`PURGE_FINISHED_STEPS`) | steps of runs finished over `secs` ago | deleted |
| `purge_signals` (`PURGE_SIGNALS`) | signals stored over `secs` ago | deleted |
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

from proj.engine.store.rows import changed

PURGE_FINISHED_STEPS = text(
    """
    DELETE FROM engine.step
     WHERE run_id IN (SELECT id FROM engine.task_run
                       WHERE status IN ('succeeded', 'canceled')
                         AND finished_at < now() - make_interval(secs => :secs))
    """
)

PURGE_SIGNALS = text("DELETE FROM engine.task_signal WHERE created_at < now() - make_interval(secs => :secs)")


def purge_finished_steps(s: Session, secs: float) -> int:
    """Delete the steps of runs that succeeded or were canceled over `secs` ago; how many."""
    return changed(s.execute(PURGE_FINISHED_STEPS, {"secs": secs}))


def purge_signals(s: Session, secs: float) -> int:
    """Delete the signals stored over `secs` ago; how many."""
    return changed(s.execute(PURGE_SIGNALS, {"secs": secs}))
