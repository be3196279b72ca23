"""ddp_sigterm/_core/schedule.py on N simulated ranks: no process, no thread, no clock.

Each rank is a generator that runs its plan of step boundaries through its own :class:`StopSchedule`, as
the coordinator does, and each rank's heartbeat thread is a generator that reports, all-reduces and hears
through its own :class:`HeartbeatBook`, as heartbeat.py does. The collectives are simulated: a rank that
calls one waits (yields) until every rank has made the same call, then all get the same MAX. A random
scheduler picks which generator runs next, so each seed is one interleaving of the ranks and their threads.
Whatever the interleaving, every rank must stop at the same boundary with the same decision.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Generator, Iterator

import pytest

from ddp_sigterm._core import schedule
from ddp_sigterm._core.schedule import HeartbeatBook, State, StopDecision, StopSchedule, Vote

Waiting = Generator[None, None, object]


class Collective:
    """An all-reduce MAX of ``width`` integers among ``ranks``: the k-th call of every rank pairs with the
    k-th call of every other rank, as on one process group."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.calls = [0] * ranks
        self.rounds: list[dict[int, tuple[int, ...]]] = []

    def all_reduce(self, rank: int, values: tuple[int, ...]) -> Generator[None, None, tuple[int, ...]]:
        index = self.calls[rank]
        self.calls[rank] += 1
        while len(self.rounds) <= index:
            self.rounds.append({})
        self.rounds[index][rank] = values
        while len(self.rounds[index]) < self.ranks:
            yield
        return tuple(max(column) for column in zip(*self.rounds[index].values(), strict=True))


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
    book: HeartbeatBook = dataclasses.field(default_factory=HeartbeatBook)


class Job:
    def __init__(self, plans: list[list[tuple[str, int, bool]]], signals: dict[int, int], seed: int,
                 beats: int = 4) -> None:
        self.ranks = [Rank(rank, plan, signals.get(rank)) for rank, plan in enumerate(plans)]
        self.agreement = Collective(len(plans))
        self.heartbeat = Collective(len(plans))
        self.random = random.Random(seed)
        self.beats = beats  # how many scheduler turns a heartbeat thread sleeps between beats, at most
        self.closing = False

    def _agree(self, rank: Rank, schedule_: StopSchedule, in_loop: bool) -> Generator[None, None, Vote]:
        signalled = rank.signalled
        values = (int(signalled) * 15, int(in_loop), 0, schedule_.boundary,
                  len(self.ranks) - rank.rank if signalled else 0)
        signum, anyone, requeue, boundary, lowest = yield from self.agreement.all_reduce(rank.rank, values)
        return Vote(signum, bool(anyone), bool(requeue), boundary, len(self.ranks) - lowest if lowest else None)

    def main(self, rank: Rank) -> Iterator[None]:
        """What the coordinator does on one rank, at each boundary of the plan."""
        sched = StopSchedule(alone=len(self.ranks) == 1)
        passed = 0
        for number, (loop, boundaries, uneven) in enumerate(rank.plan):
            for index in range(boundaries):
                passed += 1
                if rank.signal_at == passed:
                    rank.signalled = True
                boundary = sched.passing(passed, rank.signalled)
                while rank.book.passing(boundary):  # heartbeat.passing: wait for the result in flight
                    yield
                if sched.agrees_here(rank.book.requested, rank.signalled):
                    vote = yield from self._agree(rank, sched, in_loop=True)
                    if self._stopped(rank, sched, vote, (number, loop, index)):
                        return
                yield
            if uneven:
                vote = yield from self._agree(rank, sched, in_loop=False)
                while StopSchedule.leaving_again(vote):
                    vote = yield from self._agree(rank, sched, in_loop=False)
                if self._stopped(rank, sched, vote, (number, loop, -1)):
                    return
        vote = yield from self._agree(rank, sched, in_loop=True)  # decide_now at the end of the run
        self._stopped(rank, sched, vote, (len(rank.plan), "end", -1))

    @staticmethod
    def _stopped(rank: Rank, sched: StopSchedule, vote: Vote, where: tuple[int, str, int]) -> bool:
        """Give the vote to the schedule; record where the rank stopped, if it did."""
        rank.decision = sched.voted(vote, 0.0, None)
        assert (sched.state is State.STOPPED) == (rank.decision is not None), sched.state
        if rank.decision is not None:
            rank.where = where
        return rank.decision is not None

    def beat(self, rank: Rank) -> Iterator[None]:
        """What heartbeat.py's thread does on one rank, until the job's last main generator has ended."""
        while True:
            reported = rank.book.report()
            yield  # the thread reads the signal flag a moment after taking the boundary
            values = (int(rank.signalled), reported, int(self.closing))
            signalled, boundary, closing = yield from self.heartbeat.all_reduce(rank.rank, values)
            rank.book.heard(bool(signalled), boundary)
            if closing:
                return
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
    voted = StopSchedule.voted
    monkeypatch.setattr(StopSchedule, "voted", lambda self, vote, now, received_at: voted(
        self, dataclasses.replace(vote, boundary=self.boundary), now, received_at))
    failure = _first_failure()
    assert failure is not None
    assert "deadlock" not in failure


def test_the_simulation_catches_a_rank_already_past_the_named_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no lead (a rank need not read a heartbeat's result before the boundary after the one it
    reported), a rank can be past the boundary the heartbeat names when it learns of it: it asks for the
    agreement one boundary after the others, and some seed must stop it a step after them (or leave it waiting
    in an agreement that the others never make)."""
    monkeypatch.setattr(schedule, "LEAD", 0)
    failure = _first_failure()
    assert failure is not None
    assert "stopped in different loops" in failure or "stopped at different boundaries" in failure or \
        "deadlock" in failure, failure


def test_the_simulation_catches_a_rank_that_does_not_wait_for_the_heartbeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """heartbeat.passing must wait for the result in flight before a rank passes the boundary it guards: a rank
    that never waits can learn of the named boundary after passing it, and some seed must stop it a step late."""
    monkeypatch.setattr(HeartbeatBook, "passing", lambda self, boundary: setattr(self, "boundary", boundary))
    failure = _first_failure()
    assert failure is not None
    assert "stopped in different loops" in failure or "stopped at different boundaries" in failure, failure
