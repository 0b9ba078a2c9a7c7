"""Torrents that torf itself would refuse to create (names escaping the library, clashes), for
the bad-input tests: just enough bencoding."""

from __future__ import annotations


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
