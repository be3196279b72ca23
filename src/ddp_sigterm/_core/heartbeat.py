"""The heartbeat: how a stop signal on any rank reaches every rank's schedule, within a bounded time,
however long the steps are, and without a collective in the training loop.

Between stops the main thread only counts step boundaries. Ranks reading their own clocks would
disagree on where to stop, so a thread on every rank runs a small all-reduce every ``period`` seconds
(``max_delay / 2``) on a gloo group of its own, never waiting for the main thread, carrying ``[a stop
signal was recorded here, this rank's step boundary, closing]``. When one carries a signal, every rank
gets the same largest boundary ``B`` and the agreement runs at boundary ``B + 1`` on every rank; why no
rank is past it then is :class:`ddp_sigterm._core.schedule.HeartbeatBook`'s docstring, and the
bookkeeping is that class's. This module is the thread's body and its collective; the runtime starts
and joins the thread and gives the group back (:class:`ddp_sigterm._core.runtime.Runtime`).

So a stop is agreed at most ``period`` plus one step (and the all-reduce) after the first signal:
within ``max(max_delay, 2 steps)``. The heartbeat never decides a stop itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddp_sigterm._core.schedule import HeartbeatBook


class Heartbeat:
    """One rank's part: the runtime runs :meth:`beat` in a thread on every rank of ``group``, from the same
    point; the main thread calls :meth:`passing` at every step boundary; :meth:`end` on every rank at the
    same point makes the next heartbeat the last."""

    def __init__(self, group: dist.ProcessGroup, max_delay: float, signalled: Callable[[], bool]) -> None:
        self.period = max_delay / 2
        self.group = group
        self._signalled = signalled
        self._lock = threading.Lock()  # orders the thread's report against the main thread's boundaries
        self._book = HeartbeatBook()
        self._arrived = threading.Event()
        self._closing = False
        self._wake = threading.Event()

    def passing(self, boundary: int) -> int | None:
        """The main thread passes ``boundary``. Returns the boundary at which a heartbeat asked for an
        agreement (the same on every rank), or None. May wait for a heartbeat result (see module)."""
        with self._lock:
            must_read = self._book.passing(boundary)
        if must_read:
            self._arrived.wait()
        with self._lock:
            return self._book.requested

    def end(self) -> None:
        """The next heartbeat carries "closing", and every rank's thread ends after it."""
        self._closing = True
        self._wake.set()

    def beat(self) -> None:
        """The thread's body: a heartbeat every period until one carries "closing" or fails."""
        report = torch.zeros(3, dtype=torch.int64)
        held = None  # the last heartbeat's work, let go at the next one (see below)
        while True:
            with self._lock:
                reported = self._book.report()
                self._arrived.clear()
            report[0], report[1], report[2] = int(self._signalled()), reported, int(self._closing)
            try:
                work = dist.all_reduce(report, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
                work.wait()
            except Exception:  # a peer gone or stuck: training's own collectives meet it too; this thread ends
                work = None
                report.zero_()
                report[2] = 1
            # Whoever frees a work last frees its hold on ``report``, which needs the GIL. Freed by gloo's
            # own thread, that means a new Python thread state, made under the interpreter's lock of thread
            # states but not the GIL: a DataLoader worker forked at that moment inherits the lock taken and
            # hangs before it runs (CPython < 3.11.10 and 3.12.0, gh-112275). Held here until the next
            # heartbeat, a period after gloo let go of it, the work is freed by this thread instead.
            held = work  # noqa: F841 (kept, not read)
            with self._lock:
                self._book.heard(bool(report[0]), int(report[1]))
                self._arrived.set()
            if report[2]:
                return
            self._wake.wait(self.period)
