"""`reconcile_downloads` (periodic): qBittorrent's managed torrents against our tasks."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from proj import db
from proj.acquisition import qbt, service
from proj.acquisition.models import DownloadTask, Flag
from proj.engine import runs
from proj.engine.context import StepContext
from proj.engine.kind import Kind, RetryPolicy, register, step


class PeriodicInput(BaseModel):
    """Periodic kinds are keyed by their time bucket, so two beats enqueue one run."""

    bucket: int


def flag(s: Any, kind: str, subject: str, **detail: Any) -> None:
    s.execute(pg_insert(Flag).values(kind=kind, subject=subject, detail=detail).on_conflict_do_nothing())


def reconcile(ctx: StepContext) -> dict[str, int]:
    """Flag strangers, resume paused downloads, wake runs whose download already finished,
    flag tasks whose torrent vanished.

    A task may download through a torrent the operator added before it (untagged: adopted by
    `acquire.add_torrent`). It is looked up by its hash, so it is not flagged missing; it is woken
    when complete, but never resumed: the operator paused it (proof:
    `tests/integration/test_reconcile_adopted.py`)."""
    torrents = {t.hash.lower(): t for t in qbt.client().torrents_info(tag=qbt.MANAGED_TAG)}
    with db.transaction() as s:
        active = s.execute(
            select(DownloadTask.id, DownloadTask.infohash, DownloadTask.status).where(
                DownloadTask.status.in_(("approved", "downloading")),
                DownloadTask.cancel_requested_at.is_(None),
            )
        ).all()
        known = set(s.scalars(select(DownloadTask.infohash)))
        counts = {"unknown": 0, "missing": 0, "resumed": 0, "woken": 0}
        for infohash in torrents.keys() - known:
            flag(s, "unknown_torrent", infohash, name=torrents[infohash].name)
            counts["unknown"] += 1
        adopted = _untagged(sorted({infohash for _, infohash, _ in active} - torrents.keys()))
        wake: list[str] = []
        for task_id, infohash, status in active:
            t = torrents.get(infohash) or adopted.get(infohash)
            if t is None:
                if status == "downloading":
                    flag(s, "missing_torrent", str(task_id), infohash=infohash)
                    counts["missing"] += 1
            elif qbt.is_complete(t):
                wake.append(infohash)
            elif t.state in ("pausedDL", "stoppedDL") and infohash in torrents:
                qbt.client().torrents_resume(torrent_hashes=infohash)
                counts["resumed"] += 1
    for infohash in wake:
        counts["woken"] += runs.signal(service.download_topic(infohash))
    return counts


def _untagged(infohashes: list[str]) -> dict[str, Any]:
    """The torrents among `infohashes` that qBittorrent lists without our tag, by hash."""
    if not infohashes:
        return {}
    listed = qbt.client().torrents_info(torrent_hashes="|".join(infohashes))
    return {t.hash.lower(): t for t in listed if not qbt.is_managed(t)}


RECONCILE_DOWNLOADS = register(
    Kind(
        name="reconcile_downloads",
        version=1,
        retry=RetryPolicy.network(),
        input_model=PeriodicInput,
        canvas=(step("reconcile", reconcile),),
        description="periodic: adopt, flag or resume managed torrents",
    )
)
