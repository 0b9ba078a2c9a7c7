"""Padding files (BEP 47): zeros that the pieces hash but that lie on no disk. Beside them, the
entries of newer torrents the import cannot take are refused saying so: a symbolic link (BEP 47)
and a v2-only torrent (BEP 52).

libtorrent writes no padding file, and a hybrid v1/v2 torrent has one after nearly every file.
Before, they were payload like any file: the piece check failed on the first one ("payload
does not match the torrent: …/.pad/…: No such file or directory") and every import of such a
torrent spent its attempts and became a dead letter. A real qBittorrent downloading one, through
the whole pipeline: `tests/integration/test_padding_files.py`."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torf

from proj.acquisition.torrents import BadTorrent, Padding, parse, verify_pieces
from tests.support.torrents import bencode, hybrid, padded

PIECE = 16384
SIZES = {"a.bin": 20_000, "sub/b.bin": 5_000, "z.bin": 40_000}


def payload(tmp_path: Path) -> Path:
    root = tmp_path / "Show"
    for i, (rel, size) in enumerate(SIZES.items()):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(bytes([i + 1]) * 7 + hashlib.sha256(rel.encode()).digest() * (size // 32))
        with (root / rel).open("ab") as fh:
            fh.truncate(size)
    return root


def sha256s(root: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in SIZES}


@pytest.mark.parametrize("legacy", [False, True], ids=["attr-p", "bitcomet-name"])
@pytest.mark.parametrize("trailing", [False, True], ids=["between", "trailing-too"])
def test_padding_is_no_payload_and_its_pieces_check_without_it_on_disk(
    tmp_path: Path, legacy: bool, trailing: bool
) -> None:
    root = payload(tmp_path)
    torrent, infohash = padded(root, PIECE, legacy=legacy, trailing=trailing)

    meta = parse(torrent)
    assert meta.infohash == infohash
    assert [f.rel_path for f in meta.files] == list(SIZES)
    assert meta.total_size == sum(SIZES.values())
    pads = [e for e in meta.pieces_layout() if isinstance(e, Padding)]
    assert len(pads) == (3 if trailing else 2) and all(0 < p.size < PIECE for p in pads)

    assert verify_pieces(torrent, tmp_path) == sha256s(root)
    assert not (root / ".pad").exists()
    for rel in SIZES:  # one file's pieces, padding on either side
        assert verify_pieces(torrent, tmp_path, only=rel) == {rel: sha256s(root)[rel]}


def test_a_flipped_byte_next_to_padding_is_still_caught(tmp_path: Path) -> None:
    root = payload(tmp_path)
    torrent, _ = padded(root, PIECE)
    target = root / "sub/b.bin"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # the last byte before b's padding
    target.write_bytes(bytes(data))
    with pytest.raises(BadTorrent, match="piece hashes"):
        verify_pieces(torrent, tmp_path)
    with pytest.raises(BadTorrent, match="piece hashes"):
        verify_pieces(torrent, tmp_path, only="sub/b.bin")
    assert verify_pieces(torrent, tmp_path, only="z.bin") == {"z.bin": sha256s(root)["z.bin"]}


def test_an_entry_not_flagged_as_padding_is_payload(tmp_path: Path) -> None:
    """The flag decides, not the name `.pad/…`: the same entry without `attr` "p" is a payload
    file, looked for on disk and copied like any other."""
    root = payload(tmp_path)
    torrent, _ = padded(root, PIECE)
    plain = torrent.replace(b"4:attr1:p", b"4:attr1:x")
    assert plain != torrent
    assert ".pad/12768" in [f.rel_path for f in parse(plain).files]
    with pytest.raises(BadTorrent, match="payload does not match.*No such file"):
        verify_pieces(plain, tmp_path)


def test_a_v2_only_torrent_is_refused_saying_what_is_accepted() -> None:
    """A v2-only torrent (BEP 52: a `file tree`, no v1 `pieces`) was refused as "unreadable
    torrent: 'length'"; now the refusal says what it is and what is accepted (a hybrid one,
    padding and all, is: above)."""
    leaf = {"": {"length": 10, "pieces root": b"x" * 32}}
    info = {"name": "show", "piece length": 16384, "meta version": 2, "file tree": {"a.bin": leaf}}
    with pytest.raises(BadTorrent, match="v2-only torrent.*hybrid"):
        parse(bencode({"info": info, "piece layers": {}}))


@pytest.mark.parametrize("multi", [True, False], ids=["multi-file", "single-file"])
def test_a_torrent_holding_a_symlink_is_refused_at_the_door(multi: bool) -> None:
    """BEP 47's "l" entry becomes a link on disk (libtorrent makes it) to wherever its `symlink
    path` says. Before, it passed as a file of length 0: the piece check read through the link,
    and the request became a dead letter (or the copy put the target's bytes in the library)."""
    link = {"length": 0, "attr": "l", "symlink path": ["..", "..", "etc", "passwd"]}
    if multi:
        info = {"name": "show", "piece length": 16384, "pieces": b"\x00" * 20}
        info["files"] = [{"length": 10, "path": ["a.bin"]}, {**link, "path": ["evil"]}]
    else:
        info = {"name": "evil", "piece length": 16384, "pieces": b"", **link}
    with pytest.raises(BadTorrent, match="symbolic link"):
        parse(bencode({"info": info}))


def test_a_hybrid_torrent_is_named_by_its_v2_infohash_cut_to_40_digits(tmp_path: Path) -> None:
    """qBittorrent lists a hybrid torrent under its v2 infohash cut to 20 bytes, and a lookup by
    the v1 infohash finds nothing: the request must know it by the former (the v1 one it had
    before never got past adding the torrent). Its payload and pieces are the v1 view's."""
    root = payload(tmp_path)
    torrent, v1, listed_as = hybrid(root, PIECE)
    meta = parse(torrent)
    assert meta.infohash == listed_as != v1
    assert [f.rel_path for f in meta.files] == sorted(SIZES)
    assert verify_pieces(torrent, tmp_path) == sha256s(root)


def test_a_v1_torrent_is_named_by_the_sha1_of_its_info_bytes_as_they_stand(tmp_path: Path) -> None:
    """libtorrent hashes the `info` dictionary's bytes as the file holds them. A torrent whose
    `info` keys are not in bencoding's sorted order is still read; hashing it encoded again (as
    torf's `infohash` does) would name a torrent qBittorrent does not know."""
    root = payload(tmp_path)
    torrent, infohash = padded(root, PIECE)
    assert parse(torrent).infohash == infohash == hashlib.sha1(torrent[len(b"d4:info") : -1]).hexdigest()
    info = torf.Torrent.read_stream(io.BytesIO(torrent), validate=False).metainfo["info"]
    backwards = b"d" + b"".join(bencode(k) + bencode(info[k]) for k in sorted(info, reverse=True)) + b"e"
    meta = parse(b"d4:info" + backwards + b"e")
    assert meta.infohash == hashlib.sha1(backwards).hexdigest() != infohash
    assert meta.files == parse(torrent).files
