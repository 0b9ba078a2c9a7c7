"""The acquisition kinds the e2e and fault tests do not reach: retire_seed, reconcile_downloads,
verify_library, relocate, purge, bad torrents and the /admin timeline hooks.

Every assertion reads the business tables (`acq.*`), the operation ledger, qBittorrent or the
filesystem — never only "the engine said succeeded".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import update

import outbox
import proj.celery  # noqa: F401 - registers every kind (also `tests.kinds`) and `periodic_task`
from proj import db
from proj.acquisition import qbt, service, torrents
from proj.acquisition.models import DownloadTask, LibraryItem
from proj.engine import runs
from proj.engine.celery_engine import CeleryTaskEngine
from proj.kinds.reconcile_downloads import flag
from proj.qbt.local import LocalQbittorrent, add_torrent, make_torrent, wait_complete, wait_seeding
from proj.settings import get_settings
from tests.acq_fixtures import *  # noqa: F403
from tests.acq_fixtures import VENV_BIN, Receiver, Swarm
from tests.conftest import new_key
from tests.qbt_fixtures import *  # noqa: F403
from tests.qbt_fixtures import QbtPayload, sha256_tree
from tests.support.services import dump_engine_state, scalar, sql, wait_for
from tests.support.torrents import bencode, multi_file

pytestmark = pytest.mark.timeout(120)

SLOW_COPY = {"COPY_CHUNK_BYTES": "65536", "FAULT_CHUNK_DELAY_S": "0.05"}  # 64 KiB per 50 ms
LENIENT = {"Preferences": {"WebUI/HostHeaderValidation": False, "WebUI/CSRFProtection": False}}
PAUSED = ("pausedDL", "stoppedDL")


# ------------------------------------------------------------------------------------ helpers


def start(swarm: Swarm, webhook: Receiver | None = None) -> uuid.UUID:
    """Request the swarm's payload and approve it (the outbox queues `acquire`)."""
    with db.sessions().begin() as s:
        task_id = service.request_download(
            s, requester="carol", torrent=swarm.payload.torrent, webhook_url=webhook.url if webhook else None
        )
    service.approve_and_signal(CeleryTaskEngine(), db.sessions(), task_id, "op")
    return task_id


def run_row(key: str) -> tuple | None:
    rows = sql("SELECT id, status, result FROM engine.task_run WHERE idempotency_key = %s", (key,))
    return rows[0] if rows else None


def run_status(key: str) -> str | None:
    row = run_row(key)
    return row[1] if row else None


def task_status(task_id: uuid.UUID) -> str:
    return scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,))


def events(task_id: uuid.UUID) -> list[str]:
    return [
        r[0]
        for r in sql("SELECT what FROM acq.task_event WHERE download_task_id = %s ORDER BY id", (task_id,))
    ]


def explain(procs) -> None:  # noqa: ANN001 - the conftest fixture
    print(dump_engine_state())
    for name in procs.procs:
        print(f"--- {name}\n" + procs.log(name)[-5000:])


def wait_ok(
    procs,  # noqa: ANN001 - the conftest fixture
    cond: Callable[[], object],
    timeout: float,
    what: str,
    *,
    fail_fast: bool = True,
) -> None:
    """Wait for `cond`; stop at once if a run failed (unless failures are expected); print the
    engine state and the process logs on failure."""

    def done() -> bool:
        if cond():
            return True
        return fail_fast and scalar("SELECT count(*) FROM engine.task_run WHERE status = 'failed'") > 0

    try:
        wait_for(done, timeout, what=what)
        assert cond(), f"a run failed while waiting for {what}"
    except AssertionError:
        explain(procs)
        raise


def pipeline_done(procs, task_id: uuid.UUID, timeout: float = 90) -> None:  # noqa: ANN001
    """Imported, and its `notify` run finished (so the outbox hand-offs all happened)."""
    wait_ok(
        procs,
        lambda: (
            task_status(task_id) in ("imported", "notified")
            and run_status(f"notify:{task_id}") == "succeeded"
        ),
        timeout,
        "the pipeline",
    )


def library_file(swarm: Swarm, task_id: uuid.UUID, rel: str, root: Path | None = None) -> Path:
    return (root or swarm.library) / str(task_id) / swarm.payload.path.name / rel


def download_file(swarm: Swarm, rel: str) -> Path:
    return swarm.downloads / swarm.payload.path.name / rel


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def step_status(key: str, name: str) -> str | None:
    return scalar(
        "SELECT s.status FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
        "WHERE r.idempotency_key = %s AND s.name = %s",
        (key, name),
    )


def step_of(key: str, name: str) -> dict:
    rows = sql(
        "SELECT s.status, s.wait_topic, s.wait_until, s.lease_token, s.result, s.wakeups, "
        "s.finished_at FROM engine.step s JOIN engine.task_run r ON r.id = s.run_id "
        "WHERE r.idempotency_key = %s AND s.name = %s",
        (key, name),
    )
    assert rows, f"no step {name} in run {key}"
    cols = ("status", "wait_topic", "wait_until", "lease_token", "result", "wakeups", "finished_at")
    return dict(zip(cols, rows[0], strict=True))


def ledger_op(op_key: str) -> tuple | None:
    rows = sql("SELECT status, attempts, result FROM ledger.asset_operation WHERE op_key = %s", (op_key,))
    return rows[0] if rows else None


def make_swarm(
    qbt_factory: Callable[..., LocalQbittorrent],
    payload: QbtPayload,
    base: Path,
    *,
    hook: bool,
    upload_limit: int = 2 * 1024 * 1024,
) -> Swarm:
    """Like the `swarm` fixture, optionally without the managed client's on-finish hook."""
    seeder = qbt_factory("seeder", upload_limit=upload_limit)
    add_torrent(
        seeder.client(), payload.torrent, payload.infohash, save_path=payload.seed_save_path, seed=True
    )
    wait_seeding(seeder.client(), payload.infohash)
    on_finished = (
        f'sh -c "{VENV_BIN / "proj"} signal download:%K >> {base / "hook.log"} 2>&1"' if hook else None
    )
    managed = qbt_factory("managed", on_finished=on_finished, extra_config=LENIENT)
    (base / "library").mkdir()
    (base / "downloads").mkdir()
    return Swarm(seeder, managed, payload, base / "library", base / "downloads")


def enqueue_periodic(kind: str, bucket: int) -> uuid.UUID:
    """What `engine.periodic` does for one beat, with a bucket of our choosing."""
    return runs.enqueue(kind, {"bucket": bucket}, idempotency_key=f"{kind}:{bucket}").task_run_id


# ------------------------------------------------------------------------------- retire_seed


def test_retire_seed_sleeps_in_postgres_then_removes_the_torrent_and_keeps_the_files(
    procs, swarm: Swarm, webhook: Receiver
) -> None:
    env = swarm.worker_env(SEED_TIME_S="3")
    procs.worker("w1", concurrency=1, env=env)  # one slot: a parked run must not hold it
    procs.beat(env=env)
    task_id = start(swarm, webhook)
    key = f"retire_seed:{task_id}"
    wait_ok(procs, lambda: run_status(key) == "waiting", 90, "retire_seed to park")

    parked = step_of(key, "seed_goal")
    run_id, _, _ = run_row(key)
    seed_until = datetime.fromisoformat(
        scalar("SELECT input->>'seed_until' FROM engine.task_run WHERE id = %s", (run_id,))
    )
    assert parked["status"] == "waiting" and parked["lease_token"] is None, parked
    assert parked["wait_topic"] == f"sleep:{run_id}"
    assert abs((parked["wait_until"] - seed_until).total_seconds()) < 0.01, (parked["wait_until"], seed_until)
    assert (
        qbt.MANAGED_TAG in swarm.managed.client().torrents_info(torrent_hashes=swarm.payload.infohash)[0].tags
    )

    # The only worker slot is free while the timer runs: other work gets done meanwhile.
    probe = runs.enqueue("probe", {"n": 1}, idempotency_key=new_key()).task_run_id
    wait_ok(procs, lambda: run_status(key) == "succeeded", 30, "retire_seed to wake and retire")
    probe_done = scalar(
        "SELECT finished_at FROM engine.task_run WHERE id = %s AND status = 'succeeded'", (probe,)
    )
    woke = step_of(key, "seed_goal")["finished_at"]
    assert probe_done is not None and probe_done < woke, "the sleeping run held the worker slot"
    assert woke >= seed_until

    # qBittorrent no longer has it; the library and the downloaded files stay (delete_files=False).
    assert swarm.managed.client().torrents_info() == []
    for rel, digest in swarm.payload.digests.items():
        assert sha256(library_file(swarm, task_id, rel)) == digest
        assert sha256(download_file(swarm, rel)) == digest
    assert "seeding retired" in events(task_id)
    status, attempts, result = ledger_op(f"qbt-retire:{task_id}")
    assert status == "done" and attempts == 1 and result == {"retired": swarm.payload.infohash}


# ------------------------------------------------------------------------ reconcile_downloads


def test_periodic_kinds_are_keyed_by_their_bucket() -> None:
    """Two beats (or a beat and a retry) in one bucket make one run; nothing runs it here."""
    first = enqueue_periodic("reconcile_downloads", 1)
    assert enqueue_periodic("reconcile_downloads", 1) == first
    assert enqueue_periodic("reconcile_downloads", 2) != first

    every = 1e9  # one bucket for the next few years: the calls below cannot straddle two
    barrier = threading.Barrier(6)
    got: list[str] = []

    def beat() -> None:
        barrier.wait()
        got.append(proj.celery.periodic_task("verify_library", every))

    threads = [threading.Thread(target=beat) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    got.append(proj.celery.periodic_task("verify_library", every))  # and one more, back to back
    assert len(got) == 7 and len(set(got)) == 1, got
    bucket = int(time.time() // every)
    rows = sql("SELECT id, idempotency_key, input FROM engine.task_run WHERE kind = 'verify_library'")
    assert rows == [(uuid.UUID(got[0]), f"verify_library:{bucket}", {"bucket": bucket})]
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'reconcile_downloads'") == 2


def test_reconcile_flags_unknown_and_missing_torrents(
    procs, qbt_factory, tmp_path: Path, qbt_payload: QbtPayload
) -> None:
    managed = qbt_factory("managed", extra_config=LENIENT)
    stranger_dir = tmp_path / "stranger"
    stranger_dir.mkdir()
    (stranger_dir / "x.bin").write_bytes(os.urandom(100_000))
    stranger, stranger_hash = make_torrent(stranger_dir)
    # A torrent carrying our tag that no task knows, and a known one (the payload's).
    add_torrent(managed.client(), stranger, stranger_hash, save_path=tmp_path / "dl", tags=qbt.MANAGED_TAG)
    add_torrent(
        managed.client(),
        qbt_payload.torrent,
        qbt_payload.infohash,
        save_path=tmp_path / "dl",
        tags=qbt.MANAGED_TAG,
    )
    # A task that believes it is downloading, whose torrent is not in qBittorrent at all.
    gone_dir = tmp_path / "gone"
    gone_dir.mkdir()
    (gone_dir / "y.bin").write_bytes(os.urandom(50_000))
    gone_torrent, gone_hash = make_torrent(gone_dir)
    with db.sessions().begin() as s:
        known = service.request_download(s, requester="dave", torrent=qbt_payload.torrent)
        gone = service.request_download(s, requester="dave", torrent=gone_torrent)
        s.flush()
        s.get(DownloadTask, gone).status = "downloading"
        s.get(DownloadTask, known).status = "downloading"
    procs.worker("w1", concurrency=2, env={"QBT_URL": managed.webui_url})

    run_id = enqueue_periodic("reconcile_downloads", 1)
    assert enqueue_periodic("reconcile_downloads", 1) == run_id  # a second beat, same bucket
    wait_ok(procs, lambda: run_status("reconcile_downloads:1") == "succeeded", 30, "reconcile")

    flags = sql("SELECT kind, subject, detail FROM acq.flag ORDER BY kind")
    assert flags == [
        ("missing_torrent", str(gone), {"infohash": gone_hash}),
        ("unknown_torrent", stranger_hash, {"name": "stranger"}),
    ]
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,)) == {
        "unknown": 1,
        "missing": 1,
        "resumed": 0,
        "woken": 0,
    }
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'reconcile_downloads'") == 1
    # Flagging is all it does: the stranger stays where an operator can look at it.
    assert {t.hash for t in managed.client().torrents_info()} == {stranger_hash, qbt_payload.infohash}


def test_reconcile_resumes_a_paused_download(
    procs, qbt_factory, qbt_payload: QbtPayload, tmp_path: Path
) -> None:
    swarm = make_swarm(qbt_factory, qbt_payload, tmp_path, hook=True, upload_limit=64 * 1024)
    env = swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="600")  # only reconcile may touch it
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    key = f"acquire:{task_id}"
    wait_ok(
        procs,
        lambda: task_status(task_id) == "downloading" and step_status(key, "download") == "waiting",
        60,
        "acquire to park on the download",
    )
    client = swarm.managed.client()
    client.torrents_pause(torrent_hashes=swarm.payload.infohash)
    wait_for(
        lambda: client.torrents_info(torrent_hashes=swarm.payload.infohash)[0].state in PAUSED,
        15,
        what="pause",
    )
    time.sleep(1.0)
    assert client.torrents_info(torrent_hashes=swarm.payload.infohash)[0].state in PAUSED

    run_id = enqueue_periodic("reconcile_downloads", 2)
    wait_ok(procs, lambda: run_status("reconcile_downloads:2") == "succeeded", 30, "reconcile")
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,))["resumed"] == 1
    # qBittorrent applies the resume asynchronously: its state follows within a moment.
    wait_for(
        lambda: client.torrents_info(torrent_hashes=swarm.payload.infohash)[0].state not in PAUSED,
        10,
        what="the torrent to leave the paused state",
    )
    assert task_status(task_id) == "downloading"
    assert scalar("SELECT count(*) FROM acq.flag") == 0


def test_reconcile_wakes_a_run_whose_finish_hook_was_lost(
    procs, qbt_factory, qbt_payload: QbtPayload, tmp_path: Path
) -> None:
    swarm = make_swarm(qbt_factory, qbt_payload, tmp_path, hook=False)
    env = swarm.worker_env(ACQ_DOWNLOAD_RECHECK_S="600")  # the timeout would not save us in time
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    key = f"acquire:{task_id}"
    topic = service.download_topic(swarm.payload.infohash)
    wait_ok(
        procs,
        lambda: step_status(key, "download") in ("waiting", "succeeded"),
        60,
        "acquire to check the download",
    )
    assert step_of(key, "download")["status"] == "waiting", "finished before the first check"
    wait_complete(swarm.managed.client(), swarm.payload.infohash, timeout=60)
    time.sleep(1.5)
    # Finished in qBittorrent, but nobody told us: the run still sleeps for ten minutes.
    parked = step_of(key, "download")
    assert parked["status"] == "waiting" and run_status(key) == "waiting"
    assert scalar("SELECT count(*) FROM engine.task_signal WHERE topic = %s", (topic,)) == 0
    assert scalar("SELECT extract(epoch FROM %s - now())", (parked["wait_until"],)) > 500
    assert task_status(task_id) == "downloading"

    run_id = enqueue_periodic("reconcile_downloads", 3)
    pipeline_done(procs, task_id, timeout=60)
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (run_id,))["woken"] == 1
    assert scalar("SELECT count(*) FROM engine.task_signal WHERE topic = %s", (topic,)) == 1
    assert step_of(key, "download")["wakeups"] >= 1
    assert sha256_tree(swarm.library / str(task_id) / swarm.payload.path.name) == swarm.payload.digests


# ----------------------------------------------------------------------------- verify_library


def test_verify_library_flags_corruption_and_reimports(procs, swarm: Swarm, webhook: Receiver) -> None:
    env = swarm.worker_env()
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm, webhook)
    pipeline_done(procs, task_id)
    assert task_status(task_id) == "notified"

    victim_rel = "part-a.bin"
    victim = library_file(swarm, task_id, victim_rel)
    data = bytearray(victim.read_bytes())
    data[1000:1016] = bytes(b ^ 0xFF for b in data[1000:1016])
    victim.write_bytes(bytes(data))
    assert sha256(victim) != swarm.payload.digests[victim_rel]
    item_id = scalar(
        "SELECT id FROM acq.library_item WHERE download_task_id = %s AND rel_path LIKE %s",
        (task_id, f"%/{victim_rel}"),
    )

    bucket = 7
    verify_run = enqueue_periodic("verify_library", bucket)
    reimport_key = f"reimport:{task_id}:{bucket}"
    wait_ok(procs, lambda: run_status(reimport_key) == "succeeded", 60, "the re-import")

    # verify_library saw it: one corrupt of two, a flag, an event, a re-import through the outbox.
    library_bytes = scalar("SELECT sum(size) FROM acq.library_item WHERE download_task_id = %s", (task_id,))
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (verify_run,)) == {
        "checked": 2,
        "hashed": 2,  # a library under VERIFY_MIN_HASH_BYTES is re-hashed whole every run
        "hashed_bytes": library_bytes,
        "corrupt": 1,
    }
    assert sql("SELECT kind, subject FROM acq.flag") == [("corrupt_file", str(item_id))]
    assert sql(
        "SELECT kind, payload, status FROM outbox.outbox_event WHERE idempotency_key = %s", (reimport_key,)
    ) == [("import", {"download_task_id": str(task_id), "generation": bucket}, "dispatched")]
    assert scalar("SELECT kind FROM engine.task_run WHERE idempotency_key = %s", (reimport_key,)) == "import"
    # The re-import copied again (new ledger ops of generation 7) and the file is whole again.
    for rel in swarm.payload.digests:
        assert ledger_op(f"copy:{task_id}:{bucket}:{rel}")[0] == "done"
    assert sha256_tree(swarm.library / str(task_id) / swarm.payload.path.name) == swarm.payload.digests
    items = sql("SELECT id, status, sha256 FROM acq.library_item WHERE download_task_id = %s", (task_id,))
    assert all(st == "ok" for _, st, _ in items), items
    assert scalar("SELECT verified_at IS NOT NULL FROM acq.library_item WHERE id <> %s", (item_id,))
    ev = events(task_id)
    assert ev.index("corruption found") < ev.index("re-imported")
    # The repair does not re-tell the story: status, webhook and outbox are as before.
    assert task_status(task_id) == "notified"
    time.sleep(1.0)
    assert webhook.keys() == [f"notify:{task_id}"]
    assert scalar("SELECT count(*) FROM outbox.outbox_event WHERE status <> 'dispatched'") == 0
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'retire_seed'") == 1
    # The seeded download is still there (retire_seed sleeps for a week by default).
    assert swarm.managed.client().torrents_info()[0].hash == swarm.payload.infohash

    # A second pass finds nothing.
    again = enqueue_periodic("verify_library", bucket + 1)
    wait_ok(procs, lambda: run_status(f"verify_library:{bucket + 1}") == "succeeded", 30, "verify again")
    assert scalar("SELECT result FROM engine.task_run WHERE id = %s", (again,)) == {
        "checked": 2,
        "hashed": 2,
        "hashed_bytes": library_bytes,
        "corrupt": 0,
    }


def test_verify_library_flags_only_the_copy_it_checked() -> None:
    """A re-import or relocation that landed between the check and the flag (new digest, new
    root) is not marked corrupt: `verify_library.mark_corrupt`'s guard is in its WHERE."""
    from proj.kinds.verify_library import mark_corrupt

    task_id = uuid.uuid4()
    with db.sessions().begin() as s:
        s.add(
            DownloadTask(
                id=task_id, requester="erin", title="Checked", infohash="1" * 40, torrent=b"-",
                files=[{"rel_path": "a.bin", "size": 1}], total_size=1, status="notified",
            )
        )  # fmt: skip
        s.flush()
        item = LibraryItem(download_task_id=task_id, rel_path="a.bin", root="/lib", size=1, sha256="a" * 64)
        s.add(item)
    checked = LibraryItem(id=item.id, root="/lib", sha256="a" * 64)
    with db.sessions().begin() as s:  # re-imported meanwhile: another digest
        s.execute(update(LibraryItem).where(LibraryItem.id == item.id).values(sha256="b" * 64))
    with db.sessions().begin() as s:
        assert mark_corrupt(s, checked) is False
    with db.sessions().begin() as s:  # relocated meanwhile: another root, the checked digest
        s.execute(update(LibraryItem).where(LibraryItem.id == item.id).values(sha256="a" * 64, root="/lib2"))
    with db.sessions().begin() as s:
        assert mark_corrupt(s, checked) is False
    assert scalar("SELECT status FROM acq.library_item WHERE id = %s", (item.id,)) == "ok"
    with db.sessions().begin() as s:  # still the copy that was checked
        assert mark_corrupt(s, LibraryItem(id=item.id, root="/lib2", sha256="a" * 64)) is True
    with db.sessions().begin() as s:  # once only
        assert mark_corrupt(s, LibraryItem(id=item.id, root="/lib2", sha256="a" * 64)) is False
    assert scalar("SELECT status FROM acq.library_item WHERE id = %s", (item.id,)) == "corrupt"


# ----------------------------------------------------------------------------------- relocate


def relocate(item_id: int, new_root: Path) -> uuid.UUID:
    return runs.enqueue(
        "relocate", {"library_item_id": item_id, "new_root": str(new_root)}, idempotency_key=new_key()
    ).task_run_id


def test_relocate_moves_a_library_item_and_back_and_again(procs, swarm: Swarm, tmp_path: Path) -> None:
    env = swarm.worker_env()
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    task_id = start(swarm)
    pipeline_done(procs, task_id)
    rel = "part-a.bin"
    item_id, item_rel = sql(
        "SELECT id, rel_path FROM acq.library_item WHERE download_task_id = %s AND rel_path LIKE %s",
        (task_id, f"%/{rel}"),
    )[0]
    digest = swarm.payload.digests[rel]
    other = tmp_path / "other-root"
    other.mkdir()

    def moved_to(root: Path, away_from: Path) -> None:
        assert sha256(library_file(swarm, task_id, rel, root)) == digest
        assert not library_file(swarm, task_id, rel, away_from).exists()
        assert not [p for p in root.rglob("*") if ".part-" in p.name]
        assert scalar("SELECT root FROM acq.library_item WHERE id = %s", (item_id,)) == str(root)

    first = relocate(item_id, other)
    wait_ok(procs, lambda: runs.get(first).status == "succeeded", 30, "relocate")
    moved_to(other, swarm.library)
    assert ledger_op(f"relocate:{item_id}:{first}")[0] == "done"
    assert "relocated" in events(task_id)
    # The other file of the task stays where it was.
    assert sha256(library_file(swarm, task_id, "sub/part-b.bin")) == swarm.payload.digests["sub/part-b.bin"]

    # Back, and to `other` again: each move copies anew (the first move's ledger result names a
    # file the move back deleted; reusing it would leave the item with no copy at all).
    back = relocate(item_id, swarm.library)
    wait_ok(procs, lambda: runs.get(back).status == "succeeded", 30, "relocate back")
    moved_to(swarm.library, other)
    again = relocate(item_id, other)
    wait_ok(procs, lambda: runs.get(again).status == "succeeded", 30, "relocate again")
    moved_to(other, swarm.library)
    assert item_rel.endswith(rel)

    # verify_library follows the item to its new root.
    verify = enqueue_periodic("verify_library", 1)
    wait_ok(procs, lambda: run_status("verify_library:1") == "succeeded", 30, "verify")
    result = scalar("SELECT result FROM engine.task_run WHERE id = %s", (verify,))
    assert (result["checked"], result["hashed"], result["corrupt"]) == (2, 2, 0), result


def test_relocate_input_must_name_an_absolute_root() -> None:
    from proj.engine.errors import InvalidInput

    with pytest.raises(InvalidInput, match="absolute"):
        runs.enqueue(
            "relocate", {"library_item_id": 1, "new_root": "relative/dir"}, idempotency_key=new_key()
        )
    assert scalar("SELECT count(*) FROM engine.task_run") == 0


def test_cancel_stops_a_relocate_mid_copy(procs, tmp_path: Path) -> None:
    old_root, new_root = tmp_path / "lib-a", tmp_path / "lib-b"
    task_id = uuid.uuid4()
    rel = "Big/big.bin"
    src = old_root / str(task_id) / rel
    src.parent.mkdir(parents=True)
    src.write_bytes(os.urandom(8 * 1024 * 1024))  # 128 chunks of 64 KiB: ~6.4 s slowed down
    digest = sha256(src)
    with db.sessions().begin() as s:
        s.add(
            DownloadTask(
                id=task_id,
                requester="erin",
                title="Big",
                infohash="0" * 40,
                torrent=b"-",
                files=[{"rel_path": "big.bin", "size": src.stat().st_size}],
                total_size=src.stat().st_size,
                status="notified",
            )
        )
        s.flush()
        item = LibraryItem(
            download_task_id=task_id, rel_path=rel, root=str(old_root), size=src.stat().st_size, sha256=digest
        )
        s.add(item)
        s.flush()
        item_id = item.id
    procs.worker("w1", concurrency=1, env=SLOW_COPY)
    procs.beat(env=SLOW_COPY)

    run_id = relocate(item_id, new_root)
    dst = new_root / str(task_id) / rel

    def temps() -> list[Path]:
        return sorted(dst.parent.glob(f".{dst.name}.part-*")) if dst.parent.exists() else []

    def size() -> int:
        total = 0
        for p in temps():
            with contextlib.suppress(FileNotFoundError):  # removed between glob and stat
                total += p.stat().st_size
        return total

    wait_ok(procs, lambda: size() >= 1024 * 1024, 30, "the copy to be underway")
    CeleryTaskEngine().cancel(run_id, "operator changed their mind")
    at_cancel, t0, peak = size(), time.monotonic(), 0
    while temps() and time.monotonic() - t0 < 10:
        peak = max(peak, size())
        time.sleep(0.01)
    stopped_after = time.monotonic() - t0
    assert not temps(), "the temp file was not removed"
    assert stopped_after < 1.5, stopped_after
    # The cancel check is cached for 0.2 s, so a few 64 KiB chunks may still land.
    assert peak - at_cancel <= 8 * 65536, (at_cancel, peak)
    wait_ok(procs, lambda: runs.get(run_id).status == "canceled", 15, "the run to be canceled")
    assert step_of_run(run_id, "copy") == "canceled"
    assert step_of_run(run_id, "switch") is None  # never started
    # The old copy is intact and still the one the row points at; nothing at the new root.
    assert sha256(src) == digest
    assert scalar("SELECT root FROM acq.library_item WHERE id = %s", (item_id,)) == str(old_root)
    assert not dst.exists() and not [p for p in new_root.rglob("*") if p.is_file()]
    status, _, _ = ledger_op(f"relocate:{item_id}:{run_id}")
    assert status != "done"
    assert "relocated" not in events(task_id)


def step_of_run(run_id: uuid.UUID, name: str) -> str | None:
    return scalar("SELECT status FROM engine.step WHERE run_id = %s AND name = %s", (run_id, name))


# -------------------------------------------------------------------------------------- purge


def test_purge_drops_finished_steps_keeps_runs_dead_letters_and_unfinished_work(procs) -> None:
    env = {"RETENTION_DAYS": "0"}
    procs.worker("w1", concurrency=2, env=env)
    procs.beat(env=env)
    eng = CeleryTaskEngine()
    done_keys = [new_key(), new_key()]
    done = [runs.enqueue("probe", {"n": i}, idempotency_key=k).task_run_id for i, k in enumerate(done_keys)]
    failed = runs.enqueue("flaky", {}, idempotency_key=new_key()).task_run_id
    waiting = runs.enqueue(
        "signalled", {"topic": "purge:wait", "timeout_s": 600}, idempotency_key=new_key()
    ).task_run_id
    canceled = runs.enqueue(
        "signalled", {"topic": "purge:never", "timeout_s": 600}, idempotency_key=new_key()
    ).task_run_id
    with db.sessions().begin() as s:
        outbox.add(s, "probe", "purge-outbox-1", {"n": 9})
    runs.signal("purge:old")
    wait_ok(procs, lambda: runs.get(canceled).status == "waiting", 20, "a run to park", fail_fast=False)
    eng.cancel(canceled, "test")

    def settled() -> bool:
        statuses = {r: runs.get(r).status for r in (*done, failed, waiting, canceled)}
        dispatched = scalar("SELECT status FROM outbox.outbox_event") == "dispatched"
        ob_run = scalar("SELECT status FROM engine.task_run WHERE idempotency_key = 'purge-outbox-1'")
        return (
            statuses[done[0]] == statuses[done[1]] == "succeeded"
            and statuses[failed] == "failed"
            and statuses[waiting] == "waiting"
            and statuses[canceled] == "canceled"
            and dispatched
            and ob_run == "succeeded"
        )

    try:
        wait_for(settled, 30, what="runs to settle")
    except AssertionError:
        explain(procs)
        raise
    runs_before = scalar("SELECT count(*) FROM engine.task_run")
    failed_steps = scalar("SELECT count(*) FROM engine.step WHERE run_id = %s", (failed,))
    assert scalar("SELECT count(*) FROM engine.step WHERE run_id = ANY(%s)", (done,)) == 10

    purge = enqueue_periodic("purge", 1)
    wait_ok(procs, lambda: runs.get(purge).status == "succeeded", 30, "purge", fail_fast=False)
    result = scalar("SELECT result FROM engine.task_run WHERE id = %s", (purge,))
    assert result["steps"] >= 10 + 5 + 1 and result["outbox"] == 1 and result["signals"] >= 1, result

    # Finished runs lost their steps (and attempts), not their rows.
    finished = [
        *done,
        canceled,
        scalar("SELECT id FROM engine.task_run WHERE idempotency_key = 'purge-outbox-1'"),
    ]
    assert scalar("SELECT count(*) FROM engine.step WHERE run_id = ANY(%s)", (finished,)) == 0
    assert scalar("SELECT count(*) FROM engine.task_run") == runs_before + 1
    assert (
        scalar(
            "SELECT count(*) FROM engine.attempt a "
            "LEFT JOIN engine.step s ON s.id = a.step_id WHERE s.id IS NULL"
        )
        == 0
    )
    assert scalar("SELECT count(*) FROM outbox.outbox_event") == 0
    assert scalar("SELECT count(*) FROM engine.task_signal WHERE topic = 'purge:old'") == 0
    # Idempotency is forever: the same key names the same run, which is not run again.
    again = runs.enqueue("probe", {"n": 0}, idempotency_key=done_keys[0])
    assert again.task_run_id == done[0] and not again.created
    assert runs.get(done[0]).status == "succeeded"
    assert scalar("SELECT count(*) FROM engine.step WHERE run_id = %s", (done[0],)) == 0
    # A dead letter keeps its steps, so an operator can still retry it from the failed step.
    assert scalar("SELECT count(*) FROM engine.step WHERE run_id = %s", (failed,)) == failed_steps
    assert runs.retry_failed(failed) == 1
    # Unfinished work is untouched: the parked run still wakes on its signal and finishes.
    assert scalar("SELECT status FROM engine.step WHERE run_id = %s AND name = 'go'", (waiting,)) == "waiting"
    runs.signal("purge:wait", {"ok": True})
    wait_ok(
        procs,
        lambda: runs.get(waiting).status == "succeeded",
        20,
        "the parked run to finish",
        fail_fast=False,
    )


# ---------------------------------------------------------------------------------- bad input


def single_file(name: str) -> bytes:
    return bencode({"info": {"name": name, "piece length": 16384, "pieces": b"\x00" * 20, "length": 5}})


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(multi_file(["..", "evil"]), id="dotdot"),
        pytest.param(multi_file(["ok", "..", "..", "evil"]), id="dotdot-deep"),
        pytest.param(multi_file(["/etc/passwd"]), id="absolute-segment"),
        pytest.param(multi_file(["", "etc", "passwd"]), id="absolute-split"),
        pytest.param(multi_file(["a", "", "b"]), id="empty-segment"),
        pytest.param(multi_file(["a", ".", "b"]), id="dot-segment"),
        pytest.param(multi_file(["a/../../b"]), id="slash-in-segment"),
        pytest.param(multi_file(["fine.bin"], name="../up"), id="name-escapes"),
        pytest.param(single_file("."), id="single-dot"),
        pytest.param(single_file("/etc/passwd"), id="single-absolute"),
        pytest.param(single_file(""), id="single-empty"),
        pytest.param(b"this is not a torrent", id="junk"),
        pytest.param(os.urandom(4096), id="random"),
        pytest.param(b"i42e", id="not-a-dict"),
        pytest.param(b"de", id="no-info"),
        pytest.param(
            bencode({"comment": "x" * (torrents.MAX_TORRENT_BYTES + 1), "info": {"name": "a", "length": 1}}),
            id="oversized",
        ),
        pytest.param(b"", id="empty"),
    ],
)
def test_bad_torrents_are_refused_and_nothing_is_written(data: bytes, tmp_path: Path) -> None:
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "a.bin").write_bytes(b"a" * 1000)
    good, _ = make_torrent(tmp_path / "good")
    with db.sessions().begin() as s:
        kept = service.request_download(s, requester="frank", torrent=good)

    with pytest.raises(torrents.BadTorrent), db.sessions().begin() as s:
        service.request_download(s, requester="frank", torrent=data)

    # Nothing half-written, and the earlier request is untouched.
    assert sql("SELECT id FROM acq.download_task") == [(kept,)]
    assert sql("SELECT idempotency_key FROM outbox.outbox_event") == [(f"acquire:{kept}",)]
    assert scalar("SELECT count(*) FROM acq.task_event") == 1
    assert scalar("SELECT count(*) FROM engine.task_run WHERE kind = 'acquire'") <= 1


def test_a_good_multi_file_torrent_still_parses() -> None:
    meta = torrents.parse(multi_file(["Season 1", "e01.mkv"], ["e02.mkv"]))
    assert [f.rel_path for f in meta.files] == ["Season 1/e01.mkv", "e02.mkv"]
    assert meta.total_size == 20


# --------------------------------------------------------------------------- /admin timelines


@pytest.fixture
def admin() -> Iterator[TestClient]:
    from proj.admin.app import create_app

    password = "pw-" + uuid.uuid4().hex
    settings = get_settings().model_copy(update={"admin_password": SecretStr(password)})
    with TestClient(create_app(settings)) as c:
        c.auth = ("admin", password)
        yield c


def test_admin_timelines_of_the_acquisition_kinds(admin: TestClient, tmp_path: Path) -> None:
    from proj.admin.timeline import has_hook

    for kind in ("acquire", "import", "notify", "compensate", "retire_seed", "relocate"):
        assert has_hook(kind), kind
    (tmp_path / "Show").mkdir()
    (tmp_path / "Show" / "e01.mkv").write_bytes(os.urandom(2000))
    (tmp_path / "Show" / "e02.mkv").write_bytes(os.urandom(2000))
    data, infohash = make_torrent(tmp_path / "Show")
    with db.sessions().begin() as s:
        task_id = service.request_download(s, requester="grace", torrent=data, title="The Show")
    with db.sessions().begin() as s:
        service.approve(s, task_id, "operator-olga")
        service.event(s, task_id, "torrent added", infohash=infohash)
        service.event(s, task_id, "imported", files=2)
        items = []
        for name in ("e01.mkv", "e02.mkv"):
            it = LibraryItem(
                download_task_id=task_id, rel_path=f"Show/{name}", root="/lib", size=2000, sha256="0" * 64
            )
            s.add(it)
            items.append(it)
        s.flush()
        service.event(s, task_id, "relocated", rel_path="Show/e02.mkv", root="/lib2")
        flag(s, "corrupt_file", str(items[1].id), path="/lib/Show/e02.mkv")
        e02 = items[1].id
    acquire = runs.enqueue(
        "acquire", {"download_task_id": str(task_id)}, idempotency_key=f"acquire:{task_id}"
    )
    acquire_id = acquire.task_run_id
    ids = {
        "acquire": acquire_id,
        "import": runs.enqueue(
            "import", {"download_task_id": str(task_id)}, idempotency_key=new_key()
        ).task_run_id,
        "notify": runs.enqueue(
            "notify", {"download_task_id": str(task_id)}, idempotency_key=new_key()
        ).task_run_id,
        "retire_seed": runs.enqueue(
            "retire_seed",
            {"download_task_id": str(task_id), "seed_until": "2030-01-01T00:00:00+00:00"},
            idempotency_key=new_key(),
        ).task_run_id,
        "compensate": runs.enqueue(
            "compensate",
            {"run_id": str(acquire_id), "kind": "acquire", "input": {"download_task_id": str(task_id)}},
            idempotency_key=new_key(),
        ).task_run_id,
    }
    for kind, run_id in ids.items():
        html = admin.get(f"/admin/runs/{run_id}").text
        for title in ("requested", "approved", "torrent added", "imported", "download task is approved"):
            assert f"<strong>{title}</strong>" in html, (kind, title)
        assert "operator-olga" in html and "The Show" in html and "grace" in html
        assert (
            "no business events recorded" not in html
            and "hook" not in html.split("Business timeline")[1].split("<h2>")[0]
        )

    # relocate: the item's story only (its task's request, its move, its flag).
    relocate_id = relocate(e02, Path("/lib2"))
    html = admin.get(f"/admin/runs/{relocate_id}").text
    body = html.split("Business timeline")[1].split("<h2>")[0]
    assert "<strong>relocated</strong>" in body and "<strong>flagged: corrupt_file</strong>" in body
    assert "<strong>requested</strong>" in body and "torrent added" not in body

    # Structured: the hook's events come from `acq`, and the ledger's from the ledger.
    from proj.admin import queries

    sql(
        "INSERT INTO ledger.asset_operation (op_key, run_id, step, effect_kind, plan, status, "
        "attempt_token, attempt_started_at, result) VALUES (%s, %s, 'add_torrent', 'qbittorrent', "
        "'{}', 'done', gen_random_uuid(), now(), '{}')",
        (f"qbt-add:{task_id}", acquire_id),
    )
    with db.transaction() as s:
        detail = queries.run_detail(s, acquire_id)
    by_source = {e.source for e in detail.timeline}
    assert {"run", "acq", "ledger"} <= by_source
    acq_titles = [e.title for e in detail.timeline if e.source == "acq"]
    assert acq_titles[:4] == ["requested", "approved", "torrent added", "imported"]
    assert acq_titles[-1] == "download task is approved"  # the current status sorts last
    assert any(e.title == f"qbittorrent done: qbt-add:{task_id}" for e in detail.timeline)

    # A run whose task is gone still renders.
    orphan = runs.enqueue(
        "notify", {"download_task_id": str(uuid.uuid4())}, idempotency_key=new_key()
    ).task_run_id
    html = admin.get(f"/admin/runs/{orphan}").text
    assert admin.get(f"/admin/runs/{orphan}").status_code == 200 and "no download task" in html
