"""`library.copy_file` on its own: result, temp file discipline, cancel within one chunk."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from proj.acquisition import library

CHUNK = 64 * 1024


class Stop(Exception):
    pass


def _source(tmp_path: Path, size: int) -> tuple[Path, str]:
    src = tmp_path / "src" / "file.bin"
    src.parent.mkdir()
    data = os.urandom(size)
    src.write_bytes(data)
    return src, hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 7 * CHUNK + 123, 3 * 1024 * 1024 + 5])
def test_copy_file_copies_and_hashes_what_it_wrote(tmp_path: Path, size: int) -> None:
    src, digest = _source(tmp_path, size)
    dst = tmp_path / "lib" / "a" / "file.bin"
    seen: list[tuple[int, int]] = []
    out = library.copy_file(src, dst, "t1", chunk=CHUNK, progress=lambda d, t: seen.append((d, t)))
    assert out == {"path": str(dst), "size": size, "sha256": digest}
    assert dst.read_bytes() == src.read_bytes()
    assert library.sha256_file(dst) == digest
    assert library.temp_files(dst) == []
    assert [d for d, _ in seen] == sorted({min(size, CHUNK * (i + 1)) for i in range(-(-size // CHUNK))})
    assert all(t == size for _, t in seen)


def test_copy_file_replaces_an_existing_destination_atomically(tmp_path: Path) -> None:
    src, digest = _source(tmp_path, 5 * CHUNK)
    dst = tmp_path / "lib" / "file.bin"
    dst.parent.mkdir()
    dst.write_bytes(b"old")
    assert library.copy_file(src, dst, "t2", chunk=CHUNK)["sha256"] == digest
    assert library.sha256_file(dst) == digest


@pytest.mark.parametrize("stop_at", [1, 2, 5, 40])
def test_cancel_stops_within_one_chunk_and_leaves_nothing(tmp_path: Path, stop_at: int) -> None:
    src, _ = _source(tmp_path, 40 * CHUNK)
    dst = tmp_path / "lib" / "file.bin"
    calls = 0
    written_at_stop: list[int] = []

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if calls == stop_at:
            temps = library.temp_files(dst)
            written_at_stop.append(temps[0].stat().st_size if temps else 0)
            raise Stop

    with pytest.raises(Stop):
        library.copy_file(src, dst, "t3", chunk=CHUNK, checkpoint=checkpoint)
    # the checkpoint runs before every chunk: at most one chunk was written since the last one
    assert written_at_stop == [(stop_at - 1) * CHUNK]
    assert not dst.exists(), "no partial file at the final path"
    assert library.temp_files(dst) == [], "the temp file is removed"


def test_cancel_after_the_last_chunk_before_the_rename(tmp_path: Path) -> None:
    src, _ = _source(tmp_path, 3 * CHUNK)
    dst = tmp_path / "lib" / "file.bin"
    calls = 0

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if calls == 5:  # 3 chunks + the EOF read, then the check before the rename
            raise Stop

    with pytest.raises(Stop):
        library.copy_file(src, dst, "t4", chunk=CHUNK, checkpoint=checkpoint)
    assert not dst.exists()
    assert library.temp_files(dst) == []


def test_a_write_error_removes_the_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = _source(tmp_path, 4 * CHUNK)
    dst = tmp_path / "lib" / "file.bin"
    calls = 0
    real = library._write_all

    def failing(fout, view) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(28, "No space left on device")
        real(fout, view)

    monkeypatch.setattr(library, "_write_all", failing)
    with pytest.raises(OSError, match="No space"):
        library.copy_file(src, dst, "t5", chunk=CHUNK)
    assert not dst.exists()
    assert library.temp_files(dst) == []


def test_a_stale_attempts_temp_file_is_not_touched(tmp_path: Path) -> None:
    src, digest = _source(tmp_path, 2 * CHUNK)
    dst = tmp_path / "lib" / "file.bin"
    dst.parent.mkdir()
    other = library.temp_path(dst, "other-attempt")
    other.write_bytes(b"stale")
    assert library.copy_file(src, dst, "t6", chunk=CHUNK)["sha256"] == digest
    assert other.read_bytes() == b"stale"
    assert library.remove_temp_files(dst) == 1
