"""Signal recording: the handler writes down that a stop was requested, and nothing else.

A Python signal handler runs between two bytecodes of the main thread, wherever that thread is,
possibly inside a collective. So the handler does no collective, no I/O, no logging and takes no
lock: it stores the signal number and the time, and chains to the handler that was there before.
What to do about the signal is decided later, at a step boundary, by the agreement.

The handler is installed, chained and restored by :class:`ddp_sigterm._core.runtime.Runtime`, the one
owner of what the package does to the process.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeGuard

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


def chains_to(handler: Handler) -> TypeGuard[Callable[[int, FrameType | None], Any]]:
    """Whether the recorder calls ``handler`` after recording: a handler someone installed, yes; the
    signal's default action, no: replacing it is the recorder's purpose."""
    return callable(handler) and not default_action(handler)


class SignalRecorder:
    """Records the first stop signal this process receives: its number and ``time.monotonic()``.
    ``record`` is the handler: the runtime installs it, chained to the handler it replaces; frameworks
    that compose handlers themselves, such as Lightning's signal connector, call it directly."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = tuple(signals)
        self.signum = 0
        self.received_at: float | None = None
        self.mask = 0  # bit ``1 << n`` set once signal n was received

    def record(self, signum: int, frame: FrameType | None = None) -> None:
        # Only assignments: safe wherever the main thread was interrupted.
        self.mask |= 1 << signum
        if not self.signum:
            self.received_at = time.monotonic()
            self.signum = signum
