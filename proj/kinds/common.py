"""Helpers shared by the acquisition kinds: inputs, loading the task, the cancel guard."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import ledger
from proj import db
from proj.acquisition import service, torrents
from proj.acquisition.models import DownloadTask
from proj.engine.context import StepContext
from proj.engine.errors import CancelRequested
from proj.settings import get_settings


class TaskInput(BaseModel):
    """Most kinds act on one download task."""

    download_task_id: uuid.UUID


def load_task(ctx: StepContext) -> DownloadTask:
    """Read the business row; a cancel written on it stops the run before any effect."""
    with db.transaction() as s:
        task = service.load(s, ctx.input.download_task_id)
    if task.cancel_requested_at is not None:
        raise CancelRequested(f"download task {task.id} was canceled")
    return task


def library_root() -> Path:
    return Path(get_settings().library_root)


def download_dir() -> Path:
    return Path(get_settings().download_dir)


def inside(root: Path, path: Path) -> Path:
    """Resolve `path` and insist it stays under `root` (belt and braces after parsing)."""
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ValueError(f"{path} escapes {root}")
    return resolved


library_rel = torrents.library_rel


def library_path(task_id: uuid.UUID, rel: str, root: Path | None = None) -> Path:
    """Where a file lands: `<root>/<task id>/<rel>`, never outside `root`."""
    root = root or library_root()
    return inside(root, root / str(task_id) / rel)


def torrent_library_paths(task_id: uuid.UUID, meta: torrents.TorrentMeta) -> set[Path]:
    """Where every file of the torrent lands: none of them is ever a temp file to remove."""
    return {library_path(task_id, library_rel(meta, f)) for f in meta.files}


def torrent_add(task_id: uuid.UUID) -> dict[str, Any] | None:
    """The task's add as the ledger knows it (`acquire.add_torrent`'s op key): None when it was
    never attempted, else its stored result (empty while it has none). `{"adopted": true}`: the
    torrent was already in qBittorrent, so the task did not add it and must not remove it."""
    with db.transaction() as s:
        op = ledger.get_operation(s, f"qbt-add:{task_id}")
        if op is None:
            return None
        return op.result if isinstance(op.result, dict) else {}
