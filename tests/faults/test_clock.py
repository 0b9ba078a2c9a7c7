"""Leases and timers use the database's clock only (issue #18, item 7).

The worker and beat processes run with their wall clock moved by ten minutes, either way
(libfaketime, `LD_PRELOAD`). Nothing changes: a step longer than the lease keeps its lease (the
heartbeat extends `now() + ttl` on the server) and runs once; a wait's 3-second timer fires after
about three real seconds (`wait_until` and the sweeper's `<= now()` are both the server's).
Had either side used the process clock, the lease would be lost at once (or never), and the timer
would fire at once or ten minutes late.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proj.engine import runs
from tests.conftest import new_key
from tests.support.services import scalar, sql, wait_for

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")
SITE = Path(__file__).resolve().parents[1] / "support" / "faketime_site"

pytestmark = pytest.mark.timeout(180)


def status(run_id: object) -> str:
    return str(scalar("SELECT status FROM engine.task_run WHERE id = %s", (run_id,)))


def skewed(offset: str) -> dict[str, str]:
    if not LIBFAKETIME.exists():
        pytest.fail("libfaketime is not installed: run `bash scripts/setup` (apt-get install faketime)")
    # The wall clock only, as on a host whose clock is wrong; the monotonic clock stays true.
    # tests/support/faketime_site works around libfaketime's sleep with a real monotonic clock.
    path = os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")])
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": offset,
        "DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": path,
    }


@pytest.mark.parametrize("offset", ["+10m", "-10m"])
def test_a_skewed_worker_clock_changes_neither_leases_nor_timers(procs, offset: str) -> None:
    env = skewed(offset)
    probe = subprocess.run(
        [sys.executable, "-c", "import time; time.sleep(0.01); print(time.time())"],
        env={**env, "PATH": "/usr/bin:/bin"},  # also checks that the sleep workaround loads
        capture_output=True,
        text=True,
        check=True,
    )
    skew = float(probe.stdout) - time.time()
    assert abs(abs(skew) - 600) < 30, f"faketime did not move the clock ({skew:.0f}s)"

    procs.worker("skewed", concurrency=2, env=env)
    procs.beat(env=env)
    # A step twice as long as the 3 s lease: kept alive by the heartbeat, on the server's clock.
    slow = runs.enqueue("probe", {"slow_step": "s2", "slow_s": 6.0}, idempotency_key=new_key())
    # A wait whose timer is 3 s: parked, then woken by the sweeper when the server says so.
    key = new_key()
    gated = runs.enqueue("gated", {"key": key, "timeout_s": 3.0}, idempotency_key=new_key())
    wait_for(lambda: status(gated.task_run_id) == "waiting", 30, what="the wait to park")
    parked_for = scalar(
        "SELECT extract(epoch FROM wait_until - now()) FROM engine.step "
        "WHERE run_id = %s AND name = 'approval'",
        (gated.task_run_id,),
    )
    assert 1.0 < parked_for <= 3.5, f"the timer is {parked_for:.1f}s away, not ~3s"
    sql("INSERT INTO testkit.approval (key, approved) VALUES (%s, true)", (key,))  # no signal sent
    began = time.monotonic()
    wait_for(
        lambda: (
            scalar("SELECT status FROM engine.task_run WHERE id = %s", (gated.task_run_id,)) == "succeeded"
        ),
        30,
        what="the timer to wake the wait",
    )
    woke_after = time.monotonic() - began
    assert woke_after < 15, f"the timer fired after {woke_after:.0f}s"

    wait_for(
        lambda: (
            scalar("SELECT status FROM engine.task_run WHERE id = %s", (slow.task_run_id,)) == "succeeded"
        ),
        60,
        what="the slow run",
    )
    s2 = sql("SELECT count(*) FROM testkit.execution WHERE run_id = %s AND step = 's2'", (slow.task_run_id,))[
        0
    ][0]
    assert s2 == 1, "the slow step lost its lease and ran again"
    attempts = scalar(
        "SELECT attempts FROM engine.step WHERE run_id = %s AND name = 's2'", (slow.task_run_id,)
    )
    assert attempts == 1
