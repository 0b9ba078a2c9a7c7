"""`retire_seed`: durable sleep until the seeding goal, then remove the torrent, keep the files."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from proj import db
from proj.acquisition import qbt, service
from proj.engine.context import StepContext
from proj.engine.effects import Attempt, Done, NotDone, effect
from proj.engine.kind import Kind, RetryPolicy, register, sleep_until, step
from proj.kinds.common import TaskInput, torrent_add


class RetireInput(TaskInput):
    seed_until: datetime


def retire(ctx: StepContext) -> dict[str, Any]:
    with db.transaction() as s:
        task = service.load(s, ctx.input.download_task_id)
    infohash = task.infohash
    if (torrent_add(task.id) or {}).get("adopted"):
        # It was in qBittorrent before this request's add: its seeding is not ours to end.
        return {"skipped": "the torrent was not added by this request"}

    def do(att: Attempt) -> dict[str, Any]:
        t = qbt.find(infohash)
        if t is not None and not qbt.is_managed(t):  # never a torrent without our tag
            return {"kept": infohash, "reason": f"not tagged {qbt.MANAGED_TAG}"}
        if t is not None:
            qbt.client().torrents_delete(delete_files=False, torrent_hashes=infohash)
        return {"retired": infohash}

    def reconcile(att: Attempt) -> Done[dict[str, Any]] | NotDone:
        return Done({"retired": infohash}) if qbt.find(infohash) is None else NotDone("seeding")

    result = effect(
        ctx, f"qbt-retire:{task.id}", {"infohash": infohash}, do, reconcile, effect_kind="qbittorrent"
    )
    with ctx.fenced() as s:
        service.event(s, task.id, "seeding retired", infohash=infohash)
    return result


RETIRE_SEED = register(
    Kind(
        name="retire_seed",
        version=1,
        retry=RetryPolicy.network(),
        input_model=RetireInput,
        canvas=(
            sleep_until("seed_goal", until=lambda ctx: ctx.input.seed_until),
            step("retire", retire),
        ),
        description="sleep (in Postgres) until the seeding goal, then remove the torrent",
    )
)
