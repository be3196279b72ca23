"""Signal recording: the handler writes down that a stop was requested, and nothing else.

A Python signal handler runs between two bytecodes of the main thread, wherever that thread is,
possibly inside a collective. So the handler does no collective, no I/O, no logging and takes no
lock: it stores the signal number and the time, and chains to the handler that was there before.
What to do about the signal is decided later, at a step boundary, by the agreement.

While a recorder is active, DataLoader workers forked by the process block its signals
(:func:`ddp_sigterm._core.process.block_in_dataloader_workers`).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeGuard

from ddp_sigterm._core import process

Handler = Callable[[int, "FrameType | None"], Any] | int | None


def stop_signals(configured: tuple[int, ...], requeue: int | None = None,
                 routed: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The one set of signals that stop a run, each once: the configured ones (``Settings.signals``), the
    job's requeue signal, and those a framework hands the recorder itself (Lightning's connector: SIGTERM).
    The recorder, the deadline, the ignore after a stop and the exit code all read this set."""
    return tuple(dict.fromkeys((*configured, *(() if requeue is None else (requeue,)), *routed)))


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
        self.mask = 0  # bit ``1 << n`` set once signal n was received
        self._previous: dict[int, Handler] = {}

    # -- the handler ---------------------------------------------------------------------------
    def record(self, signum: int, frame: FrameType | None = None) -> None:
        # Only assignments: safe wherever the main thread was interrupted.
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
        process.block_in_dataloader_workers(self.signals)

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
        process.unblock_in_dataloader_workers(self.signals)
