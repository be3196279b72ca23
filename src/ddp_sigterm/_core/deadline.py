"""The stop deadline: a stop that cannot complete still ends the process, within a bound.

A rank that gets the signal may be blocked inside a collective that waits for a peer which is
stopped (SIGSTOP, a hung node) or gone. A Python signal handler runs only when that call returns,
which with a stuck peer is the process-group timeout (30 minutes by default). So the bound is kept by
a thread of its own, woken through the interpreter's wakeup file descriptor: CPython's C-level
handler writes the signal number there the moment the signal arrives, whatever the main thread is
doing. From the first stop signal (or, on a rank that was not signalled, from the agreed stop) the
process has ``stop_deadline`` seconds to exit, or less where a cloud's preemption notice gives a sooner
time (:mod:`ddp_sigterm._core.notices`). Past it, or at the third stop request (signals
less than a second apart count as one), the thread writes what the main thread was waiting for, and
every thread's stack, to stderr and ends the process with ``os._exit(201)``: no clean-up that could
block again; the kernel closes the process's connections, which its peers see as an error instead of
a silence.
"""

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

ESCALATION_REQUESTS = 3
"""The stop request that ends the process at once: a second one is ignored, the third means "now"."""

SAME_REQUEST_SECONDS = 1.0
"""Stop signals less than this apart count as one request: a scheduler and a launcher often deliver
the same request twice within milliseconds (SLURM signals every process; torchrun forwards to its
workers)."""

_WAKE = b"\0"  # written by this module to make the thread look again; never a signal number


class Deadline:
    """The body and state of the thread that watches for stop signals and ends the process if the stop
    overruns; the runtime starts it (:meth:`ddp_sigterm._core.runtime.Runtime.start`) and hands it the
    wakeup fd's socket pair (:meth:`listen`).

    ``who`` names the process in messages ("rank 1 of 2"); ``activity`` is called from the watching
    thread to name what the main thread is waiting for, so it must only read attributes. The wakeup
    fd is per process and can only be set from the main thread: started from another thread (where
    no signal handler runs either, e.g. a training function run in a thread), it does not watch.
    """

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
        """The wakeup fd's socket pair (the interpreter writes each signal's number to ``writer``), and
        the wakeup fd it replaced, to which each signal is passed on."""
        self._reader, self._writer, self.previous_fd = reader, writer, previous_fd

    def ends(self) -> tuple[socket.socket, ...]:
        return tuple(end for end in (self._reader, self._writer) if end is not None)

    def arm(self, since: float, why: str, within: float = math.inf) -> None:
        """Start the countdown at ``since`` (``time.monotonic()``) unless something already did; ``within``:
        seconds from ``since`` to an end that ``why`` gives (a notice's time), if sooner than ``seconds``."""
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

    # -- the watching thread -------------------------------------------------------------------
    def _wake(self) -> None:
        if self._writer is not None:
            try:
                self._writer.send(_WAKE)
            except BlockingIOError:  # the buffer is full of unread wake-ups: the thread will look anyway
                pass
            except OSError:  # closed by close(): the thread has been told to stop
                pass

    def watch(self) -> None:
        """The thread's body: from :meth:`listen` until :meth:`end`, or until it ends the process."""
        reader = self._reader
        if reader is None:
            raise RuntimeError("ddp_sigterm: Deadline.listen() before watch()")
        while not self._closing:
            timeout = None
            if self.armed_at is not None:
                if math.isinf(self.bound):
                    timeout = None
                else:
                    timeout = self.armed_at + self.bound - time.monotonic()
                    if timeout <= 0:
                        limit = f"stop_deadline={self.seconds:g} s" if self.bound == self.seconds else \
                            f"{self.bound:.1f} s"
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
