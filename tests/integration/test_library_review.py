"""A review of the library file operations (`proj/acquisition/library.py`, `proj/kinds/importing.py`,
`verify_library.py`, `relocate.py`): each test here failed on the code before its fix.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import pytest
import torf
from sqlalchemy.orm import Session

import proj.celery  # noqa: F401 - registers every kind
from proj import db
from proj.acquisition import library, torrents
from proj.acquisition.models import DownloadTask, LibraryItem
from proj.engine import runs
from tests.conftest import new_key
from tests.integration.test_relocate_overlap import REL, copies, library_item, relocate, wait_ended
from tests.support.services import scalar, sql, wait_for
from tests.support.torrents import bencode


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


# ------------------------------------------------------------------ verify_library, root gone


def stash_root(root: Path, how: str) -> Path:
    """The disk under `root` goes away as an operator sees it happen: the mount point itself
    is gone (`missing`), or it stays as the empty directory it is without its disk (`unmounted`)."""
    away = root.with_name(root.name + "-away")
    root.rename(away)
    if how == "unmounted":
        root.mkdir()
    return away


@pytest.mark.parametrize("how", ["missing", "unmounted"])
def test_verify_library_with_its_disk_gone_flags_the_root_not_every_file(
    procs, tmp_path: Path, how: str
) -> None:
    """A library on a NAS whose mount dropped: every file is missing at once. Before: each
    item was marked corrupt and a re-import of every request queued, copying the whole library
    again into the bare mount point (on the system disk). Now the root is flagged unavailable,
    its items keep their status and nothing is re-imported; a root that is there is checked."""
    nas, local = tmp_path / "nas", tmp_path / "local"
    gone = [library_item(nas)[0] for _ in range(2)]
    kept, kept_task, _ = library_item(local)
    flip_bytes(local / str(kept_task) / REL)  # a real corruption on a disk that is there
    away = stash_root(nas, how)
    env = {"LIBRARY_ROOT": str(local)}
    procs.worker("w1", concurrency=1, env=env)
    procs.beat(env=env)

    run_id = enqueue_periodic("verify_library", 11)
    assert wait_ended(procs, run_id) == "succeeded"

    statuses = dict(sql("SELECT id, status FROM acq.library_item"))
    assert [statuses[i] for i in gone] == ["ok", "ok"], statuses
    assert statuses[kept] == "corrupt"
    reimports = sql("SELECT idempotency_key FROM outbox.outbox_event WHERE kind = 'import'")
    assert reimports == [(f"reimport:{kept_task}:11",)]
    assert sql("SELECT kind, subject FROM acq.flag ORDER BY kind") == [
        ("corrupt_file", str(kept)),
        ("library_root_unavailable", str(nas)),
    ]
    assert how == "missing" or not any(nas.iterdir()), "nothing was written into the bare mount point"
    assert away.exists()


# -------------------------------------------------------------------- relocate of a rotten file


def test_relocate_refuses_a_copy_whose_bytes_are_not_the_recorded_ones(procs, tmp_path: Path) -> None:
    """The file to move has rotted (same size, other bytes). Before: relocate copied the rotten
    bytes, switched the row to them and deleted the original, so the library claimed a digest
    its only copy no longer had. Now the copy is checked against the item's recorded sha256: the
    run fails naming the mismatch, the new root holds nothing and the row and file stay put
    (for `verify_library` to flag and re-import)."""
    a, b = tmp_path / "lib-a", tmp_path / "lib-b"
    item_id, task_id, digest = library_item(a)
    original = a / str(task_id) / REL
    flip_bytes(original)
    rotten = sha256(original)
    procs.worker("w1", concurrency=1)
    procs.beat()

    run_id = relocate(item_id, b)
    assert wait_ended(procs, run_id) == "failed"
    error = str(scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (run_id,)))
    assert digest in error and rotten in error, error
    assert scalar("SELECT root FROM acq.library_item WHERE id = %s", (item_id,)) == str(a)
    assert sha256(original) == rotten, "the only copy stays"
    assert copies(task_id, b) == []


# ------------------------------------------------------------ re-import of a relocated item


def make_torrent(downloads: Path, name: str, files: dict[str, bytes]) -> torf.Torrent:
    """A multi-file torrent of `files`, downloaded already into `downloads/<name>/`."""
    folder = downloads / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    t = torf.Torrent(path=folder, piece_size=16384)
    t.generate()
    return t


def torrent_task(s: Session, t: torf.Torrent, files: dict[str, bytes], status: str) -> uuid.UUID:
    """A request of torrent `t` (holding `files`) in `status`, added to `s` and flushed."""
    task_id = uuid.uuid4()
    s.add(
        DownloadTask(
            id=task_id,
            requester="olga",
            title=t.name,
            infohash=t.infohash.lower(),
            torrent=t.dump(),
            files=[{"rel_path": rel, "size": len(data)} for rel, data in files.items()],
            total_size=sum(len(d) for d in files.values()),
            status=status,
        )
    )
    s.flush()
    return task_id


def imported_task(t: torf.Torrent, files: dict[str, bytes], roots: dict[str, Path]) -> uuid.UUID:
    """A notified request whose file `rel` lies in the library under `roots[rel]`."""
    with db.sessions().begin() as s:
        task_id = torrent_task(s, t, files, "notified")
        for rel, data in files.items():
            path = roots[rel] / str(task_id) / t.name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            digest = hashlib.sha256(data).hexdigest()
            lib_rel = f"{t.name}/{rel}"
            s.add(
                LibraryItem(
                    download_task_id=task_id,
                    rel_path=lib_rel,
                    root=str(roots[rel]),
                    size=len(data),
                    sha256=digest,
                )
            )
    return task_id


def test_a_reimport_repairs_a_relocated_file_where_it_lies(procs, tmp_path: Path) -> None:
    """`b.bin` was relocated to another disk and rots there; `verify_library` queues a re-import.
    Before: the re-import copied every file into the default root and pointed every row there,
    so the relocation was undone behind the operator's back and the rotten copy on the other
    disk stayed, referenced by nothing. Now a recorded file is repaired in its own root."""
    downloads, default, other = tmp_path / "downloads", tmp_path / "lib", tmp_path / "lib-other"
    files = {"a.bin": os.urandom(200_000), "b.bin": os.urandom(300_000)}
    t = make_torrent(downloads, "Show", files)
    task_id = imported_task(t, files, {"a.bin": default, "b.bin": other})
    moved = other / str(task_id) / "Show" / "b.bin"
    flip_bytes(moved)
    env = {"LIBRARY_ROOT": str(default), "DOWNLOAD_DIR": str(downloads)}
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)

    enqueue_periodic("verify_library", 5)
    key = f"reimport:{task_id}:5"
    wait_for(lambda: run_status(key) in ("succeeded", "failed"), 60, what="the re-import")
    assert run_status(key) == "succeeded", scalar(
        "SELECT last_error FROM engine.task_run WHERE idempotency_key = %s", (key,)
    )

    rows = dict(sql("SELECT rel_path, root FROM acq.library_item WHERE download_task_id = %s", (task_id,)))
    assert rows == {"Show/a.bin": str(default), "Show/b.bin": str(other)}
    assert sha256(moved) == hashlib.sha256(files["b.bin"]).hexdigest()
    assert not (default / str(task_id) / "Show" / "b.bin").exists(), "a second copy in the default root"
    assert scalar("SELECT count(*) FROM acq.library_item WHERE status <> 'ok'") == 0


# ------------------------------------------------------------------ durable new directories


def test_a_copy_into_new_folders_makes_each_new_folder_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`copy_file` creates `<task id>/<torrent name>/<sub>/` and renames the file into the last.
    Before: only that last folder was fsynced, so after a power cut the folders created above it
    (their entries in their parents) could be gone with the file, while the ledger said copied.
    Now each folder it creates is fsynced into its parent before the copy returns. The real
    fsync still runs: `_fsync_dir` is only watched."""
    root = tmp_path / "lib"
    root.mkdir()
    dst = root / "task" / "Show" / "sub" / "a.bin"
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(70_000))
    synced: list[Path] = []
    real = library._fsync_dir

    def watch(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(library, "_fsync_dir", watch)
    library.copy_file(src, dst, "d" * 32)
    assert set(synced) >= {root, root / "task", root / "task" / "Show", dst.parent}, synced


# ------------------------------------------------------------- names the filesystem cannot hold


def raw_torrent(name: str, paths: list[list[str]] | None = None) -> bytes:
    data = b"x" * 1000
    info: dict[str, object] = {"name": name, "piece length": 16384, "pieces": hashlib.sha1(data).digest()}
    if paths is None:
        info["length"] = len(data)
    else:
        info["files"] = [{"length": len(data) // len(paths), "path": p} for p in paths]
    return bencode({"announce": "http://tracker.invalid/announce", "info": info})


@pytest.mark.parametrize(
    "torrent",
    [
        raw_torrent("x" * 256 + ".mkv"),
        raw_torrent("Show", [["ok.mkv"], ["é" * 128 + ".srt"]]),
        raw_torrent("Show", [["d" * 200 + str(i) for i in range(25)] + ["e.mkv"]]),
    ],
    ids=["name", "file-segment", "whole-path"],
)
def test_a_name_the_library_cannot_hold_is_refused_at_the_door(torrent: bytes) -> None:
    """A file name over NAME_MAX (255 bytes), or a path over PATH_MAX once under its task's
    folder, cannot be created in the library. Before: such a torrent was accepted, downloaded in
    full, and then every import attempt failed (the name cannot be written; qBittorrent itself
    shortens or refuses it) until the request was a dead letter. Now `torrents.parse`, which
    every door calls, refuses it with a clear `BadTorrent`."""
    with pytest.raises(torrents.BadTorrent, match="too long"):
        torrents.parse(torrent)


def test_a_name_just_within_the_limits_is_accepted() -> None:
    """The limit is not tighter than the filesystem's."""
    meta = torrents.parse(raw_torrent("Show", [["ア" * 83 + ".mkv"], ["ok.srt"]]))
    assert len(meta.files) == 2


# -------------------------------------------------- giving up a repair is not canceling a request


def events_of(task_id: uuid.UUID) -> list[str]:
    return [
        r[0]
        for r in sql("SELECT what FROM acq.task_event WHERE download_task_id = %s ORDER BY id", (task_id,))
    ]


@pytest.mark.parametrize("how", ["abandon", "cancel"])
def test_giving_up_a_reimport_leaves_the_delivered_request_alone(procs, tmp_path: Path, how: str) -> None:
    """A re-import (after `verify_library` found corruption) is a repair of a request already
    delivered. Before: canceling it flagged the request itself (`canceling`), and its
    compensation, as for abandoning it, marked the delivered request `canceled` (and would
    remove a still-seeding torrent with its data). Now the request keeps its status and its
    files; the timeline says the repair was given up."""
    downloads, default = tmp_path / "downloads", tmp_path / "lib"
    files = {"a.bin": os.urandom(50_000)}
    t = make_torrent(downloads, "Show", files)
    task_id = imported_task(t, files, {"a.bin": default})
    library_file = default / str(task_id) / "Show" / "a.bin"
    (downloads / "Show" / "a.bin").unlink()  # the download was cleaned up after seeding
    env = {"LIBRARY_ROOT": str(default), "DOWNLOAD_DIR": str(downloads)}
    key = f"reimport:{task_id}:9"
    run_id = runs.enqueue(
        "import", {"download_task_id": str(task_id), "generation": 9}, idempotency_key=key
    ).task_run_id
    if how == "abandon":
        procs.worker("w1", concurrency=1, env=env)
        procs.beat(env=env)
        assert wait_ended(procs, run_id) == "failed"
        assert runs.abandon(run_id, "the download is gone")
    else:
        runs.cancel(run_id, "not now")
        procs.worker("w1", concurrency=1, env=env)
        procs.beat(env=env)
    comp = f"compensate:{run_id}"
    wait_for(lambda: run_status(comp) in ("succeeded", "failed"), 60, what="the compensation")
    assert run_status(comp) == "succeeded"

    assert scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) == "notified"
    assert scalar("SELECT cancel_requested_at FROM acq.download_task WHERE id = %s", (task_id,)) is None
    assert sha256(library_file) == hashlib.sha256(files["a.bin"]).hexdigest()
    assert scalar("SELECT status FROM acq.library_item WHERE download_task_id = %s", (task_id,)) == "ok"
    assert "re-import given up" in events_of(task_id)
    assert "compensated" not in events_of(task_id) and "cancel requested" not in events_of(task_id)


# -------------------------------------------- a retried copy after its source changed on disk


def test_a_copy_retried_after_its_source_changed_does_not_record_the_new_bytes(procs, tmp_path: Path) -> None:
    """The copy fails (its folder is blocked), the operator fixes that and retries the run from
    the failed step, but meanwhile the downloaded file changed (a tagger rewrote it, or the
    disk rotted). Before: the retried copy took the new bytes as they were, their sha256 became
    the library's truth, and `verify_library` would never see a difference. Now a source whose
    size or mtime moved since the piece check is checked again: the retry fails naming the
    mismatch and nothing reaches the library."""
    downloads, default = tmp_path / "downloads", tmp_path / "lib"
    files = {"a.bin": os.urandom(200_000)}
    t = make_torrent(downloads, "Show", files)
    task_id = uuid.uuid4()
    with db.sessions().begin() as s:
        s.add(
            DownloadTask(
                id=task_id,
                requester="olga",
                title="Show",
                infohash=t.infohash.lower(),
                torrent=t.dump(),
                files=[{"rel_path": "a.bin", "size": 200_000}],
                total_size=200_000,
                status="downloading",
            )
        )
    default.mkdir()
    blocker = default / str(task_id)
    blocker.write_bytes(b"not a folder")  # the copy cannot make its folder
    env = {"LIBRARY_ROOT": str(default), "DOWNLOAD_DIR": str(downloads)}
    procs.worker("w1", concurrency=1, env=env)
    procs.beat(env=env)
    run_id = runs.enqueue("import", {"download_task_id": str(task_id)}, idempotency_key=new_key()).task_run_id
    assert wait_ended(procs, run_id) == "failed"

    source = downloads / "Show" / "a.bin"
    flip_bytes(source, at=150_000)
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 1_000_000))
    blocker.unlink()
    assert runs.retry_failed(run_id)
    assert wait_ended(procs, run_id) == "failed"
    error = str(scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (run_id,)))
    assert "does not match" in error, error
    assert scalar("SELECT count(*) FROM acq.library_item WHERE download_task_id = %s", (task_id,)) == 0
    assert not (default / str(task_id) / "Show" / "a.bin").exists()
