"""Invariant 4: every side effect goes through the ledger and happens once.

Effects are real: a line appended to a file and a POST to a local HTTP receiver that counts every
request. Assertions read the file, the receiver's count and the `ledger.asset_operation` rows.
The first tests drive `ledger.run_operation` directly; the last ones run the `effects` kind in
real `celery -A proj worker` processes that are SIGKILLed or SIGSTOPped mid-operation.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ledger import (
    AttemptInProgress,
    CommitRefused,
    Done,
    NotDone,
    PlanConflict,
    run_operation,
)
from proj import db
from proj.engine import runs
from tests.conftest import new_key
from tests.kinds_effects import (
    Receiver,
    append_line,
    file_reconcile,
    http_reconcile,
    lines_for,
    post_effect,
    read_journal,
)
from tests.support.services import scalar, sql, wait_for


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def op_row(op_key: str) -> dict[str, Any] | None:
    rows = sql(
        "SELECT status, attempts, attempt_token, result, resolution, last_error, run_id, step, "
        "effect_kind, plan FROM ledger.asset_operation WHERE op_key = %s",
        (op_key,),
    )
    if not rows:
        return None
    keys = (
        "status",
        "attempts",
        "attempt_token",
        "result",
        "resolution",
        "last_error",
        "run_id",
        "step",
        "effect_kind",
        "plan",
    )
    return dict(zip(keys, rows[0], strict=True))


def never(what: str):
    def fn(*_: object) -> Any:
        raise AssertionError(f"{what} must not be called")

    return fn


# --------------------------------------------------------------------------------------------
# run_operation on its own


def test_stored_result_is_returned_without_calling_anything(receiver) -> None:
    key = new_key()
    sessions = db.sessions()
    first = run_operation(
        sessions,
        f"http:{key}",
        plan={"key": key},
        effect=lambda att: post_effect(receiver.url, key),
        reconcile=never("reconcile"),
        effect_kind="http",
    )
    assert first == {"receipt": 1}
    again = run_operation(
        sessions, f"http:{key}", plan={"key": key}, effect=never("effect"), reconcile=never("reconcile")
    )
    assert again == first
    assert receiver.count(key) == 1
    row = op_row(f"http:{key}")
    assert row["status"] == "done" and row["attempts"] == 1 and row["resolution"] == "effect"
    assert row["result"] == {"receipt": 1} and row["effect_kind"] == "http"


def test_same_key_with_another_plan_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    op = f"file:{new_key()}"
    run_operation(
        db.sessions(),
        op,
        plan={"path": str(path), "size": 1},
        effect=lambda att: append_line(path, f"{op} {att.token}") or {"ok": True},
        reconcile=never("reconcile"),
    )
    before = op_row(op)
    with pytest.raises(PlanConflict, match="already planned"):
        run_operation(
            db.sessions(),
            op,
            plan={"path": str(path), "size": 2},
            effect=never("effect"),
            reconcile=never("r"),
        )
    assert op_row(op) == before
    assert len(lines_for(path, op)) == 1


def test_superseded_attempt_commit_is_refused_and_stored_result_untouched(receiver) -> None:
    """Attempt 1 POSTs, then stalls before committing; attempt 2 takes over, reconciles with the
    receiver and commits. Attempt 1's late commit is refused and changes nothing."""
    key = new_key()
    op = f"http:{key}"
    release = threading.Event()
    outcome: dict[str, BaseException | Any] = {}

    def slow_effect(att) -> dict[str, Any]:
        result = post_effect(receiver.url, key)
        release.wait(30)
        return {**result, "by": "attempt-1"}

    def first() -> None:
        try:
            outcome["value"] = run_operation(
                db.sessions(), op, plan={"key": key}, effect=slow_effect, reconcile=never("reconcile")
            )
        except BaseException as exc:
            outcome["error"] = exc

    t = threading.Thread(target=first)
    t.start()
    wait_for(lambda: receiver.count(key) == 1, 10, what="attempt 1 to POST")
    token1 = op_row(op)["attempt_token"]

    second = run_operation(
        db.sessions(),
        op,
        plan={"key": key},
        effect=never("a second effect"),
        reconcile=lambda att: http_reconcile(receiver.url, key),
    )
    assert second == {"receipt": 1}
    stored = op_row(op)
    assert stored["status"] == "done" and stored["resolution"] == "reconciled"
    assert stored["attempts"] == 2 and stored["attempt_token"] != token1

    release.set()
    t.join(30)
    assert "value" not in outcome
    err = outcome["error"]
    assert isinstance(err, CommitRefused)
    assert err.token == token1 and "already done" in str(err) and "untouched" in str(err)
    assert op_row(op) == stored
    assert receiver.count(key) == 1


def test_fence_refuses_start_and_commit_of_a_stale_caller(tmp_path: Path) -> None:
    """The caller's fence (its lease) is checked where the attempt starts and where it commits."""
    path = tmp_path / "out.txt"
    op = f"file:{new_key()}"
    lease = {"held": True}

    def fence(session) -> None:
        assert session.execute(text("SELECT 1")).scalar() == 1  # runs in the ledger's tx
        if not lease["held"]:
            raise RuntimeError("lease lost")

    def write(att) -> dict[str, Any]:
        append_line(path, f"{op} {att.token}")
        lease["held"] = False  # the lease expires while the effect runs
        return {"token": str(att.token)}

    with pytest.raises(CommitRefused, match="fence refused"):
        run_operation(
            db.sessions(), op, plan={"p": str(path)}, effect=write, reconcile=never("r"), fence=fence
        )
    row = op_row(op)
    assert row["status"] == "attempting" and row["result"] is None and row["attempts"] == 1
    token1 = row["attempt_token"]

    # Still stale: it may not even take the operation over.
    with pytest.raises(CommitRefused, match="start an attempt"):
        run_operation(
            db.sessions(), op, plan={"p": str(path)}, effect=never("e"), reconcile=never("r"), fence=fence
        )
    assert op_row(op)["attempt_token"] == token1 and op_row(op)["attempts"] == 1

    # A caller that holds its lease reconciles with the file and finishes without a redo.
    lease["held"] = True
    result = run_operation(
        db.sessions(),
        op,
        plan={"p": str(path)},
        effect=never("a second effect"),
        reconcile=lambda att: file_reconcile(str(path), op),
        fence=fence,
    )
    assert result == {"path": str(path), "token": str(token1)}
    assert len(lines_for(path, op)) == 1
    row = op_row(op)
    assert row["status"] == "done" and row["resolution"] == "reconciled" and row["attempts"] == 2


def test_not_done_redoes_the_effect_once(receiver) -> None:
    key = new_key()
    op = f"http:{key}"

    def crashes_before_posting(att) -> dict[str, Any]:
        raise ConnectionError("connection reset before the request was sent")

    with pytest.raises(ConnectionError):
        run_operation(db.sessions(), op, plan={"k": key}, effect=crashes_before_posting, reconcile=never("r"))
    row = op_row(op)
    assert row["status"] == "attempting" and row["last_error"]["type"] == "ConnectionError"
    assert receiver.count(key) == 0

    reconciled: list[object] = []

    def reconcile(att):
        verdict = http_reconcile(receiver.url, key)
        reconciled.append((att.number, att.previous_token, verdict))
        return verdict

    result = run_operation(
        db.sessions(),
        op,
        plan={"k": key},
        effect=lambda att: post_effect(receiver.url, key),
        reconcile=reconcile,
    )
    assert result == {"receipt": 1}
    assert receiver.count(key) == 1
    assert len(reconciled) == 1 and isinstance(reconciled[0][2], NotDone)
    assert reconciled[0][0] == 2 and reconciled[0][1] == row["attempt_token"]
    row = op_row(op)
    assert row["status"] == "done" and row["resolution"] == "effect" and row["attempts"] == 2
    assert row["last_error"] is None


def test_reconcile_must_say_done_or_not_done(receiver) -> None:
    key = new_key()
    op = f"http:{key}"
    with pytest.raises(ConnectionError):
        run_operation(
            db.sessions(),
            op,
            plan={},
            effect=lambda att: (_ for _ in ()).throw(ConnectionError()),
            reconcile=never("r"),
        )
    with pytest.raises(TypeError, match=r"Done\(result\) or NotDone"):
        run_operation(db.sessions(), op, plan={}, effect=never("effect"), reconcile=lambda att: {"n": 1})
    assert op_row(op)["status"] == "attempting"
    assert op_row(op)["last_error"]["type"] == "TypeError"
    done = run_operation(db.sessions(), op, plan={}, effect=never("effect"), reconcile=lambda att: Done(7))
    assert done == 7 and op_row(op)["result"] == 7


def test_takeover_after_refuses_a_young_attempt() -> None:
    op = f"x:{new_key()}"
    with pytest.raises(RuntimeError):
        run_operation(
            db.sessions(),
            op,
            plan={},
            effect=lambda att: (_ for _ in ()).throw(RuntimeError()),
            reconcile=never("r"),
        )
    token = op_row(op)["attempt_token"]
    with pytest.raises(AttemptInProgress):
        run_operation(
            db.sessions(), op, plan={}, effect=never("e"), reconcile=never("r"), takeover_after_s=60
        )
    assert op_row(op)["attempt_token"] == token
    sql("UPDATE ledger.asset_operation SET attempt_started_at = now() - interval '2 minutes'")
    assert (
        run_operation(
            db.sessions(), op, plan={}, effect=never("e"), reconcile=lambda a: Done("ok"), takeover_after_s=60
        )
        == "ok"
    )


# --------------------------------------------------------------------------------------------
# from a step


def _effects_input(tmp_path: Path, receiver: Receiver, **faults: Any) -> dict[str, Any]:
    return {
        "op": uuid.uuid4().hex,
        "url": receiver.url,
        "path": str(tmp_path / "effects.txt"),
        "journal": str(tmp_path / "journal.jsonl"),
        **faults,
    }


def _run_status(run_id) -> str:
    return scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,))


def _step(run_id) -> tuple[int, int, str]:
    rows = sql("SELECT id, attempts, status FROM engine.step WHERE run_id = %s", (run_id,))
    assert len(rows) == 1
    return rows[0]


def test_step_effects_are_recorded_with_run_and_step(inproc, tmp_path, receiver) -> None:
    inp = _effects_input(tmp_path, receiver)
    ref = inproc.enqueue("effects", inp, idempotency_key=new_key())
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 30, what="run done")
    for op, kind in ((f"file:{inp['op']}", "file"), (f"http:{inp['op']}", "http")):
        row = op_row(op)
        assert row["status"] == "done" and row["attempts"] == 1 and row["resolution"] == "effect"
        assert row["run_id"] == ref.task_run_id and row["step"] == "deliver" and row["effect_kind"] == kind
    assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
    assert receiver.count(inp["op"]) == 1
    assert inproc.get(ref.task_run_id).result["http"] == {"receipt": 1}


@pytest.mark.parametrize("where", ["file", "http"])
def test_kill_9_between_effect_and_commit_reconciles_without_a_second_effect(
    procs, tmp_path, receiver, where
) -> None:
    """The worker process dies right after the effect, before the ledger commit. The sweeper
    re-runs the step elsewhere; reconcile finds the effect; it is not performed again."""
    procs.worker("w1", concurrency=2)
    procs.worker("w2", concurrency=2)
    procs.beat()
    inp = _effects_input(tmp_path, receiver, kill_in=where, kill_when="after")
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 60, what="run to recover and finish")

    assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
    assert receiver.count(inp["op"]) == 1
    killed = op_row(f"{where}:{inp['op']}")
    assert killed["status"] == "done" and killed["resolution"] == "reconciled" and killed["attempts"] == 2
    other = op_row(f"{'http' if where == 'file' else 'file'}:{inp['op']}")
    assert other["status"] == "done" and other["resolution"] == "effect" and other["attempts"] == 1

    step_id, attempts, status = _step(ref.task_run_id)
    assert status == "succeeded" and attempts == 2
    outcomes = sql(
        "SELECT attempt, outcome FROM engine.attempt WHERE step_id = %s ORDER BY attempt", (step_id,)
    )
    assert outcomes == [(1, None), (2, "succeeded")], "attempt 1 died without closing its row"
    assert_killed(procs, inp["journal"])


def test_kill_9_before_the_effect_reconcile_says_not_done_and_it_is_redone_once(
    procs, tmp_path, receiver
) -> None:
    procs.worker("w1", concurrency=2)
    procs.worker("w2", concurrency=2)
    procs.beat()
    inp = _effects_input(tmp_path, receiver, kill_in="http", kill_when="before")
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 60, what="run to recover and finish")

    assert receiver.count(inp["op"]) == 1
    http = op_row(f"http:{inp['op']}")
    assert http["status"] == "done" and http["resolution"] == "effect" and http["attempts"] == 2
    file = op_row(f"file:{inp['op']}")
    assert file["attempts"] == 1 and file["resolution"] == "effect"
    assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
    assert _step(ref.task_run_id)[1:] == (2, "succeeded")
    assert_killed(procs, inp["journal"])


def assert_killed(procs, journal_path: str) -> None:
    """The first attempt's process really died: it journaled the kill and is gone."""
    kills = [e for e in read_journal(journal_path) if e["event"] == "kill"]
    assert len(kills) == 1 and kills[0]["attempt"] == 1
    pid = kills[0]["pid"]
    wait_for(lambda: pid not in procs.children("w1") + procs.children("w2"), 10, what=f"pid {pid} to be gone")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("when", ["after", "before"])
def test_sigstopped_attempt_is_refused_and_the_effect_happens_once(procs, tmp_path, receiver, when) -> None:
    """The worker holding the HTTP operation is frozen (SIGSTOP) past its lease, either after it
    POSTed (`after`) or just before (`before`). Another worker takes the step over: it reconciles
    (`after`: found, `before`: not found, so it POSTs). When the frozen worker resumes, its
    check/commit is refused, and the receiver has seen exactly one request."""
    procs.worker("frozen", concurrency=1)
    inp = _effects_input(tmp_path, receiver, hold_in="http", hold_when=when, hold_s=15.0)
    ref = runs.enqueue("effects", inp, idempotency_key=new_key())
    holding = wait_for(
        lambda: [e for e in read_journal(inp["journal"]) if e["event"] == "hold"], 30, what="the hold"
    )
    frozen_pid = holding[0]["pid"]
    assert frozen_pid in procs.children("frozen")
    assert receiver.count(inp["op"]) == (1 if when == "after" else 0)
    procs.worker("rescuer", concurrency=2)
    procs.beat()
    procs.signal("frozen", signal.SIGSTOP)
    try:
        wait_for(lambda: _run_status(ref.task_run_id) == "succeeded", 60, what="the rescuer to finish")
        stored = op_row(f"http:{inp['op']}")
        assert stored["status"] == "done" and stored["attempts"] == 2
        assert stored["resolution"] == ("reconciled" if when == "after" else "effect")
    finally:
        procs.signal("frozen", signal.SIGCONT)

    refused = wait_for(
        lambda: [e for e in read_journal(inp["journal"]) if e["event"] == "refused"],
        40,
        what="the frozen attempt to try to go on",
    )
    assert [e["pid"] for e in refused] == [frozen_pid]
    assert refused[0]["error"] in ("CommitRefused", "LeaseLost")
    assert op_row(f"http:{inp['op']}") == stored, "the refused attempt changed the stored row"
    assert receiver.count(inp["op"]) == 1
    assert len(lines_for(inp["path"], f"file:{inp['op']}")) == 1
    assert _step(ref.task_run_id)[1:] == (2, "succeeded")


# --------------------------------------------------------------------------------------------
# packaging


def schema_diff(schema: str, metadata) -> list:
    """What alembic's autogenerate sees between the typed models and the migrated database."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    def include_name(name, type_, parent) -> bool:
        return name == schema if type_ == "schema" else True

    with db.get_engine().connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={"include_schemas": True, "include_name": include_name, "compare_server_default": True},
        )
        return compare_metadata(ctx, metadata)


def test_models_match_the_migration() -> None:
    import ledger

    assert schema_diff("ledger", ledger.Base.metadata) == []


def test_ledger_and_outbox_do_not_import_proj() -> None:
    import subprocess
    import sys

    from tests.support.services import ROOT

    code = (
        "import sys, ledger, outbox, outbox.celery, outbox.nudge\n"
        "bad = sorted(m for m in sys.modules if m == 'proj' or m.startswith('proj.'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
