"""A "new build" for the upgrade test: `import@2` = `import@1` plus an appended step.

Loaded only by the workers of the new build (ENGINE_EXTRA_KINDS), never by the test process,
so the committed step lock (service kinds of the shipped code) is not affected.
"""

from __future__ import annotations

from proj.acquisition import service
from proj.engine.context import StepContext
from proj.engine.kind import Kind, register, step
from proj.kinds.importing import IMPORT


def announce(ctx: StepContext) -> dict[str, int]:
    with ctx.fenced() as s:
        service.event(s, ctx.input.download_task_id, "imported by v2")
    return {"version": ctx.kind.version}


IMPORT_V2 = register(
    Kind(
        name="import",
        version=2,
        retry=IMPORT.retry,
        input_model=IMPORT.input_model,
        canvas=(*IMPORT.canvas, step("announce", announce)),
        on_cancel=IMPORT.on_cancel,
        compensation=IMPORT.compensation,
        description="import@1 + announce",
    )
)
