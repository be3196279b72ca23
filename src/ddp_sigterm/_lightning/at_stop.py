"""What a Trainer's stop does besides saving: global rank 0 requeues the SLURM job, and the save names the training
loaders whose position it cannot keep."""

from __future__ import annotations

import signal
import warnings
from typing import Any

from ddp_sigterm import slurm
from ddp_sigterm._core import epoch_order
from ddp_sigterm._core.coordinator import StopCoordinator
from ddp_sigterm._core.decision import StopDecision
from ddp_sigterm._core.log import logger
from ddp_sigterm._core.stop_save import in_unison


def positionless(iterables: Any) -> list[str]:
    """The class names of the loaders in ``iterables`` (nested in lists, tuples, dicts) with no position to save."""
    if isinstance(iterables, dict):
        iterables = list(iterables.values())
    if isinstance(iterables, (list, tuple)):
        return [name for value in iterables for name in positionless(value)]
    return [] if iterables is None or epoch_order.has_state(iterables) else [type(iterables).__name__]


def requeue(trainer: Any, coordinator: StopCoordinator, decision: StopDecision, requeue_signal: int,
             step: int) -> str | None:
    """Global rank 0 requeues the job if the stop is the requeue signal's or SLURM is preempting it; returns
    ``"<job id> requeued: <why>"`` there if it did."""

    def requeue_on_rank_0() -> str | None:
        if not trainer.is_global_zero:
            return None
        if decision.requeue:
            why = f"{coordinator.integration.stop_cause} came" if decision.notice else \
                f"{signal.Signals(requeue_signal).name} is its requeue signal"
        else:
            try:
                preempt_time = slurm.preempted()
            except slurm.RequeueError as error:
                warnings.warn(f"{error}; cannot tell whether SLURM is preempting the job: it is not requeued",
                              stacklevel=2)
                return None
            if preempt_time is None:
                return None
            why = f"SLURM is preempting it (PreemptTime={preempt_time})"
        requeued = f"{slurm.requeue()} requeued: {why}"
        logger.info("rank %d of %d: SLURM job %s", trainer.global_rank, trainer.world_size, requeued)
        return requeued

    with coordinator.integration.waiting_for("`scontrol show job` / `scontrol requeue` (global rank 0)"):
        return in_unison(coordinator, requeue_on_rank_0, "requeueing the SLURM job", step)
