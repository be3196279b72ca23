"""Signal recording: the handler writes down that a stop was requested, and nothing else. It may run inside a
collective: so no collective, no I/O, no logging, no lock. The agreement decides at a step boundary."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeGuard

Handler = Callable[[int, "FrameType | None"], Any] | int | None


def stop_signals(configured: tuple[int, ...], requeue: int | None = None,
                 routed: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The one set of signals that stop a run, each once: the configured ones, the job's requeue signal, and
    those a framework hands the recorder itself (Lightning's connector: SIGTERM)."""
    return tuple(dict.fromkeys((*configured, *(() if requeue is None else (requeue,)), *routed)))


def default_action(handler: Handler) -> bool:
    """Whether ``handler`` is the signal's default action, SIGINT's ``default_int_handler`` included."""
    return handler in (signal.SIG_DFL, None) or handler is signal.default_int_handler


def chains_to(handler: Handler) -> TypeGuard[Callable[[int, FrameType | None], Any]]:
    """Whether the recorder calls ``handler`` after recording: one someone installed, not a default action."""
    return callable(handler) and not default_action(handler)


class SignalRecorder:
    """Records the first stop signal and its ``time.monotonic()``, and in ``mask`` (bit ``1 << n``) every one
    received. ``record`` is the handler; Lightning's signal connector calls it directly."""

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = tuple(signals)
        self.signum = 0
        self.received_at: float | None = None
        self.mask = 0

    def record(self, signum: int, frame: FrameType | None = None) -> None:
        self.mask |= 1 << signum  # only assignments: safe wherever the main thread was interrupted
        if not self.signum:
            self.received_at = time.monotonic()
            self.signum = signum
