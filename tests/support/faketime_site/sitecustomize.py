"""Loaded (via PYTHONPATH) only by the processes tests/faults/test_clock.py runs under libfaketime.

libfaketime moves the wall clock; the monotonic clock is left alone (DONT_FAKE_MONOTONIC), as on
a host whose clock is simply wrong. Its clock_nanosleep wrapper then rejects Python's absolute
monotonic deadlines (EINVAL from time.sleep), a defect of the tool, not of a skewed host; this
sleeps on a monotonic condition wait instead, which it leaves intact.
"""

import threading
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


time.sleep = _sleep
