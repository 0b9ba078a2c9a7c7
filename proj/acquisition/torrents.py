"""Torrent metadata: parse, validate (bad input never reaches the library) and verify pieces."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

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
    name: str
    infohash: str
    files: tuple[TorrentFile, ...]
    total_size: int
    # Multi-file metadata (`info.files`) keeps its folder `<name>/` even when it lists one file
    # named like the torrent; only single-file metadata (`info.length`) is the file `<name>`.
    multi_file: bool = False


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
    """
    if max_bytes is None:
        max_bytes = CEILING_TORRENT_BYTES
    if not isinstance(data, bytes | bytearray) or not data:
        raise BadTorrent("empty torrent")
    if len(data) > max_bytes:
        raise TorrentTooLarge(f"torrent metadata is {len(data)} bytes, limit {max_bytes}")
    try:
        t = torf.Torrent.read_stream(io.BytesIO(bytes(data)), validate=False)
        meta_info = t.metainfo["info"]
        name = _text(meta_info["name"])
        multi = "files" in meta_info
        if multi:
            raw = [("/".join(_segment(s) for s in f["path"]), int(f["length"])) for f in meta_info["files"]]
        else:
            raw = [(name, int(meta_info["length"]))]
        infohash = t.infohash.lower()
    except BadTorrent:
        raise
    except Exception as exc:  # torf raises many kinds of errors for junk
        raise BadTorrent(f"unreadable torrent: {exc}") from exc
    safe_relative(name)
    files = tuple(TorrentFile(safe_relative(p), size) for p, size in raw)
    if any(f.size < 0 for f in files):
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
    return TorrentMeta(name, infohash, files, sum(f.size for f in files), multi_file=multi)


def library_rel(meta: TorrentMeta, f: TorrentFile) -> str:
    """A file's path below its task's library folder: `<torrent name>[/<file path>]`."""
    return f"{meta.name}/{f.rel_path}" if meta.multi_file else meta.name


def source_path(meta: TorrentMeta, save_path: Path, f: TorrentFile) -> Path:
    if not meta.multi_file:
        return save_path / meta.name
    return save_path / meta.name / f.rel_path


def verify_pieces(data: bytes, save_path: Path) -> None:
    """Check sizes and every piece hash of the downloaded payload against the metadata."""
    t = torf.Torrent.read_stream(io.BytesIO(bytes(data)))
    target = save_path / t.name
    try:
        ok = t.verify(str(target))
    except torf.TorfError as exc:
        raise BadTorrent(f"payload does not match the torrent: {exc}") from exc
    if not ok:
        raise BadTorrent("payload does not match the torrent's piece hashes")
