"""Torrent parsing (DESIGN §5: names that escape the library never get in) and settings, with
no service at all."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torf
from pydantic import ValidationError

from proj import db
from proj.acquisition.torrents import BadTorrent, TorrentTooLarge, parse, verify_pieces
from proj.settings import Settings
from tests.support.torrents import bencode, multi_file


def real_torrent(tmp_path: Path) -> tuple[bytes, Path]:
    content = tmp_path / "album"
    (content / "cd1").mkdir(parents=True)
    (content / "cd1" / "a.flac").write_bytes(b"a" * 40000)
    (content / "b.txt").write_bytes(b"b" * 10)
    t = torf.Torrent(path=content, private=True)
    t.generate()
    return t.dump(), tmp_path


def test_a_real_multi_file_torrent_parses_with_its_files_and_infohash(tmp_path: Path) -> None:
    data, _ = real_torrent(tmp_path)
    meta = parse(data)
    assert meta.name == "album"
    assert sorted((f.rel_path, f.size) for f in meta.files) == [("b.txt", 10), ("cd1/a.flac", 40000)]
    assert meta.total_size == 40010
    assert len(meta.infohash) == 40 and meta.infohash == meta.infohash.lower()


def test_pieces_are_verified_against_the_payload(tmp_path: Path) -> None:
    data, save = real_torrent(tmp_path)
    verify_pieces(data, save)  # the payload as created
    (save / "album" / "cd1" / "a.flac").write_bytes(b"x" * 40000)  # same size, other bytes
    with pytest.raises(BadTorrent, match="piece hashes|does not match"):
        verify_pieces(data, save)


def test_the_piece_check_gives_each_files_sha256_and_can_check_one_file(tmp_path: Path) -> None:
    """The import notes each file's sha256 from the read that checked its pieces, the digest
    its copy must reproduce; `only=` checks the pieces covering one file (its neighbours' bytes
    in a piece it shares with them too), what a copy that read other bytes checks again."""
    data, save = real_torrent(tmp_path)
    album = save / "album"
    want = {rel: hashlib.sha256((album / rel).read_bytes()).hexdigest() for rel in ("b.txt", "cd1/a.flac")}
    assert verify_pieces(data, save) == want
    assert verify_pieces(data, save, only="b.txt")["b.txt"] == want["b.txt"]

    (album / "b.txt").write_bytes(b"c" * 10)  # b.txt and a.flac's start share the first piece
    with pytest.raises(BadTorrent, match="piece hashes"):
        verify_pieces(data, save, only="cd1/a.flac")
    (album / "b.txt").write_bytes(b"c" * 9)
    with pytest.raises(BadTorrent, match="does not match the torrent: .*b.txt: Unexpected file size"):
        verify_pieces(data, save, only="b.txt")


@pytest.mark.parametrize(
    ("paths", "name", "reason"),
    [
        ([["..", "etc", "passwd"]], "pack", "escapes|unsafe"),
        ([["ok", "..", "..", "x"]], "pack", "escapes|unsafe"),
        ([["/abs"]], "pack", "unsafe|escapes"),
        ([["a"]], "../up", "escapes|unsafe"),
        ([["same"], ["same"]], "pack", "same path"),
        ([["d"], ["d", "f"]], "pack", "both a file and a folder"),
    ],
)
def test_file_names_that_escape_or_clash_are_refused(paths: list[list[str]], name: str, reason: str) -> None:
    with pytest.raises(BadTorrent, match=reason):
        parse(multi_file(*paths, name=name))


def test_junk_empty_and_oversized_torrents_are_refused() -> None:
    with pytest.raises(BadTorrent, match="empty"):
        parse(b"")
    with pytest.raises(BadTorrent, match="unreadable"):
        parse(b"this is not bencode" * 10)
    good = multi_file(["a"])
    assert parse(good).files[0].rel_path == "a"
    with pytest.raises(TorrentTooLarge):
        parse(good, max_bytes=len(good) - 1)


def test_settings_refuse_impossible_values_and_hide_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEASE_TTL_S", "0.1")
    with pytest.raises(ValidationError, match="lease_ttl_s"):
        Settings()
    monkeypatch.setenv("LEASE_TTL_S", "15")
    monkeypatch.setenv("QBT_PASSWORD", "hunter2")
    s = Settings()
    assert s.lease_ttl_s == 15.0
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.model_dump())


@pytest.mark.parametrize("multi", [False, True])
def test_a_name_that_is_not_utf8_is_refused_saying_so(multi: bool) -> None:
    """A Latin-1 name (`café.bin` from an old client) was refused as an "unsafe file name in
    torrent: \"b'caf\\\\xe9.bin'\"", as if it tried to escape the library; now the reason is the
    encoding, with the name shown."""
    info: dict[str, object] = {"name": b"caf\xe9.bin" if not multi else "show", "piece length": 16384}
    info["pieces"] = b"\x00" * 20
    if multi:
        info["files"] = [{"path": [b"caf\xe9.bin"], "length": 5}]
    else:
        info["length"] = 5
    with pytest.raises(BadTorrent) as err:
        parse(bencode({"info": info}))
    assert "not UTF-8" in str(err.value) and "caf\\xe9.bin" in str(err.value), str(err.value)
    assert "unsafe" not in str(err.value)


def test_every_session_bounds_its_idle_transactions_but_behind_a_transaction_pooler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`DB_IDLE_IN_TRANSACTION_S` is set on every session of ours, directly or through PgBouncer
    in session mode; never behind a transaction pooler, whose server connections other clients
    share (PgBouncer's own setting does it there)."""
    monkeypatch.delenv("DB_IDLE_IN_TRANSACTION_S", raising=False)
    for pooler in ("none", "session"):
        monkeypatch.setenv("DB_POOLER", pooler)
        assert db.idle_in_transaction_ms(Settings()) == 60_000
    monkeypatch.setenv("DB_POOLER", "transaction")
    assert db.idle_in_transaction_ms(Settings()) == 0
    monkeypatch.setenv("DB_POOLER", "none")
    monkeypatch.setenv("DB_IDLE_IN_TRANSACTION_S", "0")
    assert db.idle_in_transaction_ms(Settings()) == 0
