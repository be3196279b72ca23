"""The agreement: the one collective that decides whether, and how soon again, to check for a stop.

It runs on a process group of its own, on gloo over the CPU, so it never forces a GPU sync and
never interleaves with the collectives of the training step, and it has its own timeout.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os

import torch
import torch.distributed as dist


class AgreementError(RuntimeError):
    """The agreement could not complete; the message names the rank and step."""


class GroupUnavailable(RuntimeError):
    """The stop's own gloo groups could not be made on every rank; raised on every rank alike, the
    message names each rank that failed and why."""


@dataclasses.dataclass(frozen=True)
class Vote:
    """What every rank gets back from :meth:`Agreement.decide`."""

    signum: int  # the largest stop signal number any rank recorded, 0 if none
    interval: int  # the smallest interval any rank proposed
    anyone_in_loop: bool
    requeue: bool  # some rank recorded the job's requeue signal
    boundary: int  # the most step boundaries any rank has passed (they differ after loops of uneven length)
    signalled_rank: int | None = None  # the lowest rank (of the agreement's) that recorded a stop signal


PAYLOAD_SIZE = len(dataclasses.fields(Vote))
"""The int64 all-reduced by one agreement: one per field of :class:`Vote`."""


class Agreement:
    """Cross-rank vote on a stop over a dedicated gloo ``group`` of the global ``ranks`` (see
    :func:`cpu_groups`), never more: a Trainer, Fabric or loop that runs on fewer ranks than the default
    group (a one-device test after a multi-device fit, evaluation on a subset) must not start a
    collective the other ranks never join. Without a group it decides locally.
    """

    def __init__(self, ranks: tuple[int, ...] = (), group: dist.ProcessGroup | None = None) -> None:
        self.ranks = ranks
        self.distributed = group is not None
        self.rank = self.ranks.index(dist.get_rank()) if self.distributed else 0
        self.world_size = len(self.ranks) if self.distributed else 1
        self.group = group
        self._payload = torch.zeros(PAYLOAD_SIZE, dtype=torch.int64)

    def decide(self, signum: int, interval: int, where: str, in_loop: bool = True, requeue: bool = False,
               boundary: int = 0) -> Vote:
        """Agree on a stop.

        Contract: every rank calls ``decide`` at the same points, in the same order, and all ranks
        return the same :class:`Vote`: the largest signal number any rank recorded (0 when no rank was
        signalled), so that any rank can trigger the stop; the smallest interval any rank proposed;
        whether any rank is still in its loop (``in_loop``), which lets ranks that left a loop of
        uneven length keep pairing with those still in it; whether any rank asks for the job to be
        requeued; the largest ``boundary`` (step boundaries passed), so that ranks which left a loop
        of uneven length count alike again; and the lowest rank that recorded a signal (for the logs).
        A rank that fails or times out raises :class:`AgreementError` naming ``where``.
        """
        if self.group is None:
            return Vote(signum, interval, in_loop, requeue, boundary, 0 if signum else None)
        self._payload[0] = signum
        self._payload[1] = -interval  # MAX of the negation is the MIN of the proposals
        self._payload[2] = int(in_loop)
        self._payload[3] = int(requeue)
        self._payload[4] = boundary
        self._payload[5] = self.world_size - self.rank if signum else 0  # MAX picks the lowest signalled rank
        self._all_reduce_max(where)
        vote = [int(value) for value in self._payload]
        return Vote(vote[0], -vote[1], bool(vote[2]), bool(vote[3]), vote[4],
                    self.world_size - vote[5] if vote[5] else None)

    def first_failure(self, succeeded: bool, where: str) -> int | None:
        """After a step every rank takes in the stop (saving its checkpoint): the lowest rank on which
        it failed, or None. Contract as for :meth:`decide`: every rank calls it, all get the same answer;
        it doubles as the barrier that ends the step, so no rank waits on a peer that gave up."""
        if self.group is None:
            return None if succeeded else self.rank
        self._payload.zero_()
        self._payload[0] = 0 if succeeded else self.world_size - self.rank  # MAX picks the lowest failed rank
        self._all_reduce_max(where)
        failed = int(self._payload[0])
        return None if failed == 0 else self.world_size - failed

    def _all_reduce_max(self, where: str) -> None:
        try:
            dist.all_reduce(self._payload, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as error:
            raise AgreementError(
                f"ddp_sigterm: rank {self.rank} of {self.world_size}: the stop agreement at {where} failed: {error}"
            ) from error

    def close(self) -> None:
        """Give the dedicated group back (see :func:`release_cpu_group`). Every rank calls it at the same
        point; safe to call twice."""
        if self.group is not None:
            release_cpu_group(self.group)
        self.group = None


def members(group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group) in group-rank order; empty without an
    initialised default group. Raises ValueError if this process is not one of them."""
    if not (dist.is_available() and dist.is_initialized()):
        return ()
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if dist.get_rank() not in ranks:
        raise ValueError(f"ddp_sigterm: rank {dist.get_rank()} is not a member of the group it was given {ranks}")
    return ranks


# Groups over a subset of the default group's ranks, kept for the process's lifetime (see cpu_group), and
# those of them a coordinator is using.
_kept: dict[tuple[int, ...], list[dist.ProcessGroup]] = {}
_lent: list[dist.ProcessGroup] = []


def cpu_group(ranks: tuple[int, ...], timeout_seconds: float) -> dist.ProcessGroup:
    """A gloo group of ``ranks`` for the stop's collectives; give it back with :func:`release_cpu_group`.

    Over the whole default group it is a new group, which every rank creates at the same point. Over a
    subset, only its members take part (the other ranks do not know of it): torch then names the group
    after its ranks, and a group of the same ranks made again after the first was destroyed would meet
    the old rendezvous' keys in the store and never connect. So such groups are kept for the process's
    lifetime and lent, in the order they were made, to the next coordinator of those ranks (its members
    ask in the same order, so they get the same groups)."""
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if len(ranks) == dist.get_world_size():
        whole: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timeout)
        return whole
    kept = _kept.setdefault(ranks, [])
    group = next((g for g in kept if not any(g is lent for lent in _lent)), None)
    if group is None:
        group = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
        kept.append(group)
    _lent.append(group)
    return group


def cpu_groups(ranks: tuple[int, ...], count: int, timeout_seconds: float, connect_seconds: float,
               training_group: dist.ProcessGroup | None = None) -> list[dist.ProcessGroup]:
    """``count`` gloo groups of ``ranks`` (see :func:`cpu_group`), each given ``connect_seconds`` to
    connect, then ``timeout_seconds`` for every collective.

    Contract: every rank of ``ranks`` calls it at the same point; all of them return the groups, or all
    raise :class:`GroupUnavailable`. Gloo may fail to connect where the training's own group works (an
    NCCL job whose nodes' host names resolve to a loopback address, a second interface; docs/multi-node.md),
    and one rank may fail at once while a peer waits out the connection timeout (Gloo waits for its peers
    in turn: 5 x ``connect_seconds`` measured with 4 ranks). So after each group the ranks tell each other
    over ``training_group`` (the ranks' own group, None: the default one), which works if training does,
    and all of them stop at the first group that failed anywhere: every rank makes as many groups as the
    others, so the names torch gives later groups stay the same on every rank.
    """
    # torch < 2.3 cannot change a group's timeout once made: there the groups connect within timeout_seconds
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    made: list[dist.ProcessGroup] = []
    for _ in range(count):
        failure = None
        try:
            made.append(cpu_group(ranks, connect_seconds if set_timeout is not None else timeout_seconds))
        except Exception as error:  # told to every rank below, and raised there
            failure = f"{type(error).__name__}: {error}"
        failures: list[str | None] = [None] * len(ranks)
        dist.all_gather_object(failures, failure, group=training_group)
        if any(failures):
            for group in made:
                release_cpu_group(group)
            named = "; ".join(f"global rank {rank}: {why}" for rank, why in zip(ranks, failures) if why)
            raise GroupUnavailable(f"the stop's own gloo group of ranks {list(ranks)} could not be made "
                                   f"(connect_timeout={connect_seconds:g} s) ({named})")
        if set_timeout is not None:
            set_timeout(datetime.timedelta(seconds=timeout_seconds), made[-1])
    return made


def release_cpu_group(group: dist.ProcessGroup) -> None:
    """Destroy a group of :func:`cpu_group` over the whole default group; keep one over a subset."""
    for index, lent in enumerate(_lent):
        if lent is group:
            del _lent[index]
            return
    if dist.is_initialized():
        dist.destroy_process_group(group)


_destroy_registered_by: int | None = None


def destroy_default_group_at_exit() -> None:
    """Destroy the default process group when this process exits, if it is a gloo group (registered
    once per process; a forked child does not run its parent's registration). Only gloo: its group
    alive at exit is what aborts the interpreter, and destroying an NCCL group after a peer crashed
    can wait for that peer (Lightning registers its own exit handler for NCCL)."""
    global _destroy_registered_by
    if _destroy_registered_by == os.getpid():
        return
    _destroy_registered_by = os.getpid()
    atexit.register(_destroy_default_group, os.getpid())


def _destroy_default_group(owner: int) -> None:
    if os.getpid() == owner and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
