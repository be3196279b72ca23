"""ddp_sigterm/_core/signals.py: the recording handler records, and the runtime chains and restores it."""

from __future__ import annotations

import os
import signal

from ddp_sigterm._core.runtime import Runtime
from ddp_sigterm._core.signals import SignalRecorder


def test_recorder_records_chains_and_restores() -> None:
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        recorder = SignalRecorder((signal.SIGUSR2,))
        runtime = Runtime(recorder)
        runtime.start(handlers=True)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert recorder.signum == signal.SIGUSR2
        assert recorder.received_at is not None
        assert seen == [signal.SIGUSR2]  # the user's handler still ran
        first = recorder.received_at
        os.kill(os.getpid(), signal.SIGUSR2)
        assert recorder.received_at == first  # the first signal's time is kept
        runtime.close(stopped=False, leaving=False, destroy_default_group=False, redeliver=False)
        recorder.signum = 0
        os.kill(os.getpid(), signal.SIGUSR2)
        assert recorder.signum == 0  # no longer recorded
        assert seen == [signal.SIGUSR2] * 3
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_stop_signals_are_one_ordered_set() -> None:
    from ddp_sigterm._core.signals import stop_signals

    term, usr1, usr2 = signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2
    assert stop_signals((term,)) == (term,)
    assert stop_signals((usr2, term), usr1, (term, usr1)) == (usr2, term, usr1)
    assert stop_signals((usr2,), None, (term,)) == (usr2, term)
