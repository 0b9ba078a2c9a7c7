"""`retire_seed`: durable sleep until the seeding goal, then remove the torrent, keep the files."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from proj import db
from proj.acquisition import qbt, service
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, Done, NotDone, effect
from proj.engine.kind import Kind, register, sleep_until, step
from proj.kinds.common import TaskInput, release_torrent, torrent_add, while_qbittorrent_down


class RetireInput(TaskInput):
    seed_until: datetime


def retire(ctx: StepContext) -> dict[str, Any]:
    """Remove the torrent (keep its data) unless another request still holds it
    (`common.release_torrent`); reconcile: the infohash is gone (else decide again)."""
    with db.transaction() as s:
        task = service.load(s, ctx.input.download_task_id)
    infohash = task.infohash
    if (torrent_add(task.id) or {}).get("adopted"):
        # It was in qBittorrent before this request's add: its seeding is not ours to end.
        return {"skipped": "the torrent was not added by this request"}

    def do(att: Attempt) -> dict[str, Any]:
        # Kept while another request still holds it (or it is not tagged ours).
        kept = release_torrent(task.id, infohash, delete_files=False)
        return {"kept": infohash, "reason": kept} if kept else {"retired": infohash}

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        return Done({"retired": infohash}) if qbt.find(infohash) is None else NotDone("seeding")

    result = effect(
        ctx, f"qbt-retire:{task.id}", {"infohash": infohash}, do, reconcile, effect_kind="qbittorrent"
    )
    # The event and the step's result commit together: a worker killed between two commits
    # would run the step again and write the event twice
    # (`tests/integration/test_events_once.py::test_seeding_retired_once_after_a_lost_step_commit`).
    with ctx.finish(result) as s:
        kept = {"kept": result["reason"]} if "kept" in result else {}
        service.event(s, task.id, "seeding retired", infohash=infohash, **kept)
    return result


RETIRE_SEED = register(
    Kind(
        name="retire_seed",
        version=1,
        retry=qbt.QBT_RETRY,
        input_model=RetireInput,
        canvas=(
            sleep_until("seed_goal", until=lambda ctx: ctx.input.seed_until),
            step("retire", while_qbittorrent_down(retire)),
        ),
        description="sleep (in Postgres) until the seeding goal, then remove the torrent",
    )
)
