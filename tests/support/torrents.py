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


def _payload(root: Path) -> list[Path]:
    """The files under `root`, in the order a torrent lists them (sorted by path segments)."""
    return sorted(p for p in root.rglob("*") if p.is_file())


def _v1_padded(
    root: Path, piece: int, *, legacy: bool = False, trailing: bool = False
) -> tuple[list[dict[str, object]], bytes]:
    """The v1 `files` of the files under `root`, a padding file (BEP 47) after each but the last
    (`trailing`: the last too) so that every file starts on a piece boundary, and their `pieces`.
    `legacy`: padding named BitComet's way with no `attr`."""
    files: list[dict[str, object]] = []
    stream = bytearray()
    paths = _payload(root)
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
    return files, pieces


def padded(root: Path, piece: int, *, legacy: bool = False, trailing: bool = False) -> tuple[bytes, str]:
    """A multi-file v1 torrent of the files under `root` with padding files (`_v1_padded`): what
    libtorrent makes of a hybrid v1/v2 torrent, without the v2 part. Returns the metainfo and
    its infohash."""
    files, pieces = _v1_padded(root, piece, legacy=legacy, trailing=trailing)
    info = {"name": root.name, "piece length": piece, "pieces": pieces, "files": files}
    return bencode({"info": info}), hashlib.sha1(bencode(info)).hexdigest()


BLOCK = 16 * 1024  # BEP 52: the leaves of a file's merkle tree hash 16 KiB blocks


def _merkle_layers(data: bytes) -> list[list[bytes]]:
    """A file's SHA-256 merkle tree (BEP 52), leaves first: one leaf per 16 KiB block, the leaf
    count padded to a power of two with zero hashes."""
    leaves = [hashlib.sha256(data[o : o + BLOCK]).digest() for o in range(0, len(data), BLOCK)]
    width = 1 << max(0, (len(leaves) - 1).bit_length())
    layers = [leaves + [bytes(32)] * (width - len(leaves))]
    while len(layers[-1]) > 1:
        below = layers[-1]
        layers.append([hashlib.sha256(below[i] + below[i + 1]).digest() for i in range(0, len(below), 2)])
    return layers


def hybrid(root: Path, piece: int) -> tuple[bytes, str, str]:
    """A hybrid v1/v2 torrent (BEP 52 with BEP 47 padding) of the files under `root`, laid out as
    libtorrent lays one out: the v2 `file tree` and `piece layers`, and a v1 `files` list in the
    same (sorted) order with a padding file after every file that does not end on a piece
    boundary. Returns the metainfo, the v1 infohash and the torrent id qBittorrent names it by
    (the v2 infohash cut to 20 bytes)."""
    assert piece >= BLOCK and piece & (piece - 1) == 0, "BEP 52: a power of two, at least 16 KiB"
    tree: dict[str, object] = {}
    layers: dict[bytes, bytes] = {}
    for path in _payload(root):
        data = path.read_bytes()
        merkle = _merkle_layers(data)
        node = tree
        for part in path.relative_to(root).parts:
            node = node.setdefault(part, {})  # type: ignore[assignment]
        node[""] = {"length": len(data), "pieces root": merkle[-1][0]}
        if len(data) > piece:  # one hash per piece, from the layer whose nodes span a piece
            per_piece = merkle[(piece // BLOCK).bit_length() - 1]
            layers[merkle[-1][0]] = b"".join(per_piece[: -(-len(data) // piece)])
    files, pieces = _v1_padded(root, piece, trailing=True)
    info = {
        "name": root.name,
        "piece length": piece,
        "meta version": 2,
        "file tree": tree,
        "files": files,
        "pieces": pieces,
    }
    encoded = bencode(info)
    metainfo = bencode({"info": info, "piece layers": layers})
    return metainfo, hashlib.sha1(encoded).hexdigest(), hashlib.sha256(encoded).hexdigest()[:40]
