"""The stop schedule: at which step boundary every rank stops, worked out from what the collectives return.

Pure: no torch, no thread, no clock, no signal handler. The coordinator (its runtime) feeds one rank's
schedule the rank's own signal and what the two collectives returned, the heartbeat
(:mod:`ddp_sigterm._core.heartbeat`) and the agreement (:mod:`ddp_sigterm._core.agreement`); the schedule
says where the agreement runs and what it decided. Since the collectives give every rank the same result,
every rank's schedule decides the same stop at the same boundary (tests/unit/core/test_schedule.py runs N
schedules against simulated collectives, in random interleavings).

A rank's schedule is :attr:`State.COUNTING` boundaries until a heartbeat that carried a signal names a
boundary (:attr:`State.REQUESTED`); from that boundary on, each boundary runs the agreement, and the vote
that carries a signal stops the run (:attr:`State.STOPPED`). Alone (one process), the agreement runs at the
first boundary after the rank's own signal.
"""

from __future__ import annotations

import dataclasses
import enum

from ddp_sigterm._core import exit_codes

LEAD = 1
"""Boundaries between the one a rank reports to a heartbeat and the one by which it must have read the result."""


@dataclasses.dataclass(frozen=True)
class Vote:
    """What every rank gets back from one agreement (the same on every rank)."""

    signum: int  # the largest stop signal number any rank recorded, 0 if none
    anyone_in_loop: bool
    requeue: bool  # some rank recorded the job's requeue signal
    boundary: int  # the most step boundaries any rank has passed (they differ after loops of uneven length)
    signalled_rank: int | None = None  # the lowest rank (of the agreement's) that recorded a stop signal
    notice: int = 0  # a cloud's preemption notice some rank got: its index in notices.KINDS plus one, else 0
    notice_at: int = 0  # the soonest time such a notice gives, in whole seconds since the epoch (0: none)


@dataclasses.dataclass(frozen=True)
class StopDecision:
    """What every rank agreed on. ``received_at`` and ``decided_at`` are ``time.monotonic()`` values
    of this process; ``received_at`` is None on a rank that was not signalled itself. ``signalled_rank``:
    the lowest rank that recorded a stop signal. ``notice``, ``notice_at``: the vote's (a cloud's notice,
    which stops the run as its first stop signal would)."""

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


class State(enum.Enum):
    COUNTING = "counting step boundaries"
    REQUESTED = "agreeing at every boundary from the one a heartbeat named"
    STOPPED = "stopped"


class HeartbeatBook:
    """The heartbeat's bookkeeping on one rank, without its thread and its collective (heartbeat.py has
    those, and serializes these calls with a lock). The thread calls :meth:`report` before each all-reduce
    and :meth:`heard` with its result; the main thread calls :meth:`passing` at each step boundary.

    Why every rank agrees at the same boundary: the heartbeat carrying a signal returns the same largest
    reported boundary ``B`` everywhere, which names ``B + LEAD``; a rank that reported ``b <= B`` must have
    read that result before it passes ``b + LEAD <= B + LEAD`` (:meth:`passing` says so), so no rank is past
    the named boundary when it learns of it."""

    def __init__(self) -> None:
        self.boundary = 0  # the main thread's, as of its last passing()
        self.read_by: int | None = None  # the boundary this rank must not pass before the pending result is in
        self.requested: int | None = None  # where a heartbeat that carried a signal asked for the agreement

    def passing(self, boundary: int) -> bool:
        """The main thread passes ``boundary``: whether it must wait for the heartbeat in flight first."""
        self.boundary = boundary
        return self.read_by is not None and boundary >= self.read_by

    def report(self) -> int:
        """The boundary this rank reports to the next heartbeat."""
        self.read_by = self.boundary + LEAD
        return self.boundary

    def heard(self, signalled: bool, boundary: int) -> None:
        """A heartbeat's result: whether any rank had a signal, the largest boundary reported."""
        if signalled:
            requested = boundary + LEAD
            self.requested = requested if self.requested is None else min(self.requested, requested)
        self.read_by = None


class StopSchedule:
    """One rank's schedule. Contract: every rank passes the same step boundaries (loops of uneven length
    end with leaving votes, repeated while :meth:`leaving_again` says so) and gets the same heartbeat
    results and votes; then every rank's :meth:`voted` returns the same decision at the same boundary."""

    def __init__(self, alone: bool) -> None:
        self.alone = alone
        self.state = State.COUNTING
        self.boundary = 0  # step boundaries passed, counted the same way on every rank
        self.step: int | None = None  # the step of the last boundary, for messages
        self.decision: StopDecision | None = None
        self._signal_boundary: int | None = None  # the boundary at which this rank first saw its own signal

    def passing(self, step: int | None, signalled: bool) -> int:
        """This rank passes a step boundary; returns its number (what the heartbeat is told)."""
        self.boundary += 1
        self.step = step
        if signalled and self._signal_boundary is None:
            self._signal_boundary = self.boundary
        return self.boundary

    def agrees_here(self, requested: int | None, signalled: bool) -> bool:
        """Whether the agreement runs at this boundary, given the boundary a heartbeat named (None: none
        did): from it on, on every rank; alone, where this rank has a signal."""
        if self.alone:
            return signalled
        if requested is None or self.boundary < requested:
            return False
        self.state = State.REQUESTED
        return True

    def voted(self, vote: Vote, now: float, received_at: float | None) -> StopDecision | None:
        """An agreement's vote: the boundary count re-synced to the largest, and the decision if the vote
        carries a signal. ``now``, ``received_at``: this process's clock, for the decision's record."""
        if self._signal_boundary is not None:  # boundaries since the signal: count the re-sync's jump too
            self._signal_boundary += vote.boundary - self.boundary
        self.boundary = vote.boundary
        if not vote.signum:
            return None
        since = None if self._signal_boundary is None else self.boundary - self._signal_boundary
        self.decision = StopDecision(vote.signum, self.step, self.boundary, now, received_at, since, vote.requeue,
                                     vote.signalled_rank, vote.notice, vote.notice_at)
        self.state = State.STOPPED
        return self.decision

    @staticmethod
    def leaving_again(vote: Vote) -> bool:
        """After a vote taken while leaving a loop: whether to vote again (no signal, a rank still in it)."""
        return not vote.signum and vote.anyone_in_loop
