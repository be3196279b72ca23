"""Where every rank stops: one rank's pure stop decision (no torch, thread or clock). Each sequence of a
:class:`StopSchedule` is a generator that yields a :class:`Beat`, a :class:`Vote` or a :class:`Wait` and is sent the
answer; ``port.Driver`` serves them with gloo, tests/unit/core/test_decision.py on N simulated ranks.

How often ranks agree: between stops, never. Every ``max_delay / 2`` s a heartbeat exchanges ``[signalled, boundary,
closing]``; one that carries a signal names the largest boundary ``B`` + ``LEAD``, and a rank that reported ``b`` waits
for it before it passes ``b + LEAD``. From there every boundary votes until a vote carries the signal; uneven loops end
with leaving votes, every run with one vote.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Generator
from typing import Any

from ddp_sigterm._core import exit_codes

LEAD = 1
"""Boundaries between the one a rank reports to a beat and the one by which it must have read the result."""


@dataclasses.dataclass(frozen=True)
class Vote:
    """One rank's ballot, and what every rank gets back (:func:`combined`): the largest signal (0: none), anyone
    still in the loop, anyone asking for a requeue, the most boundaries passed, the lowest signalled rank, the
    largest notice code (``clouds.KINDS`` index + 1) and the soonest notice time (0: none)."""

    signum: int = 0
    anyone_in_loop: bool = True
    requeue: bool = False
    boundary: int = 0
    signalled_rank: int | None = None
    notice: int = 0
    notice_at: int = 0


@dataclasses.dataclass(frozen=True)
class Beat:
    """One heartbeat: whether a rank was signalled, its boundary, whether it closes (every rank gets the MAX)."""

    signalled: bool
    boundary: int
    closing: bool


@dataclasses.dataclass(frozen=True)
class Wait:
    """Wait, outside the lock, until ``until()`` is true (a beat in flight has been heard)."""

    until: Callable[[], bool]


Sequence = Generator["Vote | Beat | Wait", Any, bool]
"""A rank's sequence: yields requests, is sent their answers (None after a wait), returns whether every rank stops."""


def combined(votes: list[Vote]) -> Vote:
    """What one agreement returns for these ballots (what the gloo port computes with a MAX all-reduce)."""
    signalled = [v.signalled_rank for v in votes if v.signalled_rank is not None]
    soonest = [v.notice_at for v in votes if v.notice_at]
    return Vote(max(v.signum for v in votes), any(v.anyone_in_loop for v in votes), any(v.requeue for v in votes),
                max(v.boundary for v in votes), min(signalled, default=None), max(v.notice for v in votes),
                min(soonest, default=0))


@dataclasses.dataclass(frozen=True)
class Ballot:
    """What this rank brings to a vote: its first stop signal (0: none) and its ``time.monotonic()``, whether it asks
    for a requeue, a cloud's notice (code and time, 0: none)."""

    signum: int = 0
    received_at: float | None = None
    requeue: bool = False
    notice: int = 0
    notice_at: int = 0


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """What every rank agreed on. ``decided_at``, ``received_at`` (None where this rank was not signalled): this
    process's ``time.monotonic()``; ``signalled_rank``: the lowest signalled; ``notice``, ``notice_at``: a cloud's."""

    signum: int
    step: int | None
    boundary: int
    decided_at: float
    received_at: float | None
    boundaries_since_signal: int | None
    requeue: bool = False
    signalled_rank: int | None = None
    notice: int = 0
    notice_at: int = 0

    @property
    def exit_code(self) -> int:
        return exit_codes.stopped(self.signum)


def where(step: int | None, boundary: int) -> str:
    """A place in the run, for messages: ``"step 7 (boundary 9)"``."""
    return f"step {step} (boundary {boundary})" if step is not None else f"boundary {boundary}"


class State(enum.Enum):
    COUNTING = "counting step boundaries"
    REQUESTED = "voting at every boundary from the one a beat named"
    STOPPED = "stopped"


class StopSchedule:
    """One rank's schedule. Contract: if every rank passes the same boundaries (an uneven loop ends with
    :meth:`leaving`) and gets the same beats and votes, all return True at the same boundary, with the same decision."""

    def __init__(self, rank: int, alone: bool, ballot: Callable[[], Ballot], clock: Callable[[], float]) -> None:
        self.rank, self.alone = rank, alone
        self._ballot, self._clock = ballot, clock
        self.state = State.COUNTING
        self.boundary = 0  # step boundaries passed, counted alike on every rank
        self.step: int | None = None  # the step of the last boundary, for messages
        self.decision: StopDecision | None = None
        self._signal_boundary: int | None = None  # where this rank first saw its own signal
        self._read_by: int | None = None  # the boundary this rank must not pass before the beat in flight is heard
        self._heard = 0  # beats heard
        self._requested: int | None = None  # the boundary a beat that carried a signal named

    @property
    def where(self) -> str:
        return where(self.step, self.boundary)

    def passing(self, step: int | None, signalled: bool) -> bool | Sequence:
        """A step boundary: count it. False where it neither waits nor votes (the common case, no generator), else
        the rest of its sequence: wait for the beat in flight if it guards this boundary, then vote from the
        boundary a beat named (alone: at the first boundary with its own signal)."""
        if self.decision is not None:
            return True
        self.boundary += 1
        self.step = step
        if signalled and self._signal_boundary is None:
            self._signal_boundary = self.boundary
        waits = self._read_by is not None and self.boundary >= self._read_by
        if not waits and not self._votes_here(signalled):
            return False
        return self._rest_of_boundary(step, signalled, waits, self._heard)

    def _votes_here(self, signalled: bool) -> bool:
        if self.alone:
            return signalled
        return self._requested is not None and self.boundary >= self._requested

    def _rest_of_boundary(self, step: int | None, signalled: bool, waits: bool, heard: int) -> Sequence:
        if waits:
            yield Wait(lambda: self._heard > heard)
        if not self._votes_here(signalled):
            return False
        self.state = State.REQUESTED
        return (yield from self.now(step))

    def now(self, step: int | None) -> Sequence:
        """Vote here: at the end of a run, so that a signal after the last boundary is not lost."""
        if self.decision is not None:
            return True
        self.step = step
        return self._decided((yield self._vote(in_loop=True)))

    def leaving(self, step: int | None) -> Sequence:
        """Leave a loop whose length may differ between ranks: vote with the ranks still in it until none is."""
        if self.decision is not None:
            return True
        self.step = step
        vote: Vote = yield self._vote(in_loop=False)
        while not vote.signum and vote.anyone_in_loop:
            vote = yield self._vote(in_loop=False)
        return self._decided(vote)

    def _vote(self, in_loop: bool) -> Vote:
        mine = self._ballot()
        return Vote(mine.signum, in_loop, mine.requeue, self.boundary, self.rank if mine.signum else None,
                    mine.notice, mine.notice_at)

    def _decided(self, vote: Vote) -> bool:
        """Re-sync the boundary count to the largest; stop if the vote carries a signal."""
        if self._signal_boundary is not None:  # count the re-sync's jump as boundaries since the signal
            self._signal_boundary += vote.boundary - self.boundary
        self.boundary = vote.boundary
        if not vote.signum:
            return False
        since = None if self._signal_boundary is None else self.boundary - self._signal_boundary
        self.decision = StopDecision(vote.signum, self.step, self.boundary, self._clock(), self._ballot().received_at,
                                     since, vote.requeue, vote.signalled_rank, vote.notice, vote.notice_at)
        self.state = State.STOPPED
        return True

    def beat(self, signalled: bool, closing: bool) -> Sequence:
        """One heartbeat (its thread's): report this rank's boundary, hear every rank's. True: it was the last one."""
        self._read_by = self.boundary + LEAD
        heard: Beat = yield Beat(signalled, self.boundary, closing)
        if heard.signalled:
            named = heard.boundary + LEAD
            self._requested = named if self._requested is None else min(self._requested, named)
        self._read_by = None
        self._heard += 1
        return heard.closing
