"""Reading a run's steps in tests."""

from __future__ import annotations

from typing import Any

from tests.support.services import scalar


def first_step(run_id: Any) -> int:
    """The id of the run's first step (stage 0, a single step)."""
    return int(scalar("SELECT id FROM engine.step WHERE run_id = %s AND stage = 0", (run_id,)))
