"""Copying into the library: temp file, chunked, fsync, atomic rename — cancellable per chunk."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def temp_path(dst: Path, token: str) -> Path:
    """One temp name per attempt: a stale attempt never writes into the live one's file."""
    return dst.with_name(f".{dst.name}.part-{token}")


def temp_files(dst: Path) -> list[Path]:
    return sorted(dst.parent.glob(f".{dst.name}.part-*")) if dst.parent.exists() else []


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_file(
    src: Path,
    dst: Path,
    token: str,
    *,
    checkpoint: Callable[[], None] = lambda: None,
    progress: Callable[[int, int], None] | None = None,
    chunk: int = CHUNK,
) -> dict[str, object]:
    """Copy `src` to `dst` durably. `checkpoint()` runs before each chunk and may raise to stop.

    The destination appears only complete (rename after fsync); an interrupted copy leaves a
    `.part-<token>` file that compensation or the next attempt removes.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dst, token)
    total = src.stat().st_size
    h = hashlib.sha256()
    done = 0
    try:
        with src.open("rb") as fin, tmp.open("wb") as fout:
            while True:
                checkpoint()
                block = fin.read(chunk)
                if not block:
                    break
                fout.write(block)
                h.update(block)
                done += len(block)
                if progress is not None:
                    progress(done, total)
            fout.flush()
            os.fsync(fout.fileno())
        checkpoint()
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"path": str(dst), "size": done, "sha256": h.hexdigest()}


def remove_temp_files(dst: Path) -> int:
    n = 0
    for p in temp_files(dst):
        p.unlink(missing_ok=True)
        n += 1
    return n
