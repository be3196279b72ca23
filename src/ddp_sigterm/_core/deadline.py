"""The stop deadline: a stop that cannot complete still ends the process, within a bound. A rank blocked in a
collective runs no Python handler, so a thread woken through the wakeup fd counts ``stop_deadline`` from the first
stop signal (or the agreed stop, or sooner by a notice's time); past it, or at the third stop request, it writes why
and every thread's stack to stderr and calls ``os._exit(201)`` (docs/how-it-works.md, section 5; reliability.md)."""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import select
import signal
import socket
import time
from collections.abc import Callable

from ddp_sigterm._core import exit_codes

ESCALATION_REQUESTS = 3  # the stop request that ends the process at once: the second is ignored, the third is "now"
SAME_REQUEST_SECONDS = 1.0  # stop signals closer than this are one request (SLURM and torchrun often send one twice)
_WAKE = b"\0"  # written by this module to make the thread look again; never a signal number


class Deadline:
    """The body and state of the thread that ends the process if the stop overruns; the runtime starts it
    and hands it the wakeup fd's socket pair. ``who`` names the process ("rank 1 of 2"); ``activity``, called
    from the watching thread, names what the main thread waits for, so it must only read attributes."""

    def __init__(self, seconds: float, signals: tuple[int, ...], who: str, activity: Callable[[], str]) -> None:
        self.seconds = seconds
        self.signals = frozenset(signals)
        self._who, self._activity = who, activity
        self.armed_at: float | None = None
        self.bound = seconds  # from armed_at: seconds, or less if what armed it has a sooner end
        self._why = ""
        self._requests = 0
        self._last_signal = -math.inf
        self.previous_fd = -1  # the wakeup fd the runtime replaced with the writer; each signal goes on to it
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._closing = False

    def listen(self, reader: socket.socket, writer: socket.socket, previous_fd: int) -> None:
        """The wakeup fd's socket pair, and the wakeup fd it replaced, to which each signal is passed on."""
        self._reader, self._writer, self.previous_fd = reader, writer, previous_fd

    def ends(self) -> tuple[socket.socket, ...]:
        return tuple(end for end in (self._reader, self._writer) if end is not None)

    def arm(self, since: float, why: str, within: float = math.inf) -> None:
        """Start the countdown at ``since`` (monotonic) unless already started; ``within``: seconds to an end
        that ``why`` gives (a notice's time), if sooner than ``seconds``."""
        if self.armed_at is None:
            self.armed_at, self._why = since, why
            if within < self.seconds:
                self.bound = max(within, 0.0)
                self._why += f" (its time, sooner than stop_deadline={self.seconds:g} s)"
            self._wake()

    def end(self, close_writer: bool) -> None:
        """Tell the thread to end; it closes the reader."""
        self._closing = True
        self._wake()
        if close_writer and self._writer is not None:
            self._writer.close()
            self._writer = None

    def _wake(self) -> None:
        if self._writer is not None:
            # BlockingIOError: the buffer is full of unread wake-ups; OSError: closed, the thread was told to end
            with contextlib.suppress(OSError):
                self._writer.send(_WAKE)

    def watch(self) -> None:
        """The thread's body: from :meth:`listen` until :meth:`end`, or until it ends the process."""
        reader = self._reader
        if reader is None:
            raise RuntimeError("ddp_sigterm: Deadline.listen() before watch()")
        while not self._closing:
            timeout = None
            if self.armed_at is not None and not math.isinf(self.bound):
                timeout = self.armed_at + self.bound - time.monotonic()
                if timeout <= 0:
                    limit = f"stop_deadline={self.seconds:g} s" if self.bound == self.seconds else f"{self.bound:.1f} s"
                    self._give_up(f"the stop did not complete within {limit} of {self._why}")
            readable, _, _ = select.select([reader], [], [], timeout)
            if readable:
                self._received(reader.recv(256))
        reader.close()

    def _received(self, data: bytes) -> None:
        for signum in data:
            if self.previous_fd >= 0 and signum:  # someone else (asyncio) also watches signals
                with contextlib.suppress(OSError):
                    os.write(self.previous_fd, bytes([signum]))
            if signum not in self.signals:
                continue
            now = time.monotonic()
            if now - self._last_signal >= SAME_REQUEST_SECONDS:
                self._requests += 1
            self._last_signal = now
            name = signal.Signals(signum).name
            self.arm(now, f"the first {name}")
            if self._requests >= ESCALATION_REQUESTS:
                self._give_up(f"{name} received a third time (at least {SAME_REQUEST_SECONDS:g} s apart)")

    def _give_up(self, why: str) -> None:
        message = (f"ddp_sigterm: {self._who}: {why}; it was waiting for {self._activity()}. "
                   f"Giving up on the stop: exiting now with code {exit_codes.GAVE_UP}, without the stop checkpoint "
                   f"of this stop (resume from the last complete one). Where each thread of the process was:\n")
        try:
            os.write(2, message.encode())
            faulthandler.dump_traceback(2, all_threads=True)  # what a stuck step waits on names the culprit
        finally:
            os._exit(exit_codes.GAVE_UP)
