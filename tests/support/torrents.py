"""Torrents that torf itself would not create, built with just enough bencoding: names escaping
the library and clashes (the bad-input tests), padding files (`padded`)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def bencode(v: object) -> bytes:
    if isinstance(v, int):
        return b"i%de" % v
    if isinstance(v, str):
        v = v.encode()
    if isinstance(v, bytes):
        return b"%d:%s" % (len(v), v)
    if isinstance(v, list):
        return b"l" + b"".join(bencode(x) for x in v) + b"e"
    if isinstance(v, dict):
        return b"d" + b"".join(bencode(k) + bencode(v[k]) for k in sorted(v)) + b"e"
    raise TypeError(type(v))


def multi_file(*paths: list[str], name: str = "show") -> bytes:
    """A multi-file torrent of these path segment lists (10 bytes each, one dummy piece)."""
    info = {
        "name": name,
        "piece length": 16384,
        "pieces": b"\x00" * 20,
        "files": [{"path": p, "length": 10} for p in paths],
    }
    return bencode({"announce": "http://127.0.0.1/announce", "info": info})


def padded(root: Path, piece: int, *, legacy: bool = False, trailing: bool = False) -> tuple[bytes, str]:
    """A multi-file torrent of the files under `root` (sorted) with a padding file (BEP 47) after
    each but the last, so that every file starts on a piece boundary: what libtorrent makes of a
    hybrid v1/v2 torrent. `legacy`: padding named BitComet's way with no `attr`; `trailing`: one
    after the last file too. Returns the metainfo and its infohash."""
    files: list[dict[str, object]] = []
    stream = bytearray()
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    for i, path in enumerate(paths):
        data = path.read_bytes()
        files.append({"length": len(data), "path": list(path.relative_to(root).parts)})
        stream += data
        gap = -len(stream) % piece
        if gap and (i < len(paths) - 1 or trailing):
            if legacy:
                files.append({"length": gap, "path": [f"_____padding_file_{i}_if you see this file, update"]})
            else:
                files.append({"length": gap, "path": [".pad", str(gap)], "attr": "p"})
            stream += bytes(gap)
    pieces = b"".join(hashlib.sha1(stream[o : o + piece]).digest() for o in range(0, len(stream), piece))
    info = {"name": root.name, "piece length": piece, "pieces": pieces, "files": files}
    return bencode({"info": info}), hashlib.sha1(bencode(info)).hexdigest()
