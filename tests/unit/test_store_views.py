"""`proj.engine.store.views.Run` is a whole `engine.task_run` row (`RUN` and `DEAD_LETTERS`
select `*`): a column added to the table must be added to it too (the typed schema,
`proj.engine.models`, follows the migrations: `tests/integration/test_engine_schema.py`)."""

from __future__ import annotations

from proj.engine.models import TaskRun
from proj.engine.store.views import Run


def test_run_holds_every_task_run_column_in_the_tables_order() -> None:
    assert list(Run._fields) == [c.name for c in TaskRun.__table__.columns]
