"""Review of `ledger/` and `outbox/`: each test here failed on the code before its fix.

Real Postgres and Redis; races are forced with a row lock held in a second connection.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest

import outbox
from ledger import AttemptInProgress, BadOperation, NotDone, run_operation
from outbox import nudge
from proj import db
from tests.conftest import new_key
from tests.support import services
from tests.support.services import scalar, sql, wait_for

# A float whose shortest repr has fewer digits than its exponent: jsonb stores the numeric
# 95402775526376830 and reads it back as that int, which is not equal to the float.
ODD_FLOAT = 9.540277552637683e16


def never(what: str):
    def fn(*_: object) -> Any:
        raise AssertionError(f"{what} must not be called")

    return fn


# --------------------------------------------------------------------------------------------
# ledger


def test_the_same_plan_is_not_a_conflict_when_jsonb_rewrites_a_number() -> None:
    """The plan was compared in Python with what jsonb gave back: a retry with the very same
    plan raised `PlanConflict` instead of returning the stored result."""
    op = f"x:{new_key()}"
    plan = {"size": ODD_FLOAT}
    first = run_operation(db.sessions(), op, plan=plan, effect=lambda att: {"ok": 1}, reconcile=never("r"))
    again = run_operation(db.sessions(), op, plan=plan, effect=never("effect"), reconcile=never("r"))
    assert again == first == {"ok": 1}


def test_a_result_is_returned_in_its_stored_form_on_the_first_call_too() -> None:
    """README: results are returned in their stored form on every call. The first call returned
    the Python round-trip (a float), later calls the jsonb value (another number)."""
    op = f"x:{new_key()}"
    first = run_operation(
        db.sessions(), op, plan={}, effect=lambda att: {"bytes": ODD_FLOAT}, reconcile=never("r")
    )
    again = run_operation(db.sessions(), op, plan={}, effect=never("effect"), reconcile=never("r"))
    assert first == again
    assert type(first["bytes"]) is type(again["bytes"])


def test_an_attempt_that_waited_for_the_row_lock_is_young_when_it_starts() -> None:
    """`attempt_started_at` was the start of the transaction that wrote it (`now()`), not when the
    attempt started: an attempt whose start transaction waited for the row lock looked old at
    once, and a second caller with `takeover_after_s` took a live attempt over (two effects)."""
    op = f"x:{new_key()}"
    takeover = 3.0
    with pytest.raises(RuntimeError):
        run_operation(
            db.sessions(),
            op,
            plan={},
            effect=lambda att: (_ for _ in ()).throw(RuntimeError()),
            reconcile=never("r"),
        )
    sql(
        "UPDATE ledger.asset_operation SET attempt_started_at = now() - interval '1 hour' WHERE op_key = %s",
        (op,),
    )

    in_effect, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    effects: list[uuid.UUID] = []

    def slow_effect(att: Any) -> dict[str, int]:
        effects.append(att.token)
        in_effect.set()
        release.wait(60)
        return {"ok": 1}

    def attempt_a() -> None:
        try:
            outcome["a"] = run_operation(
                db.sessions(),
                op,
                plan={},
                effect=slow_effect,
                reconcile=lambda att: NotDone(),
                takeover_after_s=takeover,
            )
        except BaseException as exc:  # reported by the assertions below
            outcome["a"] = exc

    holder = psycopg.connect(services.pg_url())
    thread = threading.Thread(target=attempt_a)
    try:
        holder.execute("SELECT 1 FROM ledger.asset_operation WHERE op_key = %s FOR UPDATE", (op,))
        thread.start()
        wait_for(
            lambda: (
                scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database() "
                    "AND query LIKE '%%asset_operation%%FOR UPDATE%%'"
                )
                == 1
            ),
            30,
            what="attempt A waiting for the row lock",
        )
        time.sleep(takeover + 1)  # A's transaction is now older than takeover_after_s
        holder.commit()
        assert in_effect.wait(30), f"attempt A did not start its effect: {outcome}"

        # A live attempt started a moment ago: B must not take it over.
        with pytest.raises(AttemptInProgress):
            run_operation(
                db.sessions(),
                op,
                plan={},
                effect=never("effect"),
                reconcile=never("reconcile"),
                takeover_after_s=takeover,
            )
    finally:
        release.set()
        holder.close()
        thread.join(60)
    assert outcome["a"] == {"ok": 1}
    assert len(effects) == 1


@pytest.mark.parametrize("what", ["key", "plan"])
def test_a_key_or_plan_postgres_cannot_store_is_a_bad_operation(what: str) -> None:
    """README: a bad key or plan raises `BadOperation` (a `ValueError`). A NUL or an unpaired
    surrogate (a file name decoded with surrogateescape) came out as a raw driver error."""
    for bad in ("a\x00b", "caf\udce9.mkv"):
        op = f"x:{new_key()}:{bad}" if what == "key" else f"x:{new_key()}"
        plan = {} if what == "key" else {"path": bad}
        with pytest.raises(BadOperation):
            run_operation(db.sessions(), op, plan=plan, effect=never("effect"), reconcile=never("r"))
    assert scalar("SELECT count(*) FROM ledger.asset_operation") == 0


# --------------------------------------------------------------------------------------------
# outbox


@pytest.fixture
def no_nudge():
    import proj.celery  # noqa: F401

    previous = outbox.set_nudger(None)
    yield
    nudge.restore_nudger(previous)


class PickyEngine:
    """Refuses the keys in `bad` with the given exception, accepts the others (records them)."""

    def __init__(self, bad: Mapping[str, BaseException]) -> None:
        self.bad = bad
        self.accepted: list[str] = []

    def enqueue(self, kind: str, input: Mapping[str, Any], *, idempotency_key: str) -> Any:
        if idempotency_key in self.bad:
            raise self.bad[idempotency_key]
        self.accepted.append(idempotency_key)
        return uuid.uuid4()


@pytest.mark.parametrize("message", ["broker said \x00", "no such file caf\udce9.mkv"])
def test_an_error_postgres_cannot_store_does_not_block_the_batch(no_nudge, message: str) -> None:
    """The failure of one row is recorded on that row (`last_error`). An error text with a NUL or
    an unpaired surrogate made the batch's commit fail: the other rows' marks were rolled back,
    the failing row never counted its attempts, so it never went dead and blocked them forever."""
    poison, good = new_key(), [new_key(), new_key()]
    with db.transaction() as s:
        for key in (poison, *good):
            outbox.add(s, "probe", key, {"n": 1})
    engine = PickyEngine({poison: RuntimeError(message)})
    policy = outbox.RetryPolicy(max_attempts=2, initial_s=0.0, max_s=0.0)
    outbox.dispatch(db.sessions(), engine, policy=policy)
    outbox.dispatch(db.sessions(), engine, policy=policy)
    assert sorted(engine.accepted) == sorted(good)
    got = dict(sql("SELECT idempotency_key, status FROM outbox.outbox_event"))
    assert got == {poison: "dead", good[0]: "dispatched", good[1]: "dispatched"}
    error = scalar("SELECT last_error FROM outbox.outbox_event WHERE idempotency_key = %s", (poison,))
    assert error["type"] == "RuntimeError" and error["attempt"] == 2


@pytest.mark.parametrize("plan", [None, [], "s", 0, {"a": [1, 2.5, None]}])
def test_any_json_plan_is_the_same_plan_again(plan: Any) -> None:
    op = f"x:{new_key()}"
    first = run_operation(db.sessions(), op, plan=plan, effect=lambda att: None, reconcile=never("r"))
    again = run_operation(db.sessions(), op, plan=plan, effect=never("effect"), reconcile=never("r"))
    assert first is None and again is None


@pytest.mark.parametrize("message", ["qbt said \x00", "no such file caf\udce9.mkv"])
def test_an_effect_error_postgres_cannot_store_is_still_recorded(message: str) -> None:
    """README: the effect's own exceptions are stored in `last_error`. One whose text holds a NUL
    or an unpaired surrogate was not (the write failed and only a warning was logged)."""
    op = f"x:{new_key()}"

    def fails(att: Any) -> Any:
        raise RuntimeError(message)

    with pytest.raises(RuntimeError):
        run_operation(db.sessions(), op, plan={}, effect=fails, reconcile=never("r"))
    error = scalar("SELECT last_error FROM ledger.asset_operation WHERE op_key = %s", (op,))
    assert error is not None, "the effect's error was not recorded"
    assert error["type"] == "RuntimeError" and message.split()[0] in error["message"]
