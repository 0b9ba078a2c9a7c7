"""What the library kinds leave behind when a run does not go its whole way: a relocate given up
after its copy, a relocate that meets a repair of its item, and corruption that keeps a file's
size and mtime, in the library or in the download folder between the import's piece check and
its copy (`proj/kinds/relocate.py`, `proj/kinds/compensate.py`, `proj/kinds/verify_library.py`,
`proj/kinds/importing.py`). Each test here failed on the code before its fix.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torf
from psycopg.types.json import Jsonb

import proj.celery  # noqa: F401 - registers every kind
from proj import db
from proj.acquisition import library
from proj.admin import queries
from proj.engine import protocol, runs
from proj.kinds import relocate as relocate_kind
from proj.settings import get_settings
from tests.acq_fixtures import *  # noqa: F403
from tests.conftest import new_key
from tests.integration.test_library_review import (
    enqueue_periodic,
    events_of,
    imported_task,
    make_torrent,
    torrent_task,
)
from tests.integration.test_library_review import run_status as status_of_key
from tests.integration.test_relocate_overlap import (
    REL,
    copies,
    copy_underway,
    library_item,
    relocate,
    sha256,
    wait_ended,
)
from tests.support.services import scalar, sql, wait_for
from tests.support.steps import first_step

SLOW_SMALL_COPY = {"COPY_CHUNK_BYTES": "16384", "FAULT_CHUNK_DELAY_S": "0.04"}  # 1 MiB in 2.6 s


def rot_in_place(path: Path, at: int = 1000) -> None:
    """Bit rot as a disk (or a tool run under `touch -r`) leaves it: 16 bytes flipped in the same
    inode, the size and the mtime as they were."""

    def stamp() -> tuple[int, int, int]:
        st = path.stat()
        return st.st_ino, st.st_size, st.st_mtime_ns

    before, atime = stamp(), path.stat().st_atime_ns
    with path.open("r+b") as f:
        f.seek(at)
        block = f.read(16)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in block))
    os.utime(path, ns=(atime, before[2]))
    assert stamp() == before


def last_error(run_id: uuid.UUID) -> str:
    return str(scalar("SELECT last_error FROM engine.task_run WHERE id = %s", (run_id,)))


def compensation_done(procs, run_id: uuid.UUID) -> None:  # noqa: ANN001 - conftest fixture
    key = f"compensate:{run_id}"
    assert status_of_key(key) is not None, "no compensation was enqueued for the run given up"
    wait_for(lambda: status_of_key(key) in ("succeeded", "failed"), 60, what="the compensation")
    assert status_of_key(key) == "succeeded", scalar(
        "SELECT last_error FROM engine.task_run WHERE idempotency_key = %s", (key,)
    )


# ------------------------------------------------------- a relocate given up between copy and switch


def test_a_relocate_canceled_after_its_copy_removes_that_copy(procs, tmp_path: Path) -> None:
    """The copy to B is whole (the worker died right after it, before the switch) and the
    operator cancels. Before: relocate had no compensation, so B kept a full copy nothing
    pointed at, for good. Now the cancel's compensation removes the copy this run made; the
    row and the original in A are untouched."""
    a, b = tmp_path / "lib-a", tmp_path / "lib-b"
    item_id, task_id, digest = library_item(a, size=1024 * 1024)
    procs.worker(
        "victim", concurrency=1, env={"FAULT_KILL_AFTER_EFFECT": "file", "FAULT_KILL_SCOPE": "group"}
    )
    run_id = relocate(item_id, b)
    wait_for(lambda: procs.procs["victim"].poll() is not None, 60, what="the worker to die after its copy")
    assert copies(task_id, b) == [b / str(task_id) / REL], "the copy is whole, the switch never ran"

    runs.cancel(run_id, "not that disk after all")
    procs.worker("w1", concurrency=1)
    procs.beat()
    assert wait_ended(procs, run_id) == "canceled"
    compensation_done(procs, run_id)

    assert copies(task_id, b) == [], "the canceled relocate left its copy behind"
    assert scalar("SELECT root FROM acq.library_item WHERE id = %s", (item_id,)) == str(a)
    assert copies(task_id, a) == [a / str(task_id) / REL]
    assert sha256(a / str(task_id) / REL) == digest


def test_giving_up_a_relocate_removes_only_the_file_it_copied(tmp_path: Path) -> None:
    """The compensation decides by what the copy recorded (its file's device and inode), never
    by path alone: a file another run has since put at the same path stays, and so does a
    file the row points at. Before: there was nothing to give up with (no compensation)."""
    a, b = tmp_path / "lib-a", tmp_path / "lib-b"
    item_id, task_id, _ = library_item(a, size=4096)
    ours, theirs, pointed = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    target = b / str(task_id) / REL
    target.parent.mkdir(parents=True)

    def copied_by(run_id: uuid.UUID) -> None:
        """A whole copy at `target` and its ledger record, as relocate's copy step leaves them."""
        fresh = target.with_name("fresh")  # a new file renamed into place, as `copy_file` does
        fresh.write_bytes((a / str(task_id) / REL).read_bytes())
        fresh.replace(target)
        st = target.stat()
        result = {"path": str(target), "dev": st.st_dev, "ino": st.st_ino}
        sql(
            """
            INSERT INTO ledger.asset_operation
                   (op_key, run_id, step, effect_kind, plan, status, attempts, attempt_token,
                    attempt_started_at, result, resolution, finished_at)
            VALUES (%s, %s, 'copy', 'file', %s, 'done', 1, %s, now(), %s, 'effect', now())
            """,
            (
                f"relocate:{item_id}:{run_id}",
                run_id,
                Jsonb({"src": str(a / str(task_id) / REL), "dst": str(target)}),
                uuid.uuid4(),
                Jsonb(result),
            ),
        )

    inp = {"library_item_id": item_id, "new_root": str(b)}
    copied_by(ours)
    copied_by(theirs)  # a later run's copy took the path (a new inode)
    assert relocate_kind.give_up(ours, inp)["copy"] == "kept"
    assert target.exists()

    assert relocate_kind.give_up(theirs, inp)["copy"] == "removed"
    assert not target.exists()

    copied_by(pointed)
    sql("UPDATE acq.library_item SET root = %s WHERE id = %s", (str(b), item_id))
    assert relocate_kind.give_up(pointed, inp)["copy"] == "kept"
    assert target.exists(), "the file the row points at is never removed"
    assert relocate_kind.give_up(uuid.uuid4(), inp) == {"skipped": True, "reason": "nothing was copied"}


def test_giving_up_a_relocate_again_puts_back_a_library_file_a_killed_give_up_set_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`give_up` sets the file at the copy's path aside to check it is the copy; killed before it
    put back a file that is not (a later relocate's, since switched to), the next `give_up` must
    put it back. Before: it saw nothing at the path, answered "absent" and left the library file
    under its aside name for good, the row pointing at nothing."""
    a, b = tmp_path / "lib-a", tmp_path / "lib-b"
    item_id, task_id, _ = library_item(a, size=4096)
    target = b / str(task_id) / REL
    target.parent.mkdir(parents=True)
    ours = uuid.uuid4()
    gone = target.with_name("ours-since-replaced")  # the inode our copy had, kept so it is not reused
    gone.write_bytes(b"our copy")
    mine = library.file_id(gone)
    sql(
        """
        INSERT INTO ledger.asset_operation
               (op_key, run_id, step, effect_kind, plan, status, attempts, attempt_token,
                attempt_started_at, result, resolution, finished_at)
        VALUES (%s, %s, 'copy', 'file', %s, 'done', 1, %s, now(), %s, 'effect', now())
        """,
        (
            f"relocate:{item_id}:{ours}",
            ours,
            Jsonb({"src": str(a / str(task_id) / REL), "dst": str(target)}),
            uuid.uuid4(),
            Jsonb({"path": str(target), **mine}),
        ),
    )
    target.write_bytes(b"a later relocate's copy, the row's file")
    sql("UPDATE acq.library_item SET root = %s WHERE id = %s", (str(b), item_id))
    inp = {"library_item_id": item_id, "new_root": str(b)}
    # The window a kill -9 leaves: the row's file under the aside name of our copy.
    target.rename(library.aside_path(target, mine["dev"], mine["ino"]))

    assert relocate_kind.give_up(ours, inp)["copy"] == "kept"
    assert target.read_bytes() == b"a later relocate's copy, the row's file"
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, gone.name])


def test_giving_up_again_removes_an_unrecorded_copy_a_killed_give_up_set_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy attempt cut off after its rename records no file; `give_up` then removes whatever
    file is at the path, set aside first. Killed with it set aside, the next `give_up` saw
    nothing at the path, answered "absent" and left the copy under its aside name for good.
    Now the file is named (committed) before it is set aside, and the next one removes it."""
    a, b = tmp_path / "lib-a", tmp_path / "lib-b"
    item_id, task_id, _ = library_item(a, size=4096)
    target = b / str(task_id) / REL
    target.parent.mkdir(parents=True)
    ours = uuid.uuid4()
    sql(
        """
        INSERT INTO ledger.asset_operation
               (op_key, run_id, step, effect_kind, plan, status, attempts, attempt_token, attempt_started_at)
        VALUES (%s, %s, 'copy', 'file', %s, 'attempting', 1, %s, now())
        """,
        (
            f"relocate:{item_id}:{ours}",
            ours,
            Jsonb({"src": str(a / str(task_id) / REL), "dst": str(target)}),
            uuid.uuid4(),
        ),
    )
    target.write_bytes(b"the copy the cut-off attempt renamed into place")
    inp = {"library_item_id": item_id, "new_root": str(b)}

    def killed_once_aside(path: Path, dev: int, ino: int) -> bool:
        path.rename(library.aside_path(path, dev, ino))
        raise KeyboardInterrupt("killed with the file set aside")

    with monkeypatch.context() as m:
        m.setattr(library, "remove_if_same_file", killed_once_aside)
        with pytest.raises(KeyboardInterrupt):
            relocate_kind.give_up(ours, inp)
    assert not target.exists() and len(list(target.parent.iterdir())) == 1  # only the aside file

    assert relocate_kind.give_up(ours, inp)["copy"] == "removed"
    assert list(target.parent.iterdir()) == []
    assert scalar("SELECT count(*) FROM acq.flag WHERE kind = 'relocate_give_up_target'") == 0
    assert relocate_kind.give_up(ours, inp)["copy"] == "absent"


# --------------------------------------------------------- a relocate meeting a repair of its item


def test_a_relocate_of_an_item_flagged_for_repair_refuses_its_switch_and_removes_its_copy(
    procs, tmp_path: Path
) -> None:
    """While A → B copies, the file in A rots behind the part already copied; `verify_library`
    flags the item and queues its re-import. Before: the switch (a compare-and-set on the root
    alone) moved the row under the repair to B and deleted A, so a re-import that had already
    chosen A recorded A again and left B's copy orphaned (or the row pointing at a deleted
    file). Now the switch is refused while the item is flagged: the run fails saying so, removes
    the copy it made, and the re-import repairs the file where it lies."""
    downloads, a, b = tmp_path / "downloads", tmp_path / "lib-a", tmp_path / "lib-b"
    files = {"big.bin": os.urandom(1024 * 1024)}
    t = make_torrent(downloads, "Show", files)
    task_id = imported_task(t, files, {"big.bin": a})
    item_id = scalar("SELECT id FROM acq.library_item WHERE download_task_id = %s", (task_id,))
    original = a / str(task_id) / "Show" / "big.bin"
    env = {"LIBRARY_ROOT": str(a), "DOWNLOAD_DIR": str(downloads)}
    procs.worker("slow", concurrency=1, env={**env, **SLOW_SMALL_COPY})  # relocate, then the re-import
    procs.worker("verifier", concurrency=1, env={**env, "ENGINE_SERVE": "verify_library@1"})
    procs.beat(env=env)

    run_id = relocate(item_id, b)
    wait_for(lambda: copy_underway(run_id, task_id, b), 30, what="the copy to be underway")
    part = b / str(task_id) / "Show"
    wait_for(
        lambda: any(p.stat().st_size > 64 * 1024 for p in part.glob(".big.bin.part-*")),
        30,
        what="the copy to be past the first 64 KiB",
    )
    rot_in_place(original)
    verify = enqueue_periodic("verify_library", 21)
    assert wait_ended(procs, verify) == "succeeded"
    assert scalar("SELECT status FROM acq.library_item WHERE id = %s", (item_id,)) == "corrupt"
    assert copy_underway(run_id, task_id, b), "the flag landed while the copy was still running"

    assert wait_ended(procs, run_id) == "failed"
    error = last_error(run_id)
    assert "corrupt" in error and "re-import" in error, error
    assert copies(task_id, b) == [], "the refused switch left its copy behind"

    key = f"reimport:{task_id}:21"
    wait_for(lambda: status_of_key(key) in ("succeeded", "failed"), 60, what="the re-import")
    assert status_of_key(key) == "succeeded"
    assert sql("SELECT root, status FROM acq.library_item WHERE id = %s", (item_id,)) == [(str(a), "ok")]
    assert sha256(original) == sha256(downloads / "Show" / "big.bin")
    assert copies(task_id, b) == []


def test_a_reimport_leaves_a_file_relocated_meanwhile_where_the_move_put_it(procs, tmp_path: Path) -> None:
    """A re-import copies every file of its task back where its row says it lies, the healthy
    ones too; `a.bin` is being relocated A → B meanwhile. The re-import chose A for it, then the
    switch moved the row to B and deleted A's file, then the re-import recorded its rows. Before:
    the record pointed `a.bin`'s row back at A, at a file the switch had deleted (or, had its
    copy landed after the delete, at that copy, B's left orphaned). Now the record is a
    compare-and-set on the root each copy went to: a row moved meanwhile stays where the
    relocate put it, and the re-import's own copy in the old root goes if it is still there."""
    downloads, a, b = tmp_path / "downloads", tmp_path / "lib-a", tmp_path / "lib-b"
    files = {"a.bin": os.urandom(1024 * 1024), "z.bin": os.urandom(16 * 1024 * 1024)}
    t = make_torrent(downloads, "Show", files)
    task_id = imported_task(t, files, {"a.bin": a, "z.bin": a})
    item_id = scalar(
        "SELECT id FROM acq.library_item WHERE download_task_id = %s AND rel_path = 'Show/a.bin'", (task_id,)
    )
    env = {"LIBRARY_ROOT": str(a), "DOWNLOAD_DIR": str(downloads)}
    # The relocate copies a.bin in 3.9 s; the re-import copies it in 0.9 s and z.bin in 5.4 s.
    mover = {"COPY_CHUNK_BYTES": "16384", "FAULT_CHUNK_DELAY_S": "0.06", "ENGINE_SERVE": "relocate@1"}
    repairer = {
        "COPY_CHUNK_BYTES": str(1024 * 1024),
        "FAULT_CHUNK_DELAY_S": "0.3",
        "ENGINE_SERVE": "import@1",
    }
    procs.worker("mover", concurrency=1, env={**env, **mover})
    procs.worker("repairer", concurrency=2, env={**env, **repairer})
    procs.beat(env=env)

    run_id = relocate(item_id, b)
    wait_for(lambda: copy_underway(run_id, task_id, b), 30, what="the relocate's copy to be underway")
    key = f"reimport:{task_id}:3"
    reimport = runs.enqueue(
        "import", {"download_task_id": str(task_id), "generation": 3}, idempotency_key=key
    ).task_run_id
    assert wait_ended(procs, run_id) == "succeeded"
    assert wait_ended(procs, reimport) == "succeeded", last_error(reimport)
    # The interleaving this test is about: the re-import copied a.bin to A, then the switch, then
    # the re-import's record.
    plan = scalar("SELECT plan FROM ledger.asset_operation WHERE op_key = %s", (f"copy:{task_id}:3:a.bin",))
    assert plan["dst"] == str(a / str(task_id) / "Show" / "a.bin"), plan
    timeline = events_of(task_id)
    assert timeline.index("relocated") < timeline.index("re-imported"), timeline

    rows = dict(sql("SELECT rel_path, root FROM acq.library_item WHERE download_task_id = %s", (task_id,)))
    assert rows == {"Show/a.bin": str(b), "Show/z.bin": str(a)}
    assert sha256(b / str(task_id) / "Show" / "a.bin") == sha256(downloads / "Show" / "a.bin")
    assert copies(task_id, a) == [a / str(task_id) / "Show" / "z.bin"], "a second a.bin in A"
    assert copies(task_id, b) == [b / str(task_id) / "Show" / "a.bin"]


# --------------------------------------------------- corruption that keeps the size and the mtime


def test_verify_library_finds_rot_that_keeps_size_and_mtime_within_its_cycle(procs, tmp_path: Path) -> None:
    """A file rots in place: same inode, size and mtime. Each run stats every file and re-hashes
    the least recently verified ones, about 1/VERIFY_CYCLE_RUNS of the library's bytes, so the
    rot is found within that many runs and no run reads the whole library. Before: every run
    read every byte (days for a multi-TB library, every day)."""
    lib = tmp_path / "lib"
    items = [library_item(lib, size=256 * 1024) for _ in range(4)]
    victim_id, victim_task, _ = items[2]  # verified third: not in the first run's half
    rot_in_place(lib / str(victim_task) / REL)
    env = {"LIBRARY_ROOT": str(lib), "VERIFY_CYCLE_RUNS": "2", "VERIFY_MIN_HASH_BYTES": "0"}
    procs.worker("w1", concurrency=1, env=env)
    procs.beat(env=env)

    first = enqueue_periodic("verify_library", 31)
    assert wait_ended(procs, first) == "succeeded"
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (first,)) == {
        "checked": 4,
        "hashed": 2,
        "hashed_bytes": 512 * 1024,
        "corrupt": 0,
    }
    hashed = {i for (i,) in sql("SELECT id FROM acq.library_item WHERE verified_at IS NOT NULL")}
    assert hashed == {items[0][0], items[1][0]}

    second = enqueue_periodic("verify_library", 32)
    assert wait_ended(procs, second) == "succeeded"
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (second,)) == {
        "checked": 4,
        "hashed": 2,
        "hashed_bytes": 512 * 1024,
        "corrupt": 1,
    }
    assert dict(sql("SELECT id, status FROM acq.library_item")) == {
        i: ("corrupt" if i == victim_id else "ok") for i, _, _ in items
    }
    assert sql("SELECT kind, subject FROM acq.flag") == [("corrupt_file", str(victim_id))]


def test_verify_library_finds_a_truncated_or_missing_file_in_the_next_run(procs, tmp_path: Path) -> None:
    """What a stat can tell (a file gone, or of another size) is checked for every file in every
    run, whatever the hashing budget: only the bytes-only damage waits for its turn."""
    lib = tmp_path / "lib"
    items = [library_item(lib, size=64 * 1024) for _ in range(4)]
    (lib / str(items[2][1]) / REL).unlink()
    with (lib / str(items[3][1]) / REL).open("r+b") as f:
        f.truncate(1000)
    env = {"LIBRARY_ROOT": str(lib), "VERIFY_CYCLE_RUNS": "4", "VERIFY_MIN_HASH_BYTES": "0"}
    procs.worker("w1", concurrency=1, env=env)
    procs.beat(env=env)

    run_id = enqueue_periodic("verify_library", 41)
    assert wait_ended(procs, run_id) == "succeeded"
    result = scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,))
    assert result["corrupt"] == 2 and result["hashed"] == 1, result
    assert sorted(i for (i,) in sql("SELECT id FROM acq.library_item WHERE status = 'corrupt'")) == [
        items[2][0],
        items[3][0],
    ]


def test_verify_library_takes_a_file_it_cannot_read_for_corrupt_and_checks_the_others(
    one_step_at_a_time: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failing disk answers a read with EIO: that file is what `verify_library` is for. Before:
    the OSError failed the step, every retry and every later run stopped at the same file (the
    least recently verified, so first again), so nothing was flagged and no other file was ever
    verified again. Now an unreadable file is corrupt (flagged, re-imported) and the run goes on."""
    _, lib = one_step_at_a_time
    items = [library_item(lib, size=64 * 1024) for _ in range(3)]
    unreadable = lib / str(items[0][1]) / REL
    real_sha256 = library.sha256_file

    def eio_for_one(path: Path, *args: Any, **kwargs: Any) -> str:
        if Path(path) == unreadable:
            raise OSError(5, "Input/output error", str(path))
        return real_sha256(path, *args, **kwargs)

    monkeypatch.setattr(library, "sha256_file", eio_for_one)
    run_id = enqueue_periodic("verify_library", 51)
    assert run_to_end(run_id) == "succeeded", last_error(run_id)
    result = scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,))
    assert result == {"checked": 3, "hashed": 3, "hashed_bytes": 3 * 64 * 1024, "corrupt": 1}, result
    assert dict(sql("SELECT id, status FROM acq.library_item")) == {
        i: ("corrupt" if i == items[0][0] else "ok") for i, _, _ in items
    }
    verified = {i for (i,) in sql("SELECT id FROM acq.library_item WHERE verified_at IS NOT NULL")}
    assert verified == {items[1][0], items[2][0]}
    assert sql("SELECT kind, subject FROM acq.flag") == [("corrupt_file", str(items[0][0]))]


def test_verify_library_reaches_its_old_files_while_new_ones_keep_arriving(
    one_step_at_a_time: tuple[Path, Path],
) -> None:
    """Files never verified come first (`verified_at` NULL), and each run's share was
    1/VERIFY_CYCLE_RUNS of the library: a library growing by that much between runs (a 2 TB
    library at 30 runs gets 68 GB a day) spent every run on its new files and never reached the
    old ones, so rot in them was not found within the cycle, nor at all while the growth lasted.
    Now a file's place in line is when it was last known good, its import for a new one."""
    _, lib = one_step_at_a_time
    old = [library_item(lib, size=64 * 1024) for _ in range(2)]
    sql("UPDATE acq.library_item SET verified_at = now() - interval '2 days' WHERE id = %s", (old[0][0],))
    sql("UPDATE acq.library_item SET verified_at = now() - interval '1 day' WHERE id = %s", (old[1][0],))
    rot_in_place(lib / str(old[0][1]) / REL)
    settings = get_settings()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "verify_cycle_runs", 2)
        mp.setattr(settings, "verify_min_hash_bytes", 0)
        new = [library_item(lib, size=64 * 1024) for _ in range(2)]  # imported since the last run
        run_id = enqueue_periodic("verify_library", 61)
        assert run_to_end(run_id) == "succeeded", last_error(run_id)
    result = scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,))
    assert result["corrupt"] == 1, result
    assert scalar("SELECT status FROM acq.library_item WHERE id = %s", (old[0][0],)) == "corrupt"
    hashed = {
        i for (i,) in sql("SELECT id FROM acq.library_item WHERE verified_at > now() - interval '1 hour'")
    }
    assert hashed == {old[1][0]} and result["hashed"] == 2, (hashed, new)  # the old two, one rotten


def test_verify_library_whose_disk_drops_midway_flags_the_root_not_the_files_after(
    one_step_at_a_time: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The root is checked once, before the files: a NAS unmounted while the run reads (a long
    run, at 250 MB/s some 45 min) left its bare mount point, and every file after that failed
    its stat and was marked corrupt, each queuing a re-import, as the check at the start is
    there to prevent. Now a root that is gone by the end of the run is flagged and its files left
    as they are."""
    _, lib = one_step_at_a_time
    for _ in range(3):
        library_item(lib, size=64 * 1024)
    elsewhere = tmp_path / "the-nas-itself"
    elsewhere.mkdir()
    real_sha256 = library.sha256_file

    def read_then_unmount(path: Path, *args: Any, **kwargs: Any) -> str:
        digest = real_sha256(path, *args, **kwargs)
        for entry in list(lib.iterdir()):  # the mount point is left bare
            entry.rename(elsewhere / entry.name)
        return digest

    monkeypatch.setattr(library, "sha256_file", read_then_unmount)
    run_id = enqueue_periodic("verify_library", 71)
    assert run_to_end(run_id) == "succeeded", last_error(run_id)
    result = scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,))
    assert result["corrupt"] == 0 and result["unavailable_roots"] == [str(lib)], result
    assert {st for (st,) in sql("SELECT status FROM acq.library_item")} == {"ok"}
    assert sql("SELECT kind, subject FROM acq.flag") == [("library_root_unavailable", str(lib))]
    assert scalar("SELECT count(*) FROM outbox.outbox_event WHERE kind = 'import'") == 0


# ------------------------------------------ a download rotting between the piece check and the copy


def downloaded_task(t: torf.Torrent, files: dict[str, bytes]) -> uuid.UUID:
    """A request whose torrent `t` has finished downloading: the import's to run."""
    with db.sessions().begin() as s:
        return torrent_task(s, t, files, "downloaded")


@pytest.fixture
def one_step_at_a_time(published, monkeypatch, tmp_path: Path) -> tuple[Path, Path]:  # noqa: ANN001
    """Steps run here, one per `protocol.execute` (no inline chain), on a download folder and a
    library root of this test's own: (downloads, library)."""
    downloads, lib = tmp_path / "downloads", tmp_path / "lib"
    lib.mkdir()
    monkeypatch.setattr(get_settings(), "inline_steps", 0)
    monkeypatch.setattr(get_settings(), "download_dir", str(downloads))
    monkeypatch.setattr(get_settings(), "library_root", str(lib))
    return downloads, lib


def run_next(run_id: uuid.UUID) -> list[str]:
    """Run every step of the run that is waiting for its turn, now (its backoff skipped), as a
    worker would on their messages; their outcomes."""
    due = sql("SELECT id FROM engine.step WHERE run_id = %s AND status = 'pending' ORDER BY id", (run_id,))
    sql("UPDATE engine.step SET next_attempt_at = now() WHERE run_id = %s AND status = 'pending'", (run_id,))
    return [protocol.execute(step_id, limited=False) for (step_id,) in due]


def run_status(run_id: uuid.UUID) -> str:
    return str(scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)))


def run_to_end(run_id: uuid.UUID) -> str:
    for _ in range(10):
        if run_status(run_id) in ("succeeded", "failed", "canceled"):
            break
        run_next(run_id)
    return run_status(run_id)


def timeline(run_id: uuid.UUID) -> list[tuple[str, str, str]]:
    """The run's page as the operator reads it: (title, detail, state) of each line."""
    with db.sessions()() as s:
        detail = queries.run_detail(s, run_id)
    assert detail is not None
    return [(e.title, e.detail, e.state) for e in detail.timeline]


def library_files(lib: Path) -> list[Path]:
    """Every file under the library root, temp files included."""
    return sorted(p for p in lib.rglob("*") if p.is_file())


def test_a_download_rotting_after_its_piece_check_never_reaches_the_library(
    one_step_at_a_time: tuple[Path, Path],
) -> None:
    """`verify` checks every piece; then, before the copy reads it, the downloaded file rots in
    place, its size and mtime kept. Before: the copy saw an unchanged stamp, copied the rotten
    bytes and recorded their sha256 as the library's truth (`verify_library` would forever
    agree with it). Now `verify` notes each file's sha256 from its piece-checking read, the copy
    refuses other bytes before its rename (its temp file removed), checks the file's pieces
    again, finds them failing and ends the run a dead letter saying the payload does not match
    the torrent; the request's timeline names the file. Nothing is in the library."""
    downloads, lib = one_step_at_a_time
    files = {"a.bin": os.urandom(300_000)}
    t = make_torrent(downloads, "Show", files)
    task_id = downloaded_task(t, files)
    run_id = runs.enqueue("import", {"download_task_id": str(task_id)}, idempotency_key=new_key()).task_run_id

    assert protocol.execute(first_step(run_id), starts_run=True, limited=False) == "succeeded"  # verify
    rot_in_place(downloads / "Show" / "a.bin", at=150_000)
    recorded = "SELECT rel_path, sha256 FROM acq.library_item WHERE download_task_id = %s"
    assert run_to_end(run_id) == "failed", f"the rotten bytes were recorded: {sql(recorded, (task_id,))}"

    error = last_error(run_id)
    assert "does not match the torrent's piece hashes" in error and "a.bin" in error, error
    assert "DownloadCorrupt" in error, "failed at once: a retry reads the same rotten bytes"
    assert sql(recorded, (task_id,)) == []
    assert library_files(lib) == [], "the rotten copy (or its temp file) reached the library"
    assert scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) == "importing"
    lines = timeline(run_id)
    corrupt = [(d, st) for what, d, st in lines if what == "download corrupt"]
    assert len(corrupt) == 1 and "a.bin" in corrupt[0][0] and corrupt[0][1] == "error", lines
    assert "imported" not in events_of(task_id)


def test_a_download_changed_and_restored_during_its_copy_is_copied_again(
    one_step_at_a_time: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file changes after `verify` (size and mtime kept) and is put back as it was while the
    copy reads it (a tagger that restores, a read that returned other bytes once). The copy
    refuses what it read, its pieces match again, so the next attempt copies anew and the
    library records the verified bytes. Before: the first copy's bytes were recorded."""
    downloads, lib = one_step_at_a_time
    original = os.urandom(300_000)
    t = make_torrent(downloads, "Show", {"a.bin": original})
    task_id = downloaded_task(t, {"a.bin": original})
    source = downloads / "Show" / "a.bin"
    real_copy, restored = library.copy_file, []

    def copy_then_restore(*args: Any, **kwargs: Any) -> Any:
        try:
            return real_copy(*args, **kwargs)
        finally:
            if not restored:  # the first copy has read the changed bytes: put them back
                restored.append(True)
                rot_in_place(source, at=150_000)  # flipping the same bytes again restores them

    monkeypatch.setattr(library, "copy_file", copy_then_restore)
    run_id = runs.enqueue("import", {"download_task_id": str(task_id)}, idempotency_key=new_key()).task_run_id
    assert protocol.execute(first_step(run_id), starts_run=True, limited=False) == "succeeded"  # verify
    rot_in_place(source, at=150_000)
    assert run_next(run_id) == ["retry"]
    assert source.read_bytes() == original
    assert run_to_end(run_id) == "succeeded", last_error(run_id)

    digest = hashlib.sha256(original).hexdigest()
    assert sql("SELECT rel_path, sha256 FROM acq.library_item WHERE download_task_id = %s", (task_id,)) == [
        ("Show/a.bin", digest)
    ]
    assert library_files(lib) == [lib / str(task_id) / "Show" / "a.bin"]
    assert (lib / str(task_id) / "Show" / "a.bin").read_bytes() == original
    events = events_of(task_id)
    assert events.index("download changed during its copy") < events.index("imported"), events
