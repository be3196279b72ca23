"""The decision's collectives on real ranks, and the :class:`Driver` that runs a schedule's sequences on them. Each
is a small int64 MAX all-reduce on the CPU, on a gloo group of the package's own: it never syncs a GPU, never
interleaves with training's collectives and has its own timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddp_sigterm._core.decision import Beat, Sequence, StopSchedule, Vote, Wait, combined


class AgreementError(RuntimeError):
    """The agreement could not complete; the message names the rank and step."""


_LATEST = 1 << 40  # seconds since the epoch, beyond any notice: the MAX of (_LATEST - time) is the soonest time
PAYLOAD_SIZE = 7
"""The int64 all-reduced by one vote: one per field of :class:`Vote`."""


class GlooPort:
    """The agreement's group (votes, and the end of a stop's save) and the heartbeat's group, both of every rank of
    the default group; without groups (a process alone), a vote is this rank's ballot."""

    def __init__(self, rank: int, world_size: int, voting: dist.ProcessGroup | None = None,
                 beating: dist.ProcessGroup | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.voting, self.beating = voting, beating
        self._ballot = torch.zeros(PAYLOAD_SIZE, dtype=torch.int64)
        self._beat = torch.zeros(3, dtype=torch.int64)
        self._held: object = None

    def vote(self, mine: Vote, where: str) -> Vote:
        """Contract: every rank votes at the same points in the same order, and all get :func:`combined` of
        their ballots; a rank that fails or times out raises :class:`AgreementError` naming ``where``."""
        if self.voting is None:
            return combined([mine])
        lowest = self.world_size - mine.signalled_rank if mine.signalled_rank is not None else 0
        self._ballot[:] = torch.tensor([mine.signum, mine.anyone_in_loop, mine.requeue, mine.boundary, lowest,
                                        mine.notice, _LATEST - mine.notice_at if mine.notice_at else 0])
        try:
            dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, group=self.voting)
        except Exception as error:
            raise AgreementError(f"ddp_sigterm: rank {self.rank} of {self.world_size}: the stop agreement at {where} "
                                 f"failed: {error}") from error
        got = [int(value) for value in self._ballot]
        return Vote(got[0], bool(got[1]), bool(got[2]), got[3], self.world_size - got[4] if got[4] else None,
                    got[5], _LATEST - got[6] if got[6] else 0)

    def lowest_failed_rank(self, succeeded: bool, where: str) -> int | None:
        """After a step every rank takes in the stop (its save): the lowest rank on which it failed, or None,
        the same on every rank; it is also the barrier that ends the step. Contract as for :meth:`vote`."""
        failed = None if succeeded else self.rank  # a vote's lowest signalled rank, without a signal
        return self.vote(Vote(anyone_in_loop=False, signalled_rank=failed), where).signalled_rank

    def exchange(self, mine: Beat) -> Beat:
        """One heartbeat among every rank. A failure (a peer gone or stuck: training's own collectives meet it too)
        reads as the last beat, so the heartbeat's thread ends."""
        self._beat[0], self._beat[1], self._beat[2] = int(mine.signalled), mine.boundary, int(mine.closing)
        try:
            work = dist.all_reduce(self._beat, op=dist.ReduceOp.MAX, group=self.beating, async_op=True)
            work.wait()
        except Exception:
            return Beat(False, 0, True)
        # Freeing a work takes the GIL: freed by gloo's worker thread, it makes a thread state under the interpreter's
        # lock (a DataLoader worker forked then hangs: CPython < 3.11.10, gh-112275), or aborts the process once the
        # interpreter finalizes. Held until the next beat (the last: until the port goes), gloo's thread never frees it.
        self._held = work
        return Beat(bool(self._beat[0]), int(self._beat[1]), bool(self._beat[2]))


class Driver:
    """Runs a schedule's sequences against a :class:`GlooPort`: each part between two requests under one lock shared
    by the main thread and the heartbeat's, collectives and waits outside it. ``naming(what)``: a context that names
    what the main thread waits for (the stop deadline's message)."""

    def __init__(self, schedule: StopSchedule, port: GlooPort,
                 naming: Callable[[str], contextlib.AbstractContextManager[None]]) -> None:
        self.schedule, self.port, self._naming = schedule, port, naming
        self._lock = threading.Lock()
        self._heard = threading.Condition(self._lock)  # a beat was heard: a main thread's Wait may be over
        self.waited = 0.0  # seconds spent in waits for a beat in flight (benchmarks/job.py reads it)

    def run(self, start: Callable[..., bool | Sequence], *args: object, beat: bool = False) -> bool:
        """``start(*args)`` (one of the schedule's sequences) run to its end; returns its answer. ``beat``: a
        heartbeat's, whose end may end a main thread's Wait."""
        answer: Vote | Beat | None = None
        with self._lock:
            sequence = start(*args)
        if isinstance(sequence, bool):
            return sequence
        while True:
            with self._lock:
                try:
                    request = sequence.send(answer)
                except StopIteration as end:
                    if beat:
                        self._heard.notify_all()
                    return bool(end.value)
                if isinstance(request, Wait):
                    began = time.perf_counter()
                    self._heard.wait_for(request.until)
                    self.waited += time.perf_counter() - began
                    answer = None
                    continue
                where = self.schedule.where
            if isinstance(request, Beat):
                answer = self.port.exchange(request)
            else:
                with self._naming(f"the stop agreement at {where}, which needs all {self.port.world_size} ranks"):
                    answer = self.port.vote(request, where)


class Heartbeat:
    """The heartbeat's thread: a beat every ``period`` seconds until one carries "closing" (:meth:`end`, every
    rank at the same point) or fails. ``signalled``: whether this rank has a stop signal."""

    def __init__(self, driver: Driver, period: float, signalled: Callable[[], bool]) -> None:
        self.driver, self.period, self._signalled = driver, period, signalled
        self.group = driver.port.beating
        self._closing = False
        self._wake = threading.Event()

    def end(self) -> None:
        self._closing = True
        self._wake.set()

    def beat(self) -> None:
        while not self.driver.run(self.driver.schedule.beat, self._signalled(), self._closing, beat=True):
            self._wake.wait(self.period)
