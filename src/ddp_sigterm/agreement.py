"""The agreement: the one collective that decides whether, and how soon again, to check for a stop.

It runs on a process group of its own, on gloo over the CPU, so it never forces a GPU sync and
never interleaves with the collectives of the training step, and it has its own timeout.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class AgreementError(RuntimeError):
    """The agreement could not complete; the message names the rank and step."""


class Agreement:
    """Cross-rank vote on ``(stop signal, next interval, still in the loop)`` over a dedicated gloo group.

    Creating it is itself a collective on the default group: every rank must construct it at the
    same point. Without an initialised default group, or with one rank, it decides locally.
    """

    def __init__(self, timeout_seconds: float) -> None:
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.group = (
            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
            if self.distributed
            else None
        )
        self._payload = torch.zeros(3, dtype=torch.int64)

    def decide(self, signum: int, interval: int, where: str, in_loop: bool = True) -> tuple[int, int, bool]:
        """Agree on a stop.

        Contract: every rank calls ``decide`` at the same points, in the same order, and all ranks
        return the same triple: the largest signal number any rank recorded (0 when no rank was
        signalled), so that any rank can trigger the stop; the smallest interval any rank proposed;
        and whether any rank is still in its loop (``in_loop``), which lets ranks that left a loop
        of uneven length keep pairing with those still in it. A rank that fails or times out
        raises :class:`AgreementError` naming ``where``.
        """
        if self.group is None:
            return signum, interval, in_loop
        self._payload[0] = signum
        self._payload[1] = -interval  # MAX of the negation is the MIN of the proposals
        self._payload[2] = int(in_loop)
        try:
            dist.all_reduce(self._payload, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as error:
            raise AgreementError(
                f"ddp_sigterm: rank {self.rank} of {self.world_size}: the stop agreement at {where} failed: {error}"
            ) from error
        return int(self._payload[0]), -int(self._payload[1]), bool(self._payload[2])

    def close(self) -> None:
        """Destroy the dedicated group. Every rank calls it at the same point; safe to call twice."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
