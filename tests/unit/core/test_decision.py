"""ddp_sigterm/_core/decision.py on N simulated ranks: no process, no thread, no clock.

Each rank runs its plan of loops through its own :class:`StopSchedule`, calling the sequences the coordinator
calls (``passing`` at each boundary, ``leaving`` at the end of an uneven loop, ``now`` at the end), and its
heartbeat thread runs ``beat`` again and again. The port is simulated: a rank whose sequence asks for a vote or a
beat waits (yields) until every rank has made the same call, then all get the same answer (:func:`combined`, or
the MAX of the beats); a ``Wait`` waits until its condition holds. A random scheduler picks which rank's main or
heartbeat runs next, so each seed is one interleaving of the ranks and their threads, at the granularity the
production driver gives them (each part of a sequence between two requests runs under one lock). Whatever the
interleaving, every rank must stop at the same boundary with the same decision.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Generator, Iterator

import pytest

from ddp_sigterm._core import decision
from ddp_sigterm._core.decision import Ballot, Beat, Sequence, State, StopDecision, StopSchedule, Vote, Wait, combined

Waiting = Generator[None, None, object]


class Collective:
    """An all-reduce among ``ranks``: the k-th call of every rank pairs with the k-th call of every other
    rank, as on one process group; every rank gets ``reduce`` of all the calls' values."""

    def __init__(self, ranks: int, reduce) -> None:
        self.ranks, self.reduce = ranks, reduce
        self.calls = [0] * ranks
        self.rounds: list[dict[int, object]] = []

    def all_reduce(self, rank: int, value: object) -> Generator[None, None, object]:
        index = self.calls[rank]
        self.calls[rank] += 1
        while len(self.rounds) <= index:
            self.rounds.append({})
        self.rounds[index][rank] = value
        while len(self.rounds[index]) < self.ranks:
            yield
        return self.reduce(list(self.rounds[index].values()))


def _beats(beats: list[Beat]) -> Beat:
    return Beat(any(b.signalled for b in beats), max(b.boundary for b in beats), any(b.closing for b in beats))


@dataclasses.dataclass
class Rank:
    """One simulated rank: its plan is a list of loops, each ``(name, boundaries, uneven)``; an uneven
    loop ends with the leaving votes. It is signalled just before its boundary ``signal_at`` (counted over
    its whole plan), and ends with the agreement at the end of the run."""

    rank: int
    plan: list[tuple[str, int, bool]]
    signal_at: int | None
    signalled: bool = False
    decision: StopDecision | None = None
    where: tuple[int, str, int] | None = None  # where it stopped: the loop's place in the plan, its name, the boundary
    schedule: StopSchedule | None = None

    def ballot(self) -> Ballot:
        return Ballot(15 if self.signalled else 0, 0.0 if self.signalled else None)


class Job:
    def __init__(self, plans: list[list[tuple[str, int, bool]]], signals: dict[int, int], seed: int,
                 beats: int = 4) -> None:
        self.ranks = [Rank(rank, plan, signals.get(rank)) for rank, plan in enumerate(plans)]
        for rank in self.ranks:
            rank.schedule = StopSchedule(rank.rank, len(plans) == 1, rank.ballot, lambda: 0.0)
        self.votes = Collective(len(plans), combined)
        self.heartbeats = Collective(len(plans), _beats)
        self.random = random.Random(seed)
        self.beats = beats  # how many scheduler turns a heartbeat thread sleeps between beats, at most
        self.closing = False

    def drive(self, rank: Rank, sequence: bool | Sequence) -> Generator[None, None, bool]:
        """The simulated port: serve the sequence's requests, yielding to the scheduler while they wait (a boundary
        that neither waits nor votes answers at once)."""
        if isinstance(sequence, bool):
            return sequence
        yield  # what production runs under its lock before the sequence's first part may interleave with a beat
        answer: object = None
        while True:
            try:
                request = sequence.send(answer)
            except StopIteration as end:
                return bool(end.value)
            if isinstance(request, Wait):
                while not request.until():
                    yield
                answer = None
            elif isinstance(request, Vote):
                answer = yield from self.votes.all_reduce(rank.rank, request)
            else:
                answer = yield from self.heartbeats.all_reduce(rank.rank, request)

    def main(self, rank: Rank) -> Iterator[None]:
        """A training script's loop on one rank: the coordinator's calls at each boundary of the plan."""
        schedule = rank.schedule
        assert schedule is not None
        passed = 0
        for number, (loop, boundaries, uneven) in enumerate(rank.plan):
            for index in range(boundaries):
                passed += 1
                if rank.signal_at == passed:
                    rank.signalled = True
                if (yield from self.drive(rank, schedule.passing(passed, rank.signalled))):
                    self._stopped(rank, (number, loop, index))
                    return
                yield
            if uneven and (yield from self.drive(rank, schedule.leaving(passed))):
                self._stopped(rank, (number, loop, -1))
                return
        if (yield from self.drive(rank, schedule.now(passed))):  # decide_now at the end of the run
            self._stopped(rank, (len(rank.plan), "end", -1))
        else:
            assert schedule.state is not State.STOPPED

    @staticmethod
    def _stopped(rank: Rank, where: tuple[int, str, int]) -> None:
        assert rank.schedule is not None
        assert rank.schedule.state is State.STOPPED
        rank.decision, rank.where = rank.schedule.decision, where

    def beat(self, rank: Rank) -> Iterator[None]:
        """The heartbeat's thread on one rank, until the job's last main generator has ended."""
        assert rank.schedule is not None
        while not (yield from self.drive(rank, rank.schedule.beat(rank.signalled, self.closing))):
            for _ in range(self.random.randrange(self.beats)):
                yield

    def run(self, turns: int = 200_000) -> None:
        mains = {rank.rank: self.main(rank) for rank in self.ranks}
        beats = {rank.rank: self.beat(rank) for rank in self.ranks} if len(self.ranks) > 1 else {}
        for _ in range(turns):
            if not mains:
                self.closing = True
            if not mains and not beats:
                return
            pool = [("main", r) for r in mains] + [("beat", r) for r in beats]
            kind, r = self.random.choice(pool)
            generators = mains if kind == "main" else beats
            try:
                next(generators[r])
            except StopIteration:
                del generators[r]
        raise AssertionError(f"deadlock: still running after {turns} turns: mains {sorted(mains)}, "
                             f"heartbeats {sorted(beats)}")


def _plans(rng: random.Random, ranks: int) -> list[list[tuple[str, int, bool]]]:
    """Training (the same length on every rank), a validation loop of uneven length, training again."""
    train = rng.randrange(1, 12)
    val = [rng.randrange(0, 5) for _ in range(ranks)]
    more = rng.randrange(1, 12)
    return [[("train", train, False), ("val", val[r], True), ("train", more, False)] for r in range(ranks)]


def _assert_unison(job: Job) -> None:
    """Every rank stops, or none; the same decision; and at the same place of the run: the same loop and, in a
    loop of the same length on every rank (training), the same boundary of it. (The decision's ``boundary`` is
    the vote's, the same everywhere by construction: where each rank was when it voted is what can differ.)"""
    decisions = {rank.rank: (rank.decision, rank.where) for rank in job.ranks}
    first = job.ranks[0]
    for rank in job.ranks:
        assert (rank.decision is None) == (first.decision is None), decisions
        if first.decision is not None and rank.decision is not None:
            same = (rank.decision.signum, rank.decision.boundary, rank.decision.signalled_rank)
            assert same == (first.decision.signum, first.decision.boundary, first.decision.signalled_rank), decisions
            assert rank.where is not None
            assert first.where is not None
            assert rank.where[:2] == first.where[:2], f"stopped in different loops: {decisions}"
            if first.where[1] != "val":  # an uneven loop: a rank may stop in it or having left it
                assert rank.where == first.where, f"stopped at different boundaries: {decisions}"


@pytest.mark.parametrize("seed", range(300))
def test_every_rank_stops_at_the_same_boundary(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([2, 3, 4])
    plans = _plans(rng, ranks)
    signalled = rng.randrange(ranks)
    total = sum(boundaries for _, boundaries, _ in plans[signalled])
    signals = {signalled: rng.randrange(1, total + 1)}
    if rng.random() < 0.3:  # a second rank signalled too, at another time
        other = rng.randrange(ranks)
        signals.setdefault(other, rng.randrange(1, sum(b for _, b, _ in plans[other]) + 1))
    job = Job(plans, signals, seed, beats=rng.choice([1, 3, 20]))
    job.run()
    _assert_unison(job)
    assert job.ranks[0].decision is not None, "a signal before the end's agreement must stop the run"
    assert job.ranks[0].decision.signalled_rank in signals  # the lowest signalled by the agreement


@pytest.mark.parametrize("seed", range(40))
def test_no_signal_no_stop_and_no_deadlock(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([2, 3, 4])
    job = Job(_plans(rng, ranks), {}, seed)
    job.run()
    assert [rank.decision for rank in job.ranks] == [None] * ranks


def test_alone_a_rank_stops_at_the_boundary_after_its_signal() -> None:
    job = Job([[("train", 6, False)]], {0: 3}, seed=0)
    job.run()
    (rank,) = job.ranks
    assert rank.decision is not None
    assert (rank.decision.boundary, rank.where) == (3, (0, "train", 2))
    assert rank.decision.boundaries_since_signal == 0


def _first_failure(seeds: int = 300) -> str | None:
    for seed in range(seeds):
        try:
            test_every_rank_stops_at_the_same_boundary(seed)
        except AssertionError as error:
            return f"seed {seed}: {error}"
    return None


def test_the_simulation_catches_ranks_that_stop_at_different_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the re-sync of the boundary counts by the vote, ranks that left a loop of uneven length count
    differently, and some seed must stop them at different boundaries: the test above can fail."""
    decided = StopSchedule._decided
    monkeypatch.setattr(StopSchedule, "_decided",
                        lambda self, vote: decided(self, dataclasses.replace(vote, boundary=self.boundary)))
    failure = _first_failure()
    assert failure is not None
    assert "stopped in different loops" in failure or "stopped at different boundaries" in failure, failure


def test_the_simulation_catches_a_rank_left_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The vote at the end of a run must be on every rank: with ranks that skip it when they have no signal of their
    own, a rank signalled after the last named boundary waits in a vote that no peer makes: some seed must deadlock."""
    now = StopSchedule.now

    def now_if_signalled(self: StopSchedule, step: int | None) -> Sequence:
        if not self._ballot().signum:
            return False
        return (yield from now(self, step))

    monkeypatch.setattr(StopSchedule, "now", now_if_signalled)
    failure = _first_failure()
    assert failure is not None
    assert "deadlock" in failure, failure


def test_the_simulation_catches_a_rank_already_past_the_named_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no lead (a rank need not read a beat's result before the boundary after the one it reported), a rank
    can be past the boundary the heartbeat names when it learns of it: it votes one boundary after the others,
    and some seed must stop it a step after them (or leave it waiting in a vote that the others never make)."""
    monkeypatch.setattr(decision, "LEAD", 0)
    failure = _first_failure()
    assert failure is not None
    assert "stopped in different loops" in failure or "stopped at different boundaries" in failure or \
        "deadlock" in failure, failure


def test_the_simulation_catches_a_rank_that_does_not_wait_for_the_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank must wait for the beat in flight before it passes the boundary that beat guards: a rank that never
    waits can learn of the named boundary after passing it, and some seed must stop it a step late."""
    monkeypatch.setattr(decision, "Wait", lambda until: Wait(lambda: True))
    failure = _first_failure()
    assert failure is not None
    assert "stopped in different loops" in failure or "stopped at different boundaries" in failure, failure
