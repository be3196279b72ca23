"""ddp_sigterm/_core/deadline.py: the stop deadline and the third request end a process that cannot stop, in a
process of its own (it ends the process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ddp_sigterm._core.exit_codes import GAVE_UP

# The main thread blocks in os.read, as it would in a collective waiting for a stuck peer; the
# recording handler runs (PEP 475 retries the read), the stop is never decided.
_BLOCKED = """
import os, signal, sys
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.runtime import Runtime
from ddp_sigterm._core.signals import SignalRecorder
deadline = Deadline(float(sys.argv[1]), (signal.SIGTERM,), "rank 0 of 2", lambda: "a peer that never answers")
Runtime(SignalRecorder((signal.SIGTERM,))).start(handlers=True, deadline=deadline)
print("ready", flush=True)
os.read(os.pipe()[0], 1)
"""


def _blocked_child(deadline: float) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", _BLOCKED, str(deadline)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline() == "ready\n"
    return child


def _ended(child: subprocess.Popen, since: float) -> tuple[str, float]:
    """The child's stderr once it has ended (within 60 s, or it is killed with its group), and the seconds ``since``."""
    try:
        _, err = child.communicate(timeout=60)
        return err, time.monotonic() - since
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)


@pytest.mark.parametrize("signals", [1, 2, 3], ids=["deadline", "burst", "third-request"])
def test_deadline_ends_a_blocked_process_with_the_reason(signals: int) -> None:
    """``burst``: three signals within milliseconds (a scheduler, then a launcher forwarding) are one
    request; ``third-request``: three signals 2 s apart end the process at the third."""
    child = _blocked_child(deadline=2.0 if signals < 3 else 30.0)
    sent = time.monotonic()
    try:
        for _ in range(1 if signals == 1 else 3):
            os.kill(child.pid, signal.SIGTERM)
            time.sleep(0.01 if signals == 2 else 2.0)
    finally:
        err, took = _ended(child, sent)
    assert child.returncode == GAVE_UP, err
    assert "ddp_sigterm: rank 0 of 2: " in err, err
    assert "it was waiting for a peer that never answers" in err, err
    if signals < 3:
        assert "did not complete within stop_deadline=2 s of the first SIGTERM" in err
        assert 1.9 < took < 30, took
    else:
        assert "SIGTERM received a third time (at least 1 s apart)" in err
        assert took < 20, took  # at the third request (4 s), not at the deadline (30 s)


_NOTICED = """
import os, signal, sys, time
from ddp_sigterm._core.deadline import Deadline
from ddp_sigterm._core.runtime import Runtime
from ddp_sigterm._core.signals import SignalRecorder
deadline = Deadline(30.0, (signal.SIGTERM,), "rank 1 of 2", lambda: "a peer that never answers")
Runtime(SignalRecorder((signal.SIGTERM,))).start(handlers=True, deadline=deadline)
deadline.arm(time.monotonic(), "the aws preemption notice (terminate at ...)", within=1.5)
print("ready", flush=True)
os.read(os.pipe()[0], 1)
"""


def test_a_notice_whose_time_is_sooner_than_the_deadline_ends_the_stop_at_its_time() -> None:
    """Issue 37: armed by a notice that gives 1.5 s, a stop that cannot complete ends at 1.5 s, not stop_deadline's
    30, and the message says which bound it was."""
    sent = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", _NOTICED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    err, took = _ended(child, sent)
    assert child.returncode == GAVE_UP, err
    assert ("the stop did not complete within 1.5 s of the aws preemption notice (terminate at ...) (its time, sooner "
            "than stop_deadline=30 s); it was waiting for a peer that never answers") in err, err
    assert took < 20, took
