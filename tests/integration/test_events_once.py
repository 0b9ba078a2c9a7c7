"""A step's timeline event is written once, even when the step runs again because its own commit
did not land (a worker killed between the business commit and the step's commit).

The steps run in this process (`protocol.execute`, no Celery). The step's commit fails once, as
if the worker died right before it: with the event in a transaction of its own (`ctx.fenced()`)
the event had committed already and the retry wrote it a second time; with `ctx.finish(result)`
the event and the result commit together, so nothing of the lost attempt remains.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

import proj.kinds  # noqa: F401 - registers the acquisition kinds
from proj import db
from proj.acquisition import qbt, service
from proj.acquisition.models import DownloadTask
from proj.engine import commits, protocol, runs
from proj.qbt.local import LocalQbittorrent
from proj.settings import get_settings
from tests.conftest import new_key
from tests.qbt_fixtures import *  # noqa: F403
from tests.support.services import scalar, sql
from tests.support.steps import first_step
from tests.support.torrents import multi_file

pytestmark = pytest.mark.timeout(60)


def lose_the_commit_once(monkeypatch: pytest.MonkeyPatch, step: str) -> list[str]:
    """The first commit of `step`'s success raises (the worker "died" before it landed); the
    step is then retried like any failed attempt. Returns the steps whose commit was lost."""
    lost: list[str] = []
    real = commits.commit_success

    def commit_success(c: Any, *args: Any, **kwargs: Any) -> Any:
        if c.name == step and not lost:
            lost.append(c.name)
            raise RuntimeError(f"worker killed before {step}'s commit")
        return real(c, *args, **kwargs)

    # Both callers: the body's own `finish()` (commits.InBodyCommit) and the engine after the body.
    monkeypatch.setattr(commits, "commit_success", commit_success)
    monkeypatch.setattr(protocol, "commit_success", commit_success)
    return lost


def run_again(run_id: uuid.UUID, step: str) -> str:
    """Make the retried step due now and run it (as a worker would on its next message)."""
    step_id = scalar("SELECT id FROM engine.step WHERE run_id = %s AND name = %s", (run_id, step))
    assert scalar("SELECT status FROM engine.step WHERE id = %s", (step_id,)) == "pending"
    sql("UPDATE engine.step SET next_attempt_at = now() WHERE id = %s", (step_id,))
    return protocol.execute(step_id, limited=False)


def new_task(status: str) -> uuid.UUID:
    torrent = multi_file(["e01.mkv"], name="show")
    task_id = uuid.uuid4()
    with db.sessions().begin() as s:
        s.add(
            DownloadTask(
                id=task_id,
                requester="rita",
                title="Once",
                infohash=uuid.uuid4().hex[:40].ljust(40, "0"),
                torrent=torrent,
                files=[{"rel_path": "e01.mkv", "size": 10}],
                total_size=10,
                status=status,
            )
        )
    return task_id


def events(task_id: uuid.UUID, what: str) -> int:
    return int(
        scalar(
            "SELECT count(*) FROM acq.task_event WHERE download_task_id = %s AND what = %s", (task_id, what)
        )
    )


def run_twice(published: list[Any], kind: str, inp: dict[str, Any], step: str, lost: list[str]) -> uuid.UUID:
    run_id = runs.enqueue(kind, inp, idempotency_key=new_key()).task_run_id
    assert protocol.execute(first_step(run_id), starts_run=True, limited=False) == "retry"
    assert lost == [step], "the step's first commit was lost"
    assert run_again(run_id, step) == "succeeded"
    assert scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)) == "succeeded"
    return run_id


def test_compensated_once_after_a_lost_step_commit(published, monkeypatch, tmp_path: Path) -> None:
    """`compensate.mark_compensated` runs twice; the request has one `compensated` event."""
    monkeypatch.setattr(get_settings(), "library_root", str(tmp_path))
    task_id = new_task("canceling")
    lost = lose_the_commit_once(monkeypatch, "mark")
    inp = {"run_id": str(uuid.uuid4()), "kind": "acquire", "input": {"download_task_id": str(task_id)}}

    run_twice(published, "compensate", inp, "mark", lost)

    assert events(task_id, "compensated") == 1
    assert scalar("SELECT status FROM acq.download_task WHERE id = %s", (task_id,)) == "canceled"


def test_seeding_retired_once_after_a_lost_step_commit(
    published, monkeypatch, qbt_managed: LocalQbittorrent
) -> None:
    """`retire_seed.retire` runs twice (its qBittorrent effect once, by the ledger); the request
    has one `seeding retired` event."""
    monkeypatch.setattr(get_settings(), "qbt_url", qbt_managed.webui_url)
    monkeypatch.setattr(qbt._local, "client", None, raising=False)  # not a client of another test's
    task_id = new_task(service.RequestStatus.NOTIFIED)
    lost = lose_the_commit_once(monkeypatch, "retire")
    inp = {"download_task_id": str(task_id), "seed_until": "2000-01-01T00:00:00Z"}

    run_twice(published, "retire_seed", inp, "retire", lost)

    assert events(task_id, "seeding retired") == 1
    infohash = scalar("SELECT infohash FROM acq.download_task WHERE id = %s", (task_id,))
    op = sql(
        "SELECT attempts, result FROM ledger.asset_operation WHERE op_key = %s", (f"qbt-retire:{task_id}",)
    )
    assert op == [(1, {"retired": infohash})], "the effect ran once; the retry found its result"
