"""Signal recording: the handler writes down that a stop was requested, and nothing else.

A Python signal handler runs between two bytecodes of the main thread, wherever that thread is,
possibly inside a collective. So the handler does no collective, no I/O, no logging and takes no
lock: it stores the signal number and the time, and chains to the handler that was there before.
What to do about the signal is decided later, at a step boundary, by the agreement.

Forked DataLoader workers inherit the handler but must not act on it, and must not die from a
signal meant for the job (SLURM signals every process of the job step): while a recorder is active,
a worker forked by a DataLoader blocks the recorded signals. A blocked signal stays pending in the
worker, which still ends normally when its loader shuts it down. Other forked children (a user's
own processes) keep the signals unblocked, as they would without the package. At interpreter exit,
multiprocessing ends the workers still alive with SIGTERM and then waits for them; for workers that
block it, the package ends them with SIGKILL first, as their loader would have.

Nothing here acts before a recorder is activated, or after the last one is restored: the at-fork hook
is registered at the first activation (it cannot be unregistered, and does nothing while no recorder
is active); the exit function only while a recorder is active or a worker that blocks SIGTERM lives.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # registers its exit function first, so that ours runs before it
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeGuard

from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

Handler = Callable[[int, "FrameType | None"], Any] | int | None

# Signals recorded by any active recorder of this process; read by the at-fork hook.
_active_signals: set[int] = set()
_fork_hook_registered = False


def _block_in_forked_child() -> None:
    if _active_signals and _forked_by_dataloader():
        signal.pthread_sigmask(signal.SIG_BLOCK, _active_signals)
    _active_signals.clear()


def _forked_by_dataloader() -> bool:
    """The child inherits the stack of the fork: a DataLoader forks its workers while creating its
    iterator. (If torch ever moves that, workers lose the protection; nothing else changes.)"""
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code is _MultiProcessingDataLoaderIter.__init__.__code__:
            return True
        frame = frame.f_back
    return False


def _end_blocking_workers() -> None:
    """multiprocessing's exit function sends SIGTERM to daemonic children and joins them: a worker
    that blocks SIGTERM would keep this process from exiting. (Linux: the mask is read from /proc.)"""
    workers = _blocking_workers()
    if workers and threading.current_thread() is threading.main_thread():
        # torch's SIGCHLD handler raises for a worker ended by a signal: here that is this kill, and the
        # exception would cut the loop short, leaving a worker that multiprocessing then waits for forever
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in workers:
        child.kill()


def _blocking_workers() -> list[multiprocessing.process.BaseProcess]:
    return [child for child in multiprocessing.active_children()
            if child.daemon and child.pid is not None and signal.SIGTERM in _blocked_signals(child.pid)]


def _blocked_signals(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigBlk:"):
                    mask = int(line.split()[1], 16)
                    return {n for n in range(1, 65) if mask & (1 << (n - 1))}
    except OSError:  # gone already, or no /proc
        pass
    return set()


def ignore_until_exit(signals: tuple[int, ...]) -> None:
    """Once a stop has been agreed the process is on its way out with 128 + signal: a later stop
    signal (torchrun sends SIGTERM to the ranks still running when the first one exits) must not
    turn that into death by the signal. SIG_IGN, not a Python handler: the interpreter resets Python
    handlers to SIG_DFL while it finalizes, and the exit of a torch process takes tens of
    milliseconds after that. The stop deadline still bounds the exit. Main thread only (elsewhere a
    no-op)."""
    if threading.current_thread() is threading.main_thread():
        for signum in signals:
            signal.signal(signum, signal.SIG_IGN)


def default_action(handler: Handler) -> bool:
    """Whether ``handler`` is the signal's default action, including the one Python implements as a
    function (SIGINT's ``default_int_handler`` raises KeyboardInterrupt)."""
    return handler in (signal.SIG_DFL, None) or handler is signal.default_int_handler


def _chains_to(handler: Handler) -> TypeGuard[Callable[[int, FrameType | None], Any]]:
    """Whether the recorder calls ``handler`` after recording: a handler someone installed, yes; the
    signal's default action, no: replacing it is the recorder's purpose."""
    return callable(handler) and not default_action(handler)


class SignalRecorder:
    """Records the first stop signal this process receives: its number and ``time.monotonic()``.

    ``record`` is a plain handler (it does not chain) for frameworks that compose handlers
    themselves, such as Lightning's signal connector. ``install`` registers a handler that records
    and then calls the handler that was installed before; ``restore`` puts the previous handlers back.
    """

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = tuple(signals)
        self.signum = 0
        self.received_at: float | None = None
        self.count = 0
        self.mask = 0  # bit ``1 << n`` set once signal n was received
        self._previous: dict[int, Handler] = {}

    # -- the handler ---------------------------------------------------------------------------
    def record(self, signum: int, frame: FrameType | None = None) -> None:
        # Only assignments: safe wherever the main thread was interrupted.
        self.count += 1
        self.mask |= 1 << signum
        if not self.signum:
            self.received_at = time.monotonic()
            self.signum = signum

    def _record_and_chain(self, signum: int, frame: FrameType | None) -> None:
        self.record(signum, frame)
        previous = self._previous.get(signum)
        if _chains_to(previous):
            previous(signum, frame)

    # -- lifecycle -----------------------------------------------------------------------------
    def activate(self) -> None:
        """Mark the signals as recorded by this process, so that forked DataLoader workers block them."""
        global _fork_hook_registered
        if not _fork_hook_registered:
            os.register_at_fork(after_in_child=_block_in_forked_child)
            _fork_hook_registered = True
        _active_signals.update(self.signals)
        # after multiprocessing's own exit function, so that it runs first (at most once, however often activated)
        atexit.unregister(_end_blocking_workers)
        atexit.register(_end_blocking_workers)

    def install(self, signals: tuple[int, ...] | None = None) -> None:
        """Register the recording handler for ``signals`` (default: all of this recorder's),
        chaining to the handlers in place. Needs the main thread."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ddp_sigterm: signal handlers can only be installed from the main thread")
        self.activate()
        for signum in self.signals if signals is None else signals:
            if signum in self._previous:
                continue
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._record_and_chain)

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced and stop blocking in forked children.
        Safe to call twice."""
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        _active_signals.difference_update(self.signals)
        if not _active_signals and not _blocking_workers():
            atexit.unregister(_end_blocking_workers)
