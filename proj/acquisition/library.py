"""Copying into the library: temp file, chunked, fsync, atomic rename — cancellable per chunk."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import os
import shutil
import sys
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class LibraryFull(OSError):
    """The library's filesystem has no room: a clear reason for the dead letter, retried first.

    Raised before a copy starts (`check_space`) and when a write fails with ENOSPC or EDQUOT in
    the middle (`copy_file`, whose temp file is removed first). Proof:
    `tests/faults/test_faults_disk.py`.
    """

    def __init__(self, root: Path, needed: int, free: int) -> None:
        super().__init__(
            errno.ENOSPC,
            f"library full: needs {needed} bytes, {free} free on {root} ({os.strerror(errno.ENOSPC)})",
        )
        self.root, self.needed, self.free = root, needed, free


class DigestMismatch(RuntimeError):
    """The bytes a copy read are not the ones verified: their sha256 differs from the one it was
    told to expect. Raised before the rename, so the destination never holds them (the temp file
    is removed)."""

    def __init__(self, src: Path, expected: str, got: str) -> None:
        super().__init__(f"{src} is not what was verified: sha256 {got[:16]}…, verified {expected[:16]}…")
        self.src, self.expected, self.got = src, expected, got


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on `path`'s filesystem (its nearest existing dir)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_space(root: Path, needed: int) -> None:
    """Refuse to start writing `needed` bytes under `root` when they cannot fit."""
    free = free_bytes(root)
    if needed > free:
        raise LibraryFull(root, needed, free)


NAME_MAX = 255  # bytes in one file name (Linux filesystems, and most others)
TOKEN_CHARS = 32  # an attempt token's hex, the end of every temp name


def _temp_stem(name: str) -> str:
    """`.<name>`, the start of `name`'s temp file names, short enough for `.part-<token>` to fit.

    Why: a file name of up to 255 bytes is legal (84 Japanese characters reach 253) and
    qBittorrent downloads it, but `.<name>.part-<token>` adds 39 bytes: every copy attempt
    failed with ENAMETOOLONG. A long name keeps its start, cut on a character boundary, plus a
    digest of the whole name, so two long names sharing a start keep apart
    (`tests/integration/test_library_review.py::test_a_file_name_near_name_max_can_be_copied`).
    """
    raw = os.fsencode(name)
    suffix = len(".part-") + TOKEN_CHARS
    if 1 + len(raw) + suffix <= NAME_MAX:
        return f".{name}"
    digest = hashlib.sha256(raw).hexdigest()[:16]
    budget = NAME_MAX - suffix - len(".~") - len(digest)
    head = raw[:budget].decode("utf-8", "ignore")  # a split character is dropped, never half-kept
    return f".{head}~{digest}"


def temp_path(dst: Path, token: str) -> Path:
    """One temp name per attempt: a stale attempt never writes into the live one's file."""
    return dst.with_name(f"{_temp_stem(dst.name)}.part-{token}")


def temp_files(dst: Path, keep: Collection[Path] = ()) -> list[Path]:
    """Every attempt's temp files of `dst`, except the paths in `keep`.

    File names come from torrents (untrusted): `dst`'s name is matched literally (a `[x]` or `*`
    in it is no pattern), and a torrent may hold a file named like a sibling's temp file
    (`.a.part-x` next to `a`), which callers pass in `keep` so it is never taken for one.
    """
    if not dst.parent.exists():
        return []
    kept = set(keep)
    pattern = f"{glob.escape(_temp_stem(dst.name))}.part-*"
    return sorted(p for p in dst.parent.glob(pattern) if p not in kept)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """`mkdir -p path`, each folder it creates fsynced into its parent.

    Why: a file's rename is made durable by fsyncing its folder, but a folder created for it
    (`<task id>/<torrent name>/...`) is only an entry in its own parent: after a power cut it
    could be gone, the file with it, while the ledger said copied. A folder a concurrent copy
    created is fsynced too: that copy may not have got there yet
    (`tests/integration/test_library_review.py::test_a_copy_into_new_folders_makes_each_new_folder_durable`).
    """
    missing: list[Path] = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        with contextlib.suppress(FileExistsError):  # a sibling file's copy made it first
            folder.mkdir()
        _fsync_dir(folder.parent)


def copy_file(
    src: Path,
    dst: Path,
    token: str,
    *,
    checkpoint: Callable[[], None] = lambda: None,
    progress: Callable[[int, int], None] | None = None,
    chunk: int = CHUNK,
    expect_sha256: str | None = None,
) -> dict[str, object]:
    """Copy `src` to `dst` durably. `checkpoint()` runs before each chunk and may raise to stop.
    With `expect_sha256`, bytes of another digest never reach `dst` (`DigestMismatch`, checked
    before the fsync and the rename; the temp file is removed): the sha256 is the one this
    copy computes anyway, so the check costs one comparison.

    The destination appears only complete (rename after fsync, of the file, of its folder and of
    every folder created for it); an interrupted copy leaves a
    `.part-<token>` file that compensation or the next attempt removes. The sha256 is of the
    bytes written: each chunk is read once into one of two reusable buffers, then written from
    it while a helper thread hashes the same buffer (hashlib and file I/O release the GIL), so
    hashing overlaps writing and reading the next chunk instead of adding to them. The write
    side streams (`_Writeback`): writeback of each chunk starts as soon as it is written, and a
    chunk `_Writeback.LAG` chunks back is waited for and dropped from the page cache, so the
    final fsync has little left to wait for and the copy recycles a few chunks' worth of page
    cache instead of filling it with the whole file; durability still rests on that fsync.
    """
    make_dirs(dst.parent)
    tmp = temp_path(dst, token)
    total = src.stat().st_size
    h = hashlib.sha256()
    done = 0
    buffers = (bytearray(chunk), bytearray(chunk))
    try:
        with (
            src.open("rb", buffering=0) as fin,
            tmp.open("wb", buffering=0) as fout,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-sha256") as hasher,
        ):
            _advise_sequential(fin.fileno())
            writeback = _Writeback(fout.fileno())
            hashing: Future[None] | None = None  # the previous chunk's hash (its buffer is busy)
            turn = 0
            while True:
                checkpoint()
                buf = buffers[turn]
                n = fin.readinto(buf)
                if not n:
                    break
                view = memoryview(buf)[:n]
                if hashing is not None:
                    hashing.result()  # chunks are hashed in order, one at a time
                hashing = hasher.submit(h.update, view)
                _write_all(fout, view)
                writeback.written(done, n)
                done += n
                turn ^= 1  # the next read goes to the other buffer while this one is hashed
                if progress is not None:
                    progress(done, total)
            if hashing is not None:
                hashing.result()
            if expect_sha256 is not None and h.hexdigest() != expect_sha256:
                raise DigestMismatch(src, expect_sha256, h.hexdigest())
            os.fsync(fout.fileno())
        checkpoint()
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LibraryFull(dst.parent, total, free_bytes(dst.parent)) from exc
        raise
    return {"path": str(dst), "size": done, "sha256": h.hexdigest()}


def _write_all(fout: BinaryIO, view: memoryview) -> None:
    """An unbuffered write may be short: write until the whole chunk is out."""
    off = 0
    while off < len(view):
        off += fout.write(view[off:]) or 0


# sync_file_range(2) flags (linux/fs.h)
_SFR_WAIT_BEFORE, _SFR_WRITE, _SFR_WAIT_AFTER = 1, 2, 4


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Linux only; Python has no binding). None where unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # a ctypes call releases the GIL while it waits


_sync_file_range = _load_sync_file_range()


class _Writeback:
    """Streaming writes of one file: start writing each chunk to disk as soon as it is written,
    and once `LAG` newer chunks are in flight, wait for that chunk's writeback and drop its now
    clean pages from the page cache (the classic sync_file_range + POSIX_FADV_DONTNEED pattern).

    So the disk works while the copy goes on, the final fsync has at most `LAG` chunks left to
    wait for, dirty memory stays bounded, and the copy reuses a few chunks' worth of page cache
    instead of taking (and evicting other data for) a whole file's worth. Hints only: errors are
    ignored, a write error still surfaces at the fsync. Without sync_file_range (not Linux),
    POSIX_FADV_DONTNEED alone starts writeback on Linux and is a no-op elsewhere."""

    LAG = 2

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.spans: deque[tuple[int, int]] = deque()

    def written(self, offset: int, length: int) -> None:
        if _sync_file_range is None:
            _fadvise_dontneed(self.fd, offset, length)
            return
        _sync_file_range(self.fd, offset, length, _SFR_WRITE)
        self.spans.append((offset, length))
        if len(self.spans) > self.LAG:
            old, size = self.spans.popleft()
            _sync_file_range(self.fd, old, size, _SFR_WAIT_BEFORE | _SFR_WRITE | _SFR_WAIT_AFTER)
            _fadvise_dontneed(self.fd, old, size)


def _fadvise_dontneed(fd: int, offset: int, length: int) -> None:
    """Linux: start async writeback of these pages, then drop those already clean."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _advise_sequential(fd: int) -> None:
    """Tell the kernel we read front to back (larger read-ahead); a hint, ignored where absent."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)


def remove_temp_files(dst: Path, keep: Collection[Path] = ()) -> int:
    """Remove `dst`'s temp files (`temp_files`), never a path in `keep`; how many were removed."""
    n = 0
    for p in temp_files(dst, keep):
        p.unlink(missing_ok=True)
        n += 1
    return n


def file_id(path: Path) -> dict[str, int]:
    """The (device, inode) naming the file now at `path`: what a copy records to know its file later."""
    st = path.stat()
    return {"dev": st.st_dev, "ino": st.st_ino}


def remove_if_same_file(path: Path, dev: int, ino: int) -> bool:
    """Remove `path` only if it is still the file (`dev`, `ino`) a copy made; whether it was.

    Why: a relocate given up (its compensation) or refused at its switch must remove the copy it
    made and nothing else, while a later relocate to the same root may put its own file at the
    same path at any moment (`copy_file`'s rename). The file is first renamed aside (a name of
    its own, atomic), so the inode checked is the inode removed; a file that is not ours goes
    back unless a newer one took its place meanwhile
    (`tests/integration/test_library_leftovers.py::test_giving_up_a_relocate_removes_only_the_file_it_copied`).
    The aside name is not a temp file's (`temp_files` never takes it) and is the same for every
    call about this copy, so a call that died with a library file set aside is settled by the next
    one, which puts it back (`tests/unit/test_library_aside.py`).
    """
    aside = aside_path(path, dev, ino)
    removed = settle_aside(path, dev, ino)  # an earlier call that died midway
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return removed
    return settle_aside(path, dev, ino) or removed


def aside_path(path: Path, dev: int, ino: int) -> Path:
    """Where `remove_if_same_file` sets `path` aside while it checks it is the copy (`dev`, `ino`)."""
    token = hashlib.sha256(f"{dev}:{ino}".encode()).hexdigest()[:TOKEN_CHARS]
    return path.with_name(f"{_temp_stem(path.name)}.keep-{token}")


def settle_aside(path: Path, dev: int, ino: int) -> bool:
    """The file a `remove_if_same_file(path, dev, ino)` that died midway left set aside: removed if
    it is the copy (`dev`, `ino`), else put back at `path` unless a newer file took it meanwhile
    (then it is stale); whether it was removed as ours. Nothing set aside: False.

    A caller that looks at `path` before removing must settle first: a library file set aside
    is missing from `path` until then (`tests/integration/test_library_leftovers.py::
    test_giving_up_a_relocate_again_puts_back_a_library_file_a_killed_give_up_set_aside`)."""
    aside = aside_path(path, dev, ino)
    try:
        st = aside.stat()
    except FileNotFoundError:
        return False
    ours = (st.st_dev, st.st_ino) == (dev, ino)
    if not ours:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    aside.unlink()
    _fsync_dir(path.parent)
    return ours
