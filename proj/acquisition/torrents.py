"""Torrent metadata: parse, validate (bad input never reaches the library) and verify pieces."""

from __future__ import annotations

import bisect
import hashlib
import io
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, NamedTuple

import torf

from proj.engine.errors import BadInput

MAX_TORRENT_BYTES = 4 * 1024 * 1024  # the default of `MAX_TORRENT_BYTES` (settings)
CEILING_TORRENT_BYTES = 64 * 1024 * 1024  # the most that setting allows


class BadTorrent(BadInput):
    """Unreadable metadata, or a file name that would escape the library root."""


@dataclass(frozen=True)
class TorrentFile:
    """One file of the torrent, its path relative to the torrent's root folder."""

    rel_path: str
    size: int


@dataclass(frozen=True)
class TorrentMeta:
    """`files` and `total_size` are the payload: what is downloaded, verified and copied.

    `layout` is every entry of `info.files` in order, padding files included (BEP 47), for the
    piece check alone: padding is zeros that count in the pieces but lie on no disk (libtorrent
    writes none, and a hybrid v1/v2 torrent has one after nearly every file). Empty when the
    torrent has none: then it is `files`."""

    name: str
    # What qBittorrent names the torrent by (its `hash`, the id every API call takes): the v1
    # infohash, or for a hybrid v1/v2 torrent the v2 infohash cut to 40 hex digits (libtorrent's
    # `info_hash_t::get_best`). `torrent_id` computes it.
    infohash: str
    files: tuple[TorrentFile, ...]
    total_size: int
    # Multi-file metadata (`info.files`) keeps its folder `<name>/` even when it lists one file
    # named like the torrent; only single-file metadata (`info.length`) is the file `<name>`.
    multi_file: bool = False
    layout: tuple[TorrentFile | Padding, ...] = ()

    def pieces_layout(self) -> tuple[TorrentFile | Padding, ...]:
        """What the pieces hash, in order: the payload's files and the padding between them."""
        return self.layout or self.files


@dataclass(frozen=True)
class Padding:
    """A padding file (BEP 47): `size` zero bytes in the piece stream, never on disk."""

    size: int


# A padding file is flagged `attr` "p" (BEP 47); BitComet's older ones only by their name, which
# libtorrent (qBittorrent) also takes for padding.
LEGACY_PADDING_PREFIX = "_____padding_file_"


def _attr(entry: Any) -> str:
    """A file entry's BEP 47 attributes ("p" padding, "l" symlink, "x" executable, "h" hidden)."""
    attr = entry.get("attr", "")
    return bytes(attr).decode("ascii", "replace") if isinstance(attr, bytes | bytearray) else str(attr)


def _is_padding(entry: Any) -> bool:
    path = entry.get("path") or [""]
    last = path[-1] if isinstance(path, list) else ""
    if isinstance(last, bytes | bytearray):
        last = bytes(last).decode("utf-8", "replace")
    return "p" in _attr(entry) or str(last).startswith(LEGACY_PADDING_PREFIX)


def _refuse_symlink(entry: Any, path: str) -> None:
    """A symbolic link entry (BEP 47 "l"): libtorrent makes it a link on disk, pointing anywhere
    its `symlink path` says; the piece check would read through it and the copy would put the
    target's bytes in the library. Refused at the door, saying so
    (`tests/unit/test_padding_files.py::test_a_torrent_holding_a_symlink_is_refused_at_the_door`)."""
    if "l" in _attr(entry):
        raise BadTorrent(f"the torrent holds a symbolic link ({path}): such torrents are not imported")


NAME_MAX = 255  # bytes in one file or folder name (Linux filesystems, and most others)
# Bytes of a file's path below its task's library folder: PATH_MAX (4096) less room for the
# library root (or download folder) and the task's folder.
MAX_REL_PATH = 3072


def fits_filesystem(path: str) -> str:
    """Refuse a path the library cannot hold: a name over NAME_MAX or a path over MAX_REL_PATH.

    Why: such a torrent was accepted, downloaded in full, and then every import attempt failed
    (the name cannot be written; qBittorrent itself shortens or refuses it) until the request
    was a dead letter. Refused here, at every door, before anything is stored
    (`tests/integration/test_library_review.py::test_a_name_the_library_cannot_hold_is_refused_at_the_door`).
    """
    if len(path.encode("utf-8", "surrogateescape")) > MAX_REL_PATH:
        raise BadTorrent(f"path too long for the library (over {MAX_REL_PATH} bytes): {path[:80]!r}…")
    for seg in path.split("/"):
        if len(seg.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise BadTorrent(f"file name too long for the library (over {NAME_MAX} bytes): {seg[:80]!r}…")
    return path


def safe_relative(path: str) -> str:
    """Reject absolute paths, `..` and `.` segments and empty names: nothing may leave the root.

    The raw segments are checked, not `PurePosixPath.parts`, which silently drops empty and `.`
    segments (`a//b`, `a/./b`, a bare `.` naming the task folder itself).
    """
    if not path or "\\" in path or "\x00" in path:
        raise BadTorrent(f"unsafe file name in torrent: {path!r}")
    if PurePosixPath(path).is_absolute() or any(seg in ("..", ".", "") for seg in path.split("/")):
        raise BadTorrent(f"file name escapes the library root: {path!r}")
    return path


def _text(value: object) -> str:
    """A name from the metainfo as text. torf hands back the raw bytes of a name that is not
    UTF-8, whose `str()` (`b'caf\\xe9.bin'`) was then refused as an "unsafe file name"; qBittorrent and
    the library need UTF-8, so that is what the refusal says
    (`tests/unit/test_torrents_and_settings.py::test_a_name_that_is_not_utf8_is_refused_saying_so`)."""
    if isinstance(value, bytes | bytearray):
        shown = bytes(value).decode("utf-8", "backslashreplace")
        raise BadTorrent(f"file name in torrent is not UTF-8: {shown}")
    return str(value)


def _segment(seg: object) -> str:
    """One element of a multi-file torrent's `path` list: a plain, non-empty name."""
    s = _text(seg)
    if not s or "/" in s or s in (".", ".."):
        raise BadTorrent(f"unsafe path segment in torrent: {s!r}")
    return s


class TorrentTooLarge(BadTorrent):
    """More metadata than `MAX_TORRENT_BYTES` (the API answers 413)."""


def parse(data: bytes, *, max_bytes: int | None = None) -> TorrentMeta:
    """Parse and validate .torrent bytes; raises `BadTorrent` with a clear reason.

    New requests are held to `MAX_TORRENT_BYTES` (settings); a stored torrent, already admitted,
    is parsed again by the kinds under the ceiling only, so lowering the setting strands nothing.
    Padding files are left out of the payload (`TorrentMeta.layout`;
    `tests/integration/test_padding_files.py`).
    """
    return _parse(data, max_bytes)[0]


class _Pieces(NamedTuple):
    length: int
    hashes: bytes


def _parse(data: bytes, max_bytes: int | None) -> tuple[TorrentMeta, _Pieces]:
    """`parse`, with the piece length and table that `verify_pieces` checks against."""
    if max_bytes is None:
        max_bytes = CEILING_TORRENT_BYTES
    if not isinstance(data, bytes | bytearray) or not data:
        raise BadTorrent("empty torrent")
    if len(data) > max_bytes:
        raise TorrentTooLarge(f"torrent metadata is {len(data)} bytes, limit {max_bytes}")
    try:
        t = torf.Torrent.read_stream(io.BytesIO(bytes(data)), validate=False)
        meta_info = t.metainfo["info"]
        if "pieces" not in meta_info and "file tree" in meta_info:
            raise BadTorrent(
                "a BitTorrent v2-only torrent: it has no v1 piece table, which the import checks; "
                "v1 and hybrid (v1 + v2) torrents are accepted"
            )
        name = _text(meta_info["name"])
        multi = "files" in meta_info
        entries: list[tuple[str, int] | Padding] = []
        if multi:
            for entry in meta_info["files"]:
                if _is_padding(entry):
                    entries.append(Padding(int(entry["length"])))
                else:
                    path = "/".join(_segment(s) for s in entry["path"])
                    _refuse_symlink(entry, path)
                    entries.append((path, int(entry["length"])))
        else:
            _refuse_symlink(meta_info, name)
            entries.append((name, int(meta_info["length"])))
        pieces = _Pieces(int(meta_info.get("piece length", 0)), bytes(meta_info.get("pieces", b"")))
        infohash = torrent_id(data, hybrid=is_hybrid(meta_info))
    except BadTorrent:
        raise
    except Exception as exc:  # torf raises many kinds of errors for junk
        raise BadTorrent(f"unreadable torrent: {exc}") from exc
    safe_relative(name)
    layout = tuple(e if isinstance(e, Padding) else TorrentFile(safe_relative(e[0]), e[1]) for e in entries)
    files = tuple(e for e in layout if isinstance(e, TorrentFile))
    if any(e.size < 0 for e in layout):
        raise BadTorrent("negative file size")
    if not files:
        raise BadTorrent("the torrent lists no files")
    for f in files:
        fits_filesystem(f"{name}/{f.rel_path}" if multi else name)
    paths = {f.rel_path for f in files}
    if len(paths) != len(files):
        raise BadTorrent("two files of the torrent have the same path")
    folders = {p.rsplit("/", i)[0] for p in paths for i in range(1, p.count("/") + 1)}
    if clash := sorted(paths & folders):
        raise BadTorrent(f"{clash[0]!r} is both a file and a folder in the torrent")
    padded = layout if len(layout) > len(files) else ()
    meta = TorrentMeta(name, infohash, files, sum(f.size for f in files), multi_file=multi, layout=padded)
    return meta, pieces


def is_hybrid(info: Any) -> bool:
    """A hybrid v1/v2 torrent's `info` (BEP 52 `meta version` 2 and a v2 `file tree`, beside
    the v1 piece table; a v2-only one, without it, is refused by `parse`)."""
    return info.get("meta version") == 2 and "file tree" in info and "pieces" in info


def torrent_id(data: bytes, *, hybrid: bool) -> str:
    """The id qBittorrent (libtorrent 2) lists a torrent under: SHA-1 of the `info` dictionary's
    bytes as they stand in the file, or for a hybrid v1/v2 torrent its SHA-256 cut to 20 bytes.

    Why: every API call names a torrent by this id, and a hybrid torrent's v1 infohash finds
    nothing (`torrents_info(torrent_hashes=v1)` is empty), so its request never got past adding
    the torrent (`tests/integration/test_padding_files.py`, payload "hybrid"). The bytes are
    hashed as they stand, not encoded again, as libtorrent hashes them."""
    raw = _info_bytes(bytes(data))
    return hashlib.sha256(raw).hexdigest()[:40] if hybrid else hashlib.sha1(raw).hexdigest()


def _info_bytes(data: bytes) -> bytes:
    """The bencoded `info` value of a metainfo file (already parsed, so well formed)."""
    i = 1  # past the top-level dictionary's "d"
    while data[i : i + 1] != b"e":
        key_end = _value_end(data, i)
        value_end = _value_end(data, key_end)
        if data[data.index(b":", i) + 1 : key_end] == b"info":
            return data[key_end:value_end]
        i = value_end
    raise BadTorrent("the torrent has no info dictionary")


def _value_end(data: bytes, i: int) -> int:
    """Where the bencoded value starting at `i` ends (iterative: nesting depth is the file's)."""
    depth = 0
    while True:
        c = data[i : i + 1]
        if c in (b"l", b"d"):
            depth, i = depth + 1, i + 1
            continue
        if c == b"e":
            depth, i = depth - 1, i + 1
        elif c == b"i":
            i = data.index(b"e", i) + 1
        else:
            colon = data.index(b":", i)
            i = colon + 1 + int(data[i:colon])
        if depth == 0:
            return i


def library_rel(meta: TorrentMeta, f: TorrentFile) -> str:
    """A file's path below its task's library folder: `<torrent name>[/<file path>]`."""
    return f"{meta.name}/{f.rel_path}" if meta.multi_file else meta.name


def source_path(meta: TorrentMeta, save_path: Path, f: TorrentFile) -> Path:
    if not meta.multi_file:
        return save_path / meta.name
    return save_path / meta.name / f.rel_path


READ_BLOCK = 8 * 1024 * 1024  # bytes read at a time by `verify_pieces` (whole pieces, at least one)
SHA1_LEN = 20


@dataclass(frozen=True)
class _Placed:
    """A file of the torrent where it lies on disk and where its bytes start in the torrent's
    byte stream (its files one after another, in the metadata's order: what pieces hash)."""

    file: TorrentFile | Padding
    path: Path | None  # None: padding, zeros on no disk
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.file.size

    def is_file(self, rel_path: str | None = None) -> bool:
        """A payload file (not padding); with `rel_path`, that one."""
        return isinstance(self.file, TorrentFile) and (rel_path is None or self.file.rel_path == rel_path)


def _placed(meta: TorrentMeta, save_path: Path) -> list[_Placed]:
    out: list[_Placed] = []
    offset = 0
    for f in meta.pieces_layout():
        path = source_path(meta, save_path, f) if isinstance(f, TorrentFile) else None
        out.append(_Placed(f, path, offset))
        offset += f.size
    return out


def _span(placed: list[_Placed], piece: int, total: int, only: str | None) -> tuple[int, int]:
    """The bytes to read: every piece, or the whole pieces that cover the file `only`."""
    if only is None:
        return 0, total
    p = next((p for p in placed if p.is_file(only)), None)
    if p is None:
        raise BadTorrent(f"no file {only!r} in the torrent")
    if p.file.size == 0:
        return p.offset, p.offset
    return p.offset // piece * piece, min(total, -(-p.end // piece) * piece)


def _touches(p: _Placed, start: int, end: int, only: str) -> bool:
    return (p.offset < end and p.end > start) or p.is_file(only)


def _check_sizes(files: list[_Placed]) -> None:
    """A file missing or of another size fails before a byte is hashed (torf's wording kept)."""
    for p in files:
        if p.path is None:
            continue
        try:
            size = p.path.stat().st_size
        except OSError as exc:
            raise BadTorrent(f"payload does not match the torrent: {p.path}: {exc.strerror}") from exc
        if size != p.file.size:
            raise BadTorrent(
                f"payload does not match the torrent: {p.path}: Unexpected file size: "
                f"{size} instead of {p.file.size} bytes"
            )


class _Stream:
    """The files touching [start, end) read as one stream, front to back, one open file at a time."""

    def __init__(self, files: list[_Placed], start: int) -> None:
        self.files, self.pos, self.i = [p for p in files if p.file.size], start, -1
        self.fh: BinaryIO | None = None

    def _current(self) -> _Placed | None:
        """The file holding byte `pos`, opened and positioned there (the next one once read)."""
        if 0 <= self.i < len(self.files) and self.files[self.i].offset <= self.pos < self.files[self.i].end:
            return self.files[self.i]
        self.close()
        self.i += 1
        while self.i < len(self.files) and self.files[self.i].end <= self.pos:
            self.i += 1
        if self.i >= len(self.files):
            return None
        p = self.files[self.i]
        if p.path is not None:
            self.fh = p.path.open("rb", buffering=0)
            self.fh.seek(self.pos - p.offset)
        return p

    def readinto(self, view: memoryview) -> int:
        got = 0
        while got < len(view) and (p := self._current()) is not None:
            want = min(len(view) - got, p.end - self.pos)
            if p.path is None:  # padding: zeros, read from no file
                view[got : got + want] = bytes(want)
                got += want
                self.pos += want
                continue
            assert self.fh is not None
            n = self.fh.readinto(view[got : got + want]) or 0
            if n == 0:  # shrank since its size was checked
                raise BadTorrent(f"payload does not match the torrent: {p.path} ended early")
            got += n
            self.pos += n
        return got

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.fh = None


def _first_bad_piece(view: memoryview, first: int, piece: int, hashes: bytes) -> int | None:
    """The first of these whole pieces (numbered from `first`) whose SHA-1 is not the metadata's."""
    for i, off in enumerate(range(0, len(view), piece)):
        k = first + i
        if hashlib.sha1(view[off : off + piece]).digest() != hashes[k * SHA1_LEN : (k + 1) * SHA1_LEN]:
            return k
    return None


class _Digests:
    """The sha256 of each file read whole, fed the stream block by block, in order."""

    def __init__(self, files: list[_Placed]) -> None:
        self.files = files  # in stream order
        self.ends = [p.end for p in files]
        self.sums = [hashlib.sha256() for _ in files]

    def feed(self, view: memoryview, at: int) -> None:
        """Add the bytes of `view` (from stream offset `at`) to the files they belong to: only
        those (found by bisection), so a torrent of many files costs no more per block."""
        end = at + len(view)
        i = bisect.bisect_right(self.ends, at)
        while i < len(self.files) and self.files[i].offset < end:
            p = self.files[i]
            self.sums[i].update(view[max(p.offset, at) - at : min(p.end, end) - at])
            i += 1

    def hexdigests(self) -> dict[str, str]:
        return {
            p.file.rel_path: h.hexdigest()
            for p, h in zip(self.files, self.sums, strict=True)
            if isinstance(p.file, TorrentFile)
        }


def verify_pieces(data: bytes, save_path: Path, *, only: str | None = None) -> dict[str, str]:
    """Check sizes and every piece hash of the downloaded payload (or, with `only`, the pieces
    covering that one file) against the metadata; return the sha256 of each file read whole.

    One read of the bytes gives both hashes: each block is checked piece by piece (SHA-1) on
    one helper thread while another adds it to its files' sha256, and the next block is read
    meanwhile. So the sha256 is of exactly the bytes whose pieces matched, and `copy_one` can
    refuse a copy of any other bytes: rot after the check that keeps the file's size and mtime
    (`tests/integration/test_library_leftovers.py::
    test_a_download_rotting_after_its_piece_check_never_reaches_the_library`).

    Cost: one more hash of every byte than torf's piece check alone, which this replaces. On 2
    vCPU (AMD EPYC, SHA extensions) 1 GiB took 0.77 s cached and 1.00 s dropped from the page
    cache, torf 0.33 s and 0.38 s; a disk slower than the hashes (about 2 GB/s each) hides it.
    """
    meta, (piece, hashes) = _parse(data, None)
    placed = _placed(meta, save_path)
    total = placed[-1].end if placed else 0
    if piece <= 0 or len(hashes) != -(-total // piece) * SHA1_LEN:
        raise BadTorrent("payload does not match the torrent: its piece table does not fit its files")
    start, end = _span(placed, piece, total, only)
    touched = placed if only is None else [p for p in placed if _touches(p, start, end, only)]
    _check_sizes(touched)
    digests = _Digests([p for p in touched if p.is_file() and start <= p.offset and p.end <= end])
    _hash_span(_Stream(touched, start), start, end, piece, hashes, digests)
    return digests.hexdigests()


def _hash_span(stream: _Stream, start: int, end: int, piece: int, hashes: bytes, digests: _Digests) -> None:
    """Read [start, end) once, in blocks of whole pieces into two reusable buffers; the SHA-1
    check and the sha256 of a block run on two threads (hashlib releases the GIL) while the
    next block is read into the other buffer."""
    block = max(1, READ_BLOCK // piece) * piece
    buffers = (bytearray(block), bytearray(block))
    pending: list[Future[Any]] = []
    bad: int | None = None
    at, turn = start, 0
    try:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="verify-hash") as pool:
            while at < end and bad is None:
                view = memoryview(buffers[turn])[: min(block, end - at)]
                n = stream.readinto(view)
                if n < len(view):
                    raise BadTorrent("payload does not match the torrent: a file ended early")
                bad = _wait(pending)  # the previous block's: each sha256 takes its blocks in order
                pending = [
                    pool.submit(_first_bad_piece, view, at // piece, piece, hashes),
                    pool.submit(digests.feed, view, at),
                ]
                at += n
                turn ^= 1
            bad = bad if bad is not None else _wait(pending)
    finally:
        stream.close()
    if bad is not None:
        raise BadTorrent(f"payload does not match the torrent's piece hashes (piece {bad})")


def _wait(pending: list[Future[Any]]) -> int | None:
    """Wait for one block's two hashing jobs; the bad piece the SHA-1 check found, if any."""
    results = [f.result() for f in pending]
    return results[0] if results else None
