"""The agreement: the one collective that decides whether every rank stops here.

It runs on a process group of its own, on gloo over the CPU (made and destroyed by the runtime,
:class:`ddp_sigterm._core.runtime.Runtime`), so it never forces a GPU sync and never interleaves with
the collectives of the training step, and it has its own timeout. It runs only where every rank asks at
the same point: at the boundary the heartbeat names after a signal, when leaving a loop of uneven
length, and once at the end of a run.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ddp_sigterm._core.schedule import Vote


class AgreementError(RuntimeError):
    """The agreement could not complete; the message names the rank and step."""


PAYLOAD_SIZE = len(dataclasses.fields(Vote))
"""The int64 all-reduced by one agreement: one per field of :class:`Vote`."""

_LATEST = 1 << 40  # seconds since the epoch, far beyond any notice: MAX of (_LATEST - time) picks the soonest time


class Agreement:
    """Cross-rank vote on a stop over a dedicated gloo ``group`` of every rank of the default group.
    Without a group it decides locally."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = group is not None
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group = group
        self._payload = torch.zeros(PAYLOAD_SIZE, dtype=torch.int64)

    def decide(self, signum: int, where: str, in_loop: bool = True, requeue: bool = False, boundary: int = 0,
               notice: int = 0, notice_at: int = 0) -> Vote:
        """Agree on a stop.

        Contract: every rank calls ``decide`` at the same points, in the same order, and all ranks
        return the same :class:`Vote`: the largest signal number any rank recorded (0 when no rank was
        signalled), so that any rank can trigger the stop; whether any rank is still in its loop
        (``in_loop``), which lets ranks that left a loop of uneven length keep pairing with those still
        in it; whether any rank asks for the job to be requeued; the largest ``boundary`` (step
        boundaries passed), so that ranks which left a loop of uneven length count alike again; the
        lowest rank that recorded a signal (for the logs); a cloud's preemption notice some rank got
        (``notice``: the largest code) and the soonest time one gives (``notice_at``, 0 for none).
        A rank that fails or times out raises :class:`AgreementError` naming ``where``.
        """
        if self.group is None:
            return Vote(signum, in_loop, requeue, boundary, 0 if signum else None, notice, notice_at)
        self._payload[0] = signum
        self._payload[1] = int(in_loop)
        self._payload[2] = int(requeue)
        self._payload[3] = boundary
        self._payload[4] = self.world_size - self.rank if signum else 0  # MAX picks the lowest signalled rank
        self._payload[5] = notice
        self._payload[6] = _LATEST - notice_at if notice_at else 0
        self._all_reduce_max(where)
        vote = [int(value) for value in self._payload]
        return Vote(vote[0], bool(vote[1]), bool(vote[2]), vote[3], self.world_size - vote[4] if vote[4] else None,
                    vote[5], _LATEST - vote[6] if vote[6] else 0)

    def lowest_failed_rank(self, succeeded: bool, where: str) -> int | None:
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
