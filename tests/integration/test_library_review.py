"""A review of the library file operations (`proj/acquisition/library.py`, `proj/kinds/importing.py`,
`verify_library.py`, `relocate.py`): each test here failed on the code before its fix.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest

import proj.celery  # noqa: F401 - registers every kind
from proj.acquisition import library
from proj.engine import runs
from tests.support.services import scalar


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_bytes(path: Path, at: int = 1000) -> None:
    """Bit rot: the same size and mtime-agnostic, other bytes."""
    data = bytearray(path.read_bytes())
    data[at : at + 16] = bytes(b ^ 0xFF for b in data[at : at + 16])
    path.write_bytes(bytes(data))


def enqueue_periodic(kind: str, bucket: int) -> uuid.UUID:
    return runs.enqueue(kind, {"bucket": bucket}, idempotency_key=f"{kind}:{bucket}").task_run_id


def run_status(key: str) -> str | None:
    return scalar("SELECT status FROM engine.task_run WHERE idempotency_key = %s", (key,))


# ------------------------------------------------------------------------------ long file names


def test_a_file_name_near_name_max_can_be_copied(tmp_path: Path) -> None:
    """A file name of 253 bytes is legal (NAME_MAX is 255) and qBittorrent downloads it; 84
    Japanese characters are enough. Before: its temp file `.<name>.part-<32 hex>` was 292 bytes,
    every attempt failed with ENAMETOOLONG and the import ended a dead letter. Now the temp name
    is shortened (with a digest of the name) to fit, and is still found and removed as a temp file."""
    name = "ア" * 83 + ".mkv"
    assert len(name.encode()) == 253
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    dst = tmp_path / "lib" / name

    def stop() -> None:
        raise KeyboardInterrupt

    result = library.copy_file(src, dst, "b" * 32, chunk=65536)
    assert result["sha256"] == sha256(src) == sha256(dst)

    leftover = library.temp_path(dst, "a" * 32)  # an earlier attempt's, killed midway
    assert len(leftover.name.encode()) <= 255
    leftover.write_bytes(b"an earlier attempt's")
    assert library.temp_files(dst) == [leftover]
    assert library.temp_files(dst, keep={leftover}) == []
    assert library.remove_temp_files(dst) == 1
    assert sorted(p.name for p in dst.parent.iterdir()) == [name]

    with pytest.raises(KeyboardInterrupt):  # an interrupted copy leaves nothing behind
        library.copy_file(src, dst, "c" * 32, checkpoint=stop)
    assert sorted(p.name for p in dst.parent.iterdir()) == [name]


def test_a_long_name_is_not_cut_inside_a_character(tmp_path: Path) -> None:
    """Two long names sharing a prefix get two temp names, each valid UTF-8."""
    a = tmp_path / ("é" * 126 + "-a")
    b = tmp_path / ("é" * 126 + "-b")
    ta, tb = library.temp_path(a, "0" * 32), library.temp_path(b, "0" * 32)
    assert ta != tb
    for t in (ta, tb):
        assert len(t.name.encode()) <= 255
        t.name.encode("utf-8")  # no lone surrogate from a split character
    ta.write_bytes(b"x")
    assert library.temp_files(a) == [ta] and library.temp_files(b) == []
